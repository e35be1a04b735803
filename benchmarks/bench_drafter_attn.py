"""Drafter attention on one GPU: the Triton kernel (kernels/drafter_attn.py) against the torch
path it replaces (cat + repeat_interleave + mask + SDPA), at a preset drafter's shapes; JSON out.

    python benchmarks/bench_drafter_attn.py --out benchmarks/results/drafter-attn-<stamp>.json
    python benchmarks/bench_drafter_attn.py --device cpu --contexts 64,200 --no-sweep   # smoke test

For each context L and each distinct layer kind of the drafter (full: L slots; sliding:
its ring of W-1 slots in rotated order), and for the full layer also a static view just
after its buffer doubled (capacity 2L, L+1 valid, the rest position -1):
1. checks the Triton output against the torch twin computed in fp32 (assert_close, bf16
   tolerance) and an fp32 call against the fp64 twin once;
2. times both paths: "eager" = triton.testing.do_bench (L2 flushed before every call; host
   launch gaps included, as a step without CUDA graphs pays them), "graph" =
   do_bench_cudagraph (GPU time only, L2 not flushed);
3. floor = context K/V bytes that must be read (valid slots only) / 4.24e12 B/s.
Then the attention of one drafter step (every layer) per context, and a small sweep of
tiles and split counts at the largest context (the defaults are not yet tuned on a GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from treeflash.bench.floors import H200_BANDWIDTH  # noqa: E402
from treeflash.bench.presets import PRESETS  # noqa: E402
from treeflash.bench.sweep import git_commit  # noqa: E402
from treeflash.config import DrafterConfig  # noqa: E402
from treeflash.kernels import drafter_attn as da  # noqa: E402
from treeflash.kernels import reference  # noqa: E402
from treeflash.kernels.testing import assert_close  # noqa: E402


def time_us(fn, device: torch.device, graph: bool) -> float | None:
    """Median microseconds of fn(); see the module docstring for eager vs graph."""
    if device.type != "cuda":  # smoke test: wall time, no graphs
        if graph:
            return None
        fn()
        reps = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            reps.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(reps)
    import triton.testing

    if graph:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def layer_kinds(cfg: DrafterConfig) -> dict[tuple[bool, int | None], int]:
    """(causal, window) -> how many of the drafter's layers have it."""
    kinds: dict[tuple[bool, int | None], int] = {}
    for i in range(cfg.num_hidden_layers):
        key = (cfg.is_causal_layer(i), cfg.window(i))
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


def make_inputs(cfg: DrafterConfig, context: int, window: int | None, static: bool, device, dtype,
                seed: int = 0):
    """One request with `context` committed positions, its block at context .. context+Q-1, the
    context K/V as LayerKV gives them. Full layer: slots 0..context-1 (static: all 2 x context
    slots of a buffer that has just doubled, context+1 valid, the rest position -1); sliding
    layer: its ring of W-1 slots, the last W-1 positions in rotated order.
    Returns the kernel's inputs and the number of valid context slots."""
    g = torch.Generator(device=device).manual_seed(seed)
    hkv, hq, d, nq = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim, cfg.block_size
    if window is None:
        valid = context + 1 if static else context
        cap = 2 * context if static else context
        held = torch.arange(valid, device=device)
    else:
        cap = window - 1
        valid = min(context, cap)
        held = torch.arange(context - valid, context, device=device).roll(context % max(valid, 1))
    pos = torch.full((1, cap), -1, dtype=torch.long, device=device)
    pos[0, :valid] = held
    buf_k = torch.randn(hkv, cap, d, device=device, generator=g).to(dtype)
    buf_v = torch.randn(hkv, cap, d, device=device, generator=g).to(dtype)
    q_pos = int(held.max()) + 1 + torch.arange(nq, device=device)[None]
    q = torch.randn(1, nq, hq, d, device=device, generator=g).to(dtype).transpose(1, 2)  # [1, Hq, Q, D]
    blk_k = torch.randn(1, nq, hkv, d, device=device, generator=g).to(dtype).transpose(1, 2)
    blk_v = torch.randn(1, nq, hkv, d, device=device, generator=g).to(dtype).transpose(1, 2)
    return (q, buf_k[None], buf_v[None], blk_k, blk_v, pos, q_pos), valid


