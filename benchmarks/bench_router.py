"""The MoE router of a large model at decode / verify sizes: the split launch
(`kernels/moe_router.py`, `moe_gate_split_triton`) against the path it replaces (x cast to float32,
a float32 cuBLAS GEMM against the cached float32 weight, the gate kernel), device time of one
call replayed in a CUDA graph, against the router weight's bytes at the device's bandwidth.

    python benchmarks/bench_router.py [--out benchmarks/results] [--rows 1,2,4,8,16,32,64]

Routers: Kimi K2 (384 experts, one group) and DeepSeek-V3 (256 experts, 8 groups, 4 kept), both
sigmoid noaux_tc top-8 over hidden 7168, bf16 weights (split_f32_weight_us: the split launch over
the float32 copy, up to SPLIT_FMA_ROWS rows: past that it needs a 16-bit weight). Every row count
is checked before it is timed and again after its graph's replays (the arrival counters must be back at zero): the same
experts as the torch twin on every row whose float64 routing margin is above 1e-4, weights
within 5e-6. The calls cycle through --layers weight sets, as a model's layers do. Prints a table
and writes JSON (GPU, date, commit, the floor of every row); exits 1 on a failed check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from benchutil import finish_checks, graph_us  # noqa: E402

from treeflash.bench import floors  # noqa: E402
from treeflash.kernels import moe_gate, reference  # noqa: E402
from treeflash.kernels.moe_router import SPLIT_FMA_ROWS, moe_gate_split_triton  # noqa: E402

# name: (experts, groups, kept groups, top_k)
ROUTERS = {"kimi-k2": (384, 1, 1, 8), "deepseek-v3": (256, 8, 4, 8)}
MARGIN = 1e-4


def _check(got, x, w, args, what: str) -> str | None:
    """None if `got` routes as the twin on every clear row; else what differs."""
    logits = F.linear(x.float(), w.float())
    w_ref, ids_ref = moe_gate(logits, *args, impl="torch")
    wt, ids = got
    o, o_ref = ids.argsort(-1), ids_ref.argsort(-1)
    ids, ids_ref = ids.gather(1, o), ids_ref.gather(1, o_ref)
    wt, w_ref = wt.gather(1, o), w_ref.gather(1, o_ref)
    bias, scoring, method, n_group, topk_group, top_k = args[:6]
    clear = reference.routing_margin(logits, bias, scoring, method, n_group, topk_group, top_k) > MARGIN
    same = (ids == ids_ref).all(-1)
    if not bool(same[clear].all()):
        return f"{what}: other experts on {int((~same & clear).sum())} clear rows"
    err = (wt - w_ref)[same].abs().max().item() if same.any() else 0.0
    return None if err <= 5e-6 else f"{what}: weights off by {err:.2e}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--calls", type=int, default=32, help="calls a graph")
    p.add_argument("--layers", type=int, default=8, help="weight sets the calls cycle through")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    bw = floors.default_ceilings(dev, dt).bandwidth
    g = torch.Generator(device=dev).manual_seed(0)
    hid, fails, rows_out = args.hidden, [], []
    print(f"{torch.cuda.get_device_name()}: hidden {hid}, {bw / 1e12:.2f} TB/s; us a call "
          f"(x the bf16 weight's bytes at that bandwidth); gemm = cast + float32 cuBLAS + gate kernel")
    for name, (e, groups, keep, k) in ROUTERS.items():
        ws = [(torch.randn(e, hid, device=dev, generator=g) / hid ** 0.5).to(dt) for _ in range(args.layers)]
        w32s = [w.float() for w in ws]  # Gate caches this copy: the gemm path does not pay the cast
        bias = 0.1 * torch.rand(e, device=dev, generator=g)
        gate_args = (bias, "sigmoid", "noaux_tc", groups, keep, k, True, 2.5)
        floor_us = 1e6 * e * hid * 2 / bw
        for t in (int(r) for r in args.rows.split(",")):
            x = (torch.randn(t, hid, device=dev, generator=g) * 2).to(dt)
            it = iter(range(10 ** 9))

            def split(x=x, it=it, ws=ws, gate_args=gate_args):
                return moe_gate_split_triton(x, ws[next(it) % args.layers], *gate_args)

            def gemm(x=x, it=it, w32s=w32s, gate_args=gate_args):
                return moe_gate(F.linear(x.float(), w32s[next(it) % args.layers]), *gate_args)

            def split32(x=x, it=it, w32s=w32s, gate_args=gate_args):
                return moe_gate_split_triton(x, w32s[next(it) % args.layers], *gate_args)

            bad = _check(moe_gate_split_triton(x, ws[0], *gate_args), x, ws[0], gate_args, f"{name} {t} rows")
            row = {"router": name, "rows": t, "experts": e, "floor_us": floor_us,
                   "split_us": graph_us(split, calls=args.calls), "gemm_us": graph_us(gemm, calls=args.calls),
                   "split_f32_weight_us": graph_us(split32, calls=args.calls) if t <= SPLIT_FMA_ROWS else None}
            bad = bad or _check(moe_gate_split_triton(x, ws[0], *gate_args), x, ws[0], gate_args,
                                f"{name} {t} rows, after the graph's replays")
            if t <= SPLIT_FMA_ROWS:
                bad = bad or _check(moe_gate_split_triton(x, w32s[0], *gate_args), x, w32s[0], gate_args,
                                    f"{name} {t} rows, float32 weight")
            row["ok"] = bad is None
            if bad:
                fails.append(bad)
            rows_out.append(row)
            print(f"{name:12s} rows {t:3d} | floor {floor_us:5.2f} us | split {row['split_us']:6.2f} "
                  f"({row['split_us'] / floor_us:4.2f}x) | gemm {row['gemm_us']:6.2f} | "
                  f"saved {row['gemm_us'] - row['split_us']:6.2f} | "
                  f"split, f32 weight {row['split_f32_weight_us'] or float('nan'):6.2f} | "
                  f"{'ok' if bad is None else bad}", flush=True)
    return finish_checks(args.out, "router-split", rows_out, fails, argv, hidden=hid, bandwidth=bw)


if __name__ == "__main__":
    sys.exit(main())
