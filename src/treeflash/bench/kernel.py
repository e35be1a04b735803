"""`treeflash bench kernel`: the MLA verify kernel on one GPU, every figure beside its floor.

Per layer and call: bytes >= L x D x 2 (the bf16 latent prefix; --kv-dtype fp8: L x 656, the
fp8_e4m3 rows of `kvcache.format`, `bench/kernel_fp8.py`), flops = 2 x N x H x L x
(D + v_dim); floor = max(bytes / BW, flops / PEAK) with the ceilings measured on an H200
(4.24 TB/s copy, 779 TFLOP/s bf16 matmul) when it runs on one, else a quick probe of this GPU
(`bench.floors.default_ceilings`; --bw / --peak override). Reports, per shape: the median single call
(CUDA events, after warm-up, rotating over the layer caches so nothing sits in L2), the
per-layer average of a CUDA graph that replays one call per layer over `--layers` different
layer caches (one model step), effective GB/s, TFLOP/s, fraction of the floor, and the
torch reference's time where it fits. Sections: --check (correctness on the GPU against a
float64 reference, NaN-poisoned pages), --compare (named implementations side by side), the
grid, --prefill (N = 1024 causal chunks), --defrag (a fragmented request before/after
compaction); --dcp N (one decode-context-parallel rank a layer against DCP 1, `kernel_dcp.py`);
--compile-report (no GPU: the portable kernels' sm_90 compile).
Writes one JSON file under --out (GPU name, date, git commit, every figure, the floors). How one
shape is timed: `kernel_timing.py`.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from treeflash import knobs
from treeflash.bench.kernel_checks import VARIANTS, check_gpu
from treeflash.bench.kernel_report import compile_report
from treeflash.bench.kernel_timing import D_LATENT, V_DIM, LayerCaches, _make_call, _time_graph, bench_shape, floor_s
from treeflash.flags import positive_int


def _sizes(text: str) -> list[int]:
    """'1k,8k,185k' -> [1024, 8192, 189440] (k = 1024)."""
    out = []
    for tok in text.split(","):
        tok = tok.strip().lower()
        out.append(int(float(tok[:-1]) * 1024) if tok.endswith("k") else int(tok))
    return out


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="1k,8k,32k,64k,128k,185k,256k", help="prefix lengths (k = 1024)")
    p.add_argument("--nodes", default="1,16,64", help="tree sizes N")
    p.add_argument("--heads", default="8,16,64,128", help="query heads H per GPU")
    p.add_argument("--trees", default="chain,bushy", help="tree shapes for N > 1")
    p.add_argument("--modes", default="contiguous,scattered",
                   help="contiguous = page 64 in order; scattered = page 1 shuffled (the incident)")
    p.add_argument("--scattered-contexts", default="64k", help="contexts of --compare in scattered mode")
    p.add_argument("--scattered-max-nodes", type=int, default=64, help="largest N timed in scattered mode")
    p.add_argument("--bushy-contexts", default="32k,128k", help="contexts at which bushy trees are timed")
    p.add_argument("--layers", type=int, default=61, help="layer caches replayed by the CUDA graph")
    p.add_argument("--reps", type=int, default=20, help="max timed single calls per shape")
    p.add_argument("--graph-replays", type=int, default=3)
    p.add_argument("--graph-max-ms", type=float, default=8.0,
                   help="single calls longer than this skip the graph (launch cost < 0.1%%)")
    p.add_argument("--torch-max-gb", type=float, default=3.0, help="skip the torch reference above this")
    p.add_argument("--torch-max-context", type=_sizes, default=[65536])
    p.add_argument("--no-grid", action="store_true")
    p.add_argument("--check", action="store_true", help="correctness pass on the GPU first")
    p.add_argument("--check-only", default="",
                   help="only check cases whose variant starts so, e.g. hopper or portable (comma: any of)")
    p.add_argument("--prefill", default="", help="contexts for N=1024 causal chunks, e.g. 32k,64k,128k,185k")
    p.add_argument("--prefill-heads", default="64,128")
    p.add_argument("--defrag", default="", help="context of a fragmented request to defragment, e.g. 128k")
    p.add_argument("--compare", default="",
                   help="time named implementations side by side instead of the grid, e.g. "
                        "auto,portable_tree,portable (see VARIANTS); --contexts/--heads/--nodes/"
                        "--modes pick the shapes, --prefill adds N=1024 chunks")
    p.add_argument("--compile-report", action="store_true",
                   help="no GPU: compile the portable split kernels for sm_90 here and report "
                        "registers, spills, shared memory (run with TRITON_INTERPRET=0)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="stop timing new shapes after this many seconds (0: no limit)")
    p.add_argument("--bw", type=float, default=None,
                   help="copy ceiling, bytes/s (default: the H200's 4.24e12 on an H200, else probed)")
    p.add_argument("--peak", type=float, default=None,
                   help="bf16 matmul ceiling, flop/s (default: the H200's 779e12 on an H200, else probed)")
    p.add_argument("--kv-dtype", type=_kv_dtypes, default="bf16",
                   help="the layer caches' rows: bf16, fp8 (fp8_e4m3, 656 bytes a row) or bf16,fp8 (each "
                        "shape of --check / the grid / --compare / --prefill for both, side by side)")
    p.add_argument("--dcp", type=positive_int, default=1,
                   help="N > 1: instead of the grid, one rank of a decode-context-parallel group of N a layer "
                        "against DCP 1 at each of --contexts (`bench/kernel_dcp.py`)")
    p.add_argument("--dcp-rows", default="1,32", help="with --dcp: new rows a step (1: plain decode; more: a tree)")
    p.add_argument("--dcp-heads", type=int, default=8, help="with --dcp: query heads a rank (Kimi K2 at TP8: 8)")
    p.add_argument("--dcp-cache-gb", type=float, default=8.0,
                   help="with --dcp: the layer caches' memory; past it fewer distinct caches than --layers")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="", help="suffix of the JSON file name")


def _kv_dtypes(text: str) -> list[str]:
    from treeflash.bench.kernel_fp8 import kv_dtypes

    try:
        return kv_dtypes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _variant_kwargs(name: str, caches, ctx: int, n: int, h: int) -> dict:
    return VARIANTS[name](n * h)


def compare(args) -> list[dict]:
    """Named variants per shape (graph per-layer figures), each checked against the first."""
    names = [v for v in args.compare.split(",") if v]
    rows, t0 = [], time.time()
    shapes = [("prefill", ctx, _ints(args.prefill_heads), [1024], True)
              for ctx in (_sizes(args.prefill) if args.prefill else [])]
    modes = [m for m in args.modes.split(",") if m]
    cont = _sizes(args.contexts) if "contiguous" in modes else []
    scat = _sizes(args.scattered_contexts) if "scattered" in modes else []
    for ctx in cont + [c for c in scat if c not in cont]:  # scattered beside contiguous
        for mode, ctxs in (("contiguous", cont), ("scattered", scat)):
            if ctx in ctxs:
                shapes.append((mode, ctx, _ints(args.heads), _ints(args.nodes), False))
    for (mode, ctx, heads, nodes, is_prefill), kv_dtype in itertools.product(shapes, args.kv_dtype):
        if args.budget_s and time.time() - t0 > args.budget_s:
            print(f"budget: skipped {mode} {ctx} {kv_dtype}", flush=True)
            continue
        caches = LayerCaches(3 if is_prefill else args.layers, ctx + max(nodes),
                             "contiguous" if mode == "prefill" else mode, seed=ctx, kv_dtype=kv_dtype)
        for h in heads:
            for n in nodes:
                if args.budget_s and time.time() - t0 > args.budget_s:
                    break
                ref, out_row = None, {"mode": mode, "context": ctx, "n": n, "h": h, "kv_dtype": kv_dtype,
                                      "tree": "chain", "variants": {}}
                seen = {}
                for name in names:
                    try:
                        kw = _variant_kwargs(name, caches, ctx, n, h)
                        key = str(sorted(kw.items()))
                        if key in seen:  # the same kernel and plan as an earlier variant
                            out_row["variants"][name] = dict(out_row["variants"][seen[key]],
                                                             same_as=seen[key])
                            continue
                        seen[key] = name
                        r = bench_shape(caches, ctx, n, h, "chain", args, graph=not is_prefill,
                                        torch_ref=False, **kw)
                        o = _make_call(caches, ctx, n, h, "chain", 0, **kw)[0](0)[0].float()
                        ref = o if ref is None else ref
                        r["vs_first"] = ((o - ref).abs().max() / ref.abs().max()).item()
                        r["finite"] = bool(torch.isfinite(o).all())
                        r.pop("single_all_ms", None)
                    except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                        r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    out_row["variants"][name] = r
                    out_row.setdefault("floor_ms", r.get("floor_ms"))
                rows.append(out_row)
                _print_compare(out_row, names)
                with open(Path(args.out) / "compare-rows.jsonl", "a") as f:
                    f.write(json.dumps(out_row, default=str) + "\n")
        del caches
        torch.cuda.empty_cache()
    return rows


def _print_compare(r: dict, names: list[str]) -> None:
    cells = []
    for name in names:
        v = r["variants"].get(name, {})
        if "error" in v:
            cells.append(f"{name}=ERR")
        elif v:
            bad = "" if v.get("finite") and v.get("vs_first", 1) <= 2e-2 else "!"
            cells.append(f"{name}={v['step_ms'] * 1e3:.1f}us/{v['frac_floor']:.2f}{bad}"
                         f"(s{v['splits']})")
    print(f"cmp {r['mode']:10s} {r.get('kv_dtype', 'bf16'):4s} L={r['context']:7d} N={r['n']:4d} H={r['h']:3d} "
          f"floor {(r.get('floor_ms') or 0) * 1e3:8.1f}us  " + "  ".join(cells), flush=True)


def compare_summary(rows: list[dict], names: list[str]) -> str:
    lines = ["fraction of floor per variant (graph per-layer; prefill: single call)",
             f"{'mode':10s} {'kv':4s} {'ctx':>5s} {'H':>4s} {'N':>5s} " + " ".join(f"{n:>7s}" for n in names)]
    for r in rows:
        cells = []
        for name in names:
            v = r["variants"].get(name, {})
            cells.append(f"{v['frac_floor']:7.2f}" if "frac_floor" in v else f"{'err':>7s}")
        kv = r.get("kv_dtype", "bf16")
        lines.append(f"{r['mode']:10s} {kv:4s} {r['context'] // 1024:4d}k {r['h']:4d} {r['n']:5d} "
                     + " ".join(cells))
    return "\n".join(lines)


# ---------------------------------------------------------------- sections
def grid(args) -> list[dict]:
    rows = []
    contexts, heads, nodes = _sizes(args.contexts), _ints(args.heads), _ints(args.nodes)
    bushy_ctx = set(_sizes(args.bushy_contexts))
    trees = [t for t in args.trees.split(",") if t]
    t0, over = time.time(), False
    for mode in [m for m in args.modes.split(",") if m]:
        for ctx, kv_dtype in itertools.product(contexts, args.kv_dtype):  # both dtypes back to back
            if kv_dtype == args.kv_dtype[0]:  # the budget is checked a context, so its dtypes stay paired
                over = bool(args.budget_s) and time.time() - t0 > args.budget_s
            if over:
                print(f"budget: skipped {mode} {ctx} {kv_dtype}", flush=True)
                continue
            caches = LayerCaches(args.layers, ctx + max(nodes), mode, seed=ctx, kv_dtype=kv_dtype)
            for h in heads:
                for n in nodes:
                    if mode == "scattered" and n > args.scattered_max_nodes:
                        continue
                    for tree in (["chain"] if n == 1 else trees):
                        if tree != "chain" and ctx not in bushy_ctx:
                            continue
                        try:
                            row = bench_shape(caches, ctx, n, h, tree, args)
                        except Exception as e:  # noqa: BLE001 - record and keep going
                            row = {"context": ctx, "n": n, "h": h, "tree": tree, "kv_dtype": kv_dtype,
                                   "error": f"{type(e).__name__}: {str(e)[:300]}"}
                        row["mode"] = mode
                        rows.append(row)
                        _print_row(row)
                        with open(Path(args.out) / "grid-rows.jsonl", "a") as f:  # survives a cut-off
                            f.write(json.dumps(row, default=str) + "\n")
            del caches
            torch.cuda.empty_cache()
    return rows


def prefill(args) -> list[dict]:
    rows = []
    for ctx, kv_dtype in itertools.product(_sizes(args.prefill), args.kv_dtype):
        caches = LayerCaches(3, ctx + 1024, "contiguous", seed=ctx + 1, kv_dtype=kv_dtype)
        for h in _ints(args.prefill_heads):
            try:
                row = bench_shape(caches, ctx, 1024, h, "chain", args, graph=False, torch_ref=False)
            except Exception as e:  # noqa: BLE001
                row = {"context": ctx, "n": 1024, "h": h, "kv_dtype": kv_dtype,
                       "error": f"{type(e).__name__}: {e}"[:300]}
            row["mode"] = "prefill"
            row["frac_peak"] = row.get("tflops", 0) * 1e12 / args.peak
            rows.append(row)
            _print_row(row)
        del caches
        torch.cuda.empty_cache()
    return rows


def defrag(args, device: str = "cuda") -> dict:
    """A request scattered over page-1 slots (the incident's layout), timed; compacted
    (`kvcache.defrag.compact`) and timed again through the same page-1 table (the gathered-row
    kernels still run: page_size 1 holds no 64-row tile) and through its coarse view
    (`kvcache.coarse`: the compacted pages read as 64-row pages, so the default page-64 kernel
    runs); and, for the side by side, the same request in a page-64 pool allocated in order.
    Every layout must give the same outputs (the coarse and page-64 ones bitwise alike).
    `device` other than CUDA: tests only (the caller replaces `_time_graph`)."""
    from treeflash.kernels.mla_verify import mla_verify_attention_triton
    from treeflash.kvcache import KVPool
    from treeflash.kvcache.coarse import coarse_kv, coarsen
    from treeflash.kvcache.defrag import compact, num_runs

    ctx = _sizes(args.defrag)[0]
    n, h, out = 16, 8, {"context": ctx, "nodes": 16, "heads": 8}
    pages_total = -(-(ctx + 4096) // 64) * 64  # whole coarse pages
    pool = KVPool(args.layers, pages_total, 1, D_LATENT, torch.bfloat16, device, scattered=True)
    pool.kv.normal_()
    pages = pool.allocator.allocate(ctx + n)
    q = torch.randn(1, n, h, D_LATENT, device=device, dtype=torch.bfloat16)
    prefix = torch.tensor([ctx], dtype=torch.int32, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def measure(tag, kv_of, table, runs):
        fn = lambda layer: mla_verify_attention_triton(q, kv_of(layer), table, prefix, None,  # noqa: E731
                                                       0.07, V_DIM)
        reps = _time_graph(fn, args.layers, args.graph_replays)
        out[f"{tag}_runs"] = runs
        out[f"{tag}_graph_per_layer_ms"] = statistics.median(reps) / args.layers
        return fn(0)[0]

    before = measure("before", lambda l: pool.kv[l], pool.page_table([pages]), num_runs(pages))
    sync()
    t0 = time.perf_counter()
    out["pages_moved"] = compact(pool, [pages])
    sync()
    out["defrag_ms"] = (time.perf_counter() - t0) * 1e3
    after = measure("after", lambda l: pool.kv[l], pool.page_table([pages]), num_runs(pages))
    out["outputs_identical"] = bool(torch.equal(before, after))
    coarse = coarsen([pages], 1, pool.num_pages)
    out["coarse"] = coarse is not None
    if coarse is not None:
        table = torch.tensor(coarse, dtype=torch.int32, device=device)
        viewed = measure("after_coarse", lambda l: coarse_kv(pool.kv[l], 64), table,
                         num_runs(coarse[0]))
        out["coarse_max_abs_diff"] = float((viewed.float() - after.float()).abs().max())
        # the same request in a page-64 pool, in order: the contiguous figure of the grid
        cont = KVPool(args.layers, pages_total // 64, 64, D_LATENT, torch.bfloat16, device)
        cpages = cont.allocator.allocate(-(-(ctx + n) // 64))
        cont.kv.view(args.layers, -1, D_LATENT)[:, :pages_total] = pool.kv.view(args.layers, -1, D_LATENT)
        contiguous = measure("contiguous", lambda l: cont.kv[l], cont.page_table([cpages]),
                             num_runs(cpages))
        out["coarse_equals_contiguous"] = bool(torch.equal(viewed, contiguous))
        cont.kv = None
    fl, _, _ = floor_s(ctx, n, h, args)
    out["floor_ms"] = fl * 1e3
    us = {k[:-len("_graph_per_layer_ms")]: v * 1e3 for k, v in out.items() if k.endswith("_graph_per_layer_ms")}
    print(f"defrag {ctx} ({h} x {n}): scattered {out['before_runs']} runs {us['before']:.1f} us -> "
          f"compacted, page-1 table {us['after']:.1f} us"
          + (f", coarse view {us['after_coarse']:.1f} us (page-64 pool in order "
             f"{us['contiguous']:.1f} us)" if coarse is not None else ", no coarse view")
          + f"; floor {fl * 1e6:.1f} us; moved {out['pages_moved']} pages x {args.layers} layers in "
          f"{out['defrag_ms']:.1f} ms; identical outputs: {out['outputs_identical']}"
          + (f", coarse = page-64: {out['coarse_equals_contiguous']}" if coarse is not None else ""),
          flush=True)
    pool.kv = None  # free the pool's memory before the next section
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- report
def _print_row(r: dict) -> None:
    kv = r.get("kv_dtype", "bf16")
    if "error" in r:
        print(f"{r.get('mode', ''):10s} {kv:4s} L={r['context']:7d} N={r['n']:4d} H={r['h']:3d} "
              f"{r['tree']:5s} ERROR {r['error']}", flush=True)
        return
    g = r["graph_per_layer_ms"]
    t = r.get("torch_ms")
    print(f"{r.get('mode', ''):10s} {kv:4s} L={r['context']:7d} N={r['n']:4d} H={r['h']:3d} {r['tree']:5s} "
          f"single {r['single_ms'] * 1e3:9.1f} us  graph/layer "
          f"{(g * 1e3 if g else float('nan')):9.1f} us  floor {r['floor_ms'] * 1e3:9.1f} us  "
          f"{r['frac_floor']:.2f}  {r['gbps']:6.0f} GB/s {r['tflops']:5.0f} TF/s  "
          f"torch {(f'{t * 1e3:9.0f} us' if t else 'skipped')}  splits={r['splits']}", flush=True)


def summary(rows: list[dict], contexts: list[int]) -> str:
    """Fraction of floor (graph per-layer, else single call) per shape and context."""
    lines = ["fraction of floor (per-layer in the 61-call graph; each cache dtype against its own bytes)",
             f"{'mode':10s} {'kv':4s} {'H':>4s} {'N':>4s} {'tree':5s} "
             + " ".join(f"{c // 1024:>5d}k" for c in contexts)]
    keys = []
    for r in rows:
        k = (r.get("mode"), r.get("kv_dtype", "bf16"), r["h"], r["n"], r["tree"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        cells = []
        for c in contexts:
            hit = [r for r in rows if (r.get("mode"), r.get("kv_dtype", "bf16"), r["h"], r["n"], r["tree"]) == k
                   and r["context"] == c]
            cells.append(f"{hit[0]['frac_floor']:6.2f}" if hit and "frac_floor" in hit[0] else "     -")
        lines.append(f"{k[0]:10s} {k[1]:4s} {k[2]:4d} {k[3]:4d} {k[4]:5s} " + " ".join(cells))
    return "\n".join(lines)


def _check_fp8(args) -> list[dict]:
    from treeflash.bench.kernel_fp8 import check_gpu_fp8

    return check_gpu_fp8(args)


def _dcp(args) -> list[dict]:
    from treeflash.bench.kernel_dcp import dcp_section

    return dcp_section(args)


def _commit() -> str:
    from treeflash.bench.sweep import git_commit
    return git_commit()


def run(args) -> dict:
    import triton

    if args.compile_report:
        rows = compile_report(args)
        path = Path(args.out) / f"compile-report-sm90{('-' + args.tag) if args.tag else ''}.json"
        path.write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1))
        print(f"wrote {path}")
        return {"compile_report": rows}
    assert torch.cuda.is_available(), "bench kernel needs a GPU"
    from treeflash.bench import floors

    ceilings = floors.default_ceilings(torch.device("cuda"), torch.bfloat16, args.bw, args.peak)
    args.bw, args.peak = ceilings.bandwidth, ceilings.matmul
    print(f"ceilings: {args.bw / 1e12:.2f} TB/s, {args.peak / 1e12:.0f} TFLOP/s ({ceilings.source})", flush=True)
    t_start = time.time()
    res = {"gpu": torch.cuda.get_device_name(0),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": _commit(), "switches": knobs.switched(), "torch": torch.__version__, "triton": triton.__version__,
           "ceilings": {"bytes_per_s": args.bw, "flops_per_s": args.peak, "source": ceilings.source},
           "floor": "max(L*row_bytes / bytes_per_s, 2*N*H*L*(576+512) / flops_per_s), one layer; "
                    "row_bytes 1152 (bf16) or 656 (fp8_e4m3)",
           "args": {k: (v if isinstance(v, (int, float, str, list)) else str(v))
                    for k, v in vars(args).items() if k != "func"}}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"kernel-{stamp}{('-' + args.tag) if args.tag else ''}.json"
    sections = [("check", args.check and "bf16" in args.kv_dtype, check_gpu),
                ("check_fp8", args.check and "fp8" in args.kv_dtype, _check_fp8),
                ("compare", bool(args.compare), compare),
                ("prefill", bool(args.prefill) and not args.compare, prefill),
                ("defrag", bool(args.defrag), defrag),
                ("dcp", args.dcp > 1, _dcp),
                ("grid", not args.no_grid and not args.compare and args.dcp == 1, grid)]
    for name, wanted, fn in sections:  # saved after each section: a cut-off run keeps the rest
        if wanted:
            try:
                res[name] = fn(args)
            except Exception:  # noqa: BLE001 - keep the other sections' figures
                traceback.print_exc()
                res[name + "_error"] = traceback.format_exc()[-2000:]
            res["wall_s"] = time.time() - t_start
            path.write_text(json.dumps(res, indent=1, default=str))
    if res.get("grid"):
        print(summary(res["grid"], _sizes(args.contexts)))
        if len(args.kv_dtype) > 1:
            from treeflash.bench.kernel_fp8 import speedup_table

            print(speedup_table(res["grid"]))
    if res.get("compare"):
        print(compare_summary(res["compare"], [v for v in args.compare.split(",") if v]))
    if res.get("prefill"):
        for r in res["prefill"]:
            if "error" not in r:
                print(f"prefill L={r['context']} H={r['h']}: {r['single_ms']:.2f} ms "
                      f"{r['tflops']:.0f} TFLOP/s = {r['frac_peak']:.2f} of matmul peak")
    for name in ("check", "check_fp8"):
        if res.get(name):
            print(f"{name}:", "all ok" if all(c["ok"] is not False for c in res[name]) else "FAILURES")  # None: n/a
    print(f"wrote {path} ({res['wall_s']:.0f} s)")
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treeflash bench kernel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["add_arguments", "main", "run", "floor_s"]