def run_case(cfg, context, causal, window, static, device, dtype, bandwidth) -> dict:
    args, valid = make_inputs(cfg, context, window, static, device, dtype)
    q, ctx_k, ctx_v, blk_k, blk_v, ctx_pos, q_pos = args
    scale = cfg.head_dim ** -0.5
    what = f"L={context} window={window} static={static}"
    tri = da.drafter_attention_triton(*args, causal, window, scale)
    ref = reference.drafter_attention(*(t.float() for t in args[:5]), ctx_pos, q_pos, causal, window, scale)
    assert_close(tri, ref, dtype, what)
    del ref

    def triton_call():
        return da.drafter_attention_triton(*args, causal, window, scale)

    def torch_call():  # the drafter's torch path: its mask is built every call too
        mask = reference.drafter_block_mask(q_pos, ctx_pos, causal, window)
        return reference.drafter_sdpa(q, ctx_k, ctx_v, blk_k, blk_v, mask, scale)

    tiles, _, splits, _ = da.launch_plan(q, ctx_k)
    floor_us = 1e6 * da.kv_bytes(ctx_k.shape[1], valid, q.shape[3], q.element_size()) / bandwidth
    row = {"context": context, "causal": causal, "window": window, "static": static,
           "slots": ctx_k.shape[2], "valid": valid, "tiles": tiles.__dict__, "splits": splits,
           "floor_us": floor_us}
    for name, fn in (("triton", triton_call), ("torch", torch_call)):
        for mode in ("eager", "graph"):
            row[f"{name}_{mode}_us"] = time_us(fn, device, mode == "graph")
    row["triton_floor_fraction"] = floor_us / row["triton_eager_us"]
    row["speedup_eager"] = row["torch_eager_us"] / row["triton_eager_us"]
    return row


def check_fp32(cfg, device, context: int) -> None:
    """The fp32 path (ieee dots) against the fp64 twin, once per layer kind."""
    for causal, window in layer_kinds(cfg):
        args, _ = make_inputs(cfg, context, window, False, device, torch.float32, seed=1)
        scale = cfg.head_dim ** -0.5
        tri = da.drafter_attention_triton(*args, causal, window, scale)
        ref = reference.drafter_attention(*(t.double() for t in args[:5]), *args[5:], causal, window, scale)
        assert_close(tri, ref, torch.float32, f"fp32 L={context} window={window}")


def sweep(cfg, context, device, dtype, bandwidth) -> list[dict]:
    """Tiles x split counts of the full layer at `context` (eager figure)."""
    args, valid = make_inputs(cfg, context, None, False, device, dtype)
    scale = cfg.head_dim ** -0.5
    base, _, auto_splits, _ = da.launch_plan(args[0], args[1])
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    floor_us = 1e6 * da.kv_bytes(cfg.num_key_value_heads, valid, cfg.head_dim, args[0].element_size()) / bandwidth
    tiles = [base, da.TileConfig(base.block_m, 32, base.num_warps, 3),
             da.TileConfig(base.block_m, 128, 8, 2), da.TileConfig(base.block_m, base.block_n, base.num_warps, 4),
             da.TileConfig(base.block_m, base.block_n, base.num_warps, base.num_stages, pred_loads=False)]
    want = da.drafter_attention_triton(*args, False, None, scale)  # checked in run_case
    out = []
    for t in tiles:
        for splits in sorted({auto_splits, sms, 2 * sms, 4 * sms}):
            def call(t=t, s=splits):
                return da.drafter_attention_triton(*args, False, None, scale, tiles=t, num_splits=s)

            try:
                assert_close(call(), want, dtype, f"sweep {t} splits={splits}")
                us = time_us(call, device, False)
            except Exception as e:  # noqa: BLE001 - a tile the compiler refuses is a result too
                out.append({"tiles": t.__dict__, "splits": splits, "error": str(e)[:200]})
                continue
            out.append({"tiles": t.__dict__, "splits": splits, "us": us, "floor_fraction": floor_us / us})
    return out


def print_cases(rows: list[dict]) -> None:
    def f(x):
        return f"{'-':>9}" if x is None else f"{x:9.1f}"

    print(f"{'L':>7} {'layer':>22} {'slots':>7} {'valid':>7} {'splits':>6} {'floor us':>9} {'tri eager':>9} "
          f"{'tri graph':>9} {'torch eag':>9} {'torch grf':>9} {'floor/tri':>9} {'speedup':>7}")
    for r in rows:
        layer = ("full" if r["window"] is None else f"sliding W={r['window']}") + (" static" if r["static"] else "")
        print(f"{r['context']:>7} {layer:>22} {r['slots']:>7} {r['valid']:>7} {r['splits']:>6} "
              f"{r['floor_us']:9.2f} {f(r['triton_eager_us'])} {f(r['triton_graph_us'])} "
              f"{f(r['torch_eager_us'])} {f(r['torch_graph_us'])} {r['triton_floor_fraction']:9.2f} "
              f"{r['speedup_eager']:7.1f}")


def step_totals(cfg: DrafterConfig, rows: list[dict]) -> list[dict]:
    """Attention of one drafter step (every layer, eager views) per context: each layer kind's
    figures times the number of layers of that kind."""
    kinds = layer_kinds(cfg)
    keys = ("floor_us", "triton_eager_us", "triton_graph_us", "torch_eager_us", "torch_graph_us")
    out = []
    for context in sorted({r["context"] for r in rows}):
        mine = [r for r in rows if r["context"] == context and not r["static"]]
        tot: dict = {"context": context}
        for key in keys:
            parts = [kinds[(r["causal"], r["window"])] * r[key] if r[key] is not None else None for r in mine]
            tot[key] = None if None in parts else sum(parts)
        out.append(tot)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kimi-k2-tp8", choices=sorted(PRESETS))
    ap.add_argument("--contexts", default="1024,32768,131072,262144", help="comma-separated context lengths")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="bytes/s of the floor")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile / split sweep")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: benchmarks/results/drafter-attn-<date>-<time>.json)")
    a = ap.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    cfg = DrafterConfig.from_hf(PRESETS[a.preset].drafter)
    contexts = [int(x) for x in a.contexts.split(",")]
    t0 = time.time()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}; {a.preset} drafter: Hq={cfg.num_attention_heads} Hkv={cfg.num_key_value_heads} "
          f"D={cfg.head_dim} Q={cfg.block_size} layers={layer_kinds(cfg)}")
    check_fp32(cfg, device, min(1024, contexts[0]))
    rows = []
    for context in contexts:
        for causal, window in layer_kinds(cfg):
            rows.append(run_case(cfg, context, causal, window, False, device, dtype, a.bandwidth))
            if window is None:
                rows.append(run_case(cfg, context, causal, window, True, device, dtype, a.bandwidth))
    print_cases(rows)
    steps = step_totals(cfg, rows)
    print("one drafter step's attention (every layer), us:")
    for s in steps:
        graph = "" if s["triton_graph_us"] is None else (
            f"; graph: triton {s['triton_graph_us']:.1f}, torch {s['torch_graph_us']:.1f}")
        print(f"  L={s['context']:>7}: eager: triton {s['triton_eager_us']:.1f}, torch {s['torch_eager_us']:.1f}"
              f"{graph}; floor {s['floor_us']:.2f}")
    sw = [] if a.no_sweep else sweep(cfg, contexts[-1], device, dtype, a.bandwidth)
    ok = [s for s in sw if "us" in s]
    for s in sorted(ok, key=lambda s: s["us"])[:5]:
        print(f"  sweep L={contexts[-1]}: {s['tiles']} splits={s['splits']}: {s['us']:.1f} us "
              f"({s['floor_fraction']:.2f} of floor)")
    print(f"done in {time.time() - t0:.1f} s")
    out = a.out or str(Path(__file__).parent / "results" / f"drafter-attn-{time.strftime('%Y%m%d-%H%M%S')}.json")
    result = {"device": name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "commit": git_commit(), "preset": a.preset, "dtype": a.dtype, "bandwidth": a.bandwidth,
              "torch": torch.__version__, "triton": da.triton.__version__, "cases": rows, "steps": steps,
              "sweep": sw}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
