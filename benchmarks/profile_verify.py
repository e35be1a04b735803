"""Where one verify-attention call goes on the device (issue 4: the 32k / 64k shapes sit 10-20 us
above the floor whatever the tile rate; DESIGN_NOTES.md 1.4).

For each shape (context x heads x nodes, contiguous page 64, bf16) and variant, a CUDA graph
replays one call per layer over `--layers` layer caches (as `bench kernel`'s graph figure), and
torch.profiler records a few replays. Per call it prints: the graph's per-layer time (CUDA
events), the device span and the busy time (union of kernel intervals), every kernel's mean
duration and count, and the idle gaps between consecutive kernels (launch latency inside the
graph: what a fused combine or PDL could take back).

    PYTHONPATH=src python3 benchmarks/profile_verify.py --out $OUT          (CUDA)
    PYTHONPATH=src python3 benchmarks/profile_verify.py --shapes 32k:8x1,64k:64x1 --variants auto,portable_tree

Writes DIR/profile-verify-<date>.json (GPU, commit, every figure).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from benchutil import busy_and_gaps, write_rows  # noqa: E402  (this folder)

DEFAULT_SHAPES = "32k:8x1,32k:8x16,32k:8x32,32k:64x1,64k:8x1,64k:8x16,64k:8x32,64k:64x1,256k:8x32"


def parse_shape(text: str) -> tuple[int, int, int]:
    ctx, hn = text.split(":")
    h, n = hn.lower().split("x")
    ctx = ctx.lower()
    tokens = int(ctx[:-1]) * 1024 if ctx.endswith("k") else int(ctx)
    return tokens, int(h), int(n)


def device_intervals(prof) -> list[tuple[str, float, float]]:
    from torch.autograd import DeviceType

    evs = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in evs), key=lambda x: x[1])


def summarise(intervals, calls: int) -> dict:
    """Per call: span, busy (union), the kernels (mean us, count a call) and the gaps between
    consecutive device intervals (us)."""
    if not intervals:
        return {"error": "no device events"}
    busy, gaps = busy_and_gaps([(s, t) for _, s, t in intervals])
    span = intervals[-1][2] - intervals[0][1]
    by: dict[str, list[float]] = {}
    for name, s, t in intervals:
        by.setdefault(name, []).append(t - s)
    kernels = [{"name": k[:90], "us_mean": round(statistics.fmean(v), 2), "per_call": round(len(v) / calls, 2)}
               for k, v in sorted(by.items(), key=lambda kv: -sum(kv[1]))]
    return {"span_us_per_call": round(span / calls, 2), "busy_us_per_call": round(busy / calls, 2),
            "gap_us_per_call": round(sum(gaps) / calls, 2),
            "gap_us_median": round(statistics.median(gaps), 2) if gaps else 0.0,
            "kernels": kernels}


def profile_shape(caches_cache: dict, tokens: int, h: int, n: int, variant: str, args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from treeflash.bench.kernel import _variant_kwargs
    from treeflash.bench.kernel_checks import VARIANTS
    from treeflash.bench.kernel_timing import LayerCaches, _make_call, _time_graph, floor_s, layers_graph

    key = tokens + n
    if key not in caches_cache:
        caches_cache.clear()
        torch.cuda.empty_cache()
        caches_cache[key] = LayerCaches(args.layers, key, "contiguous")
    caches = caches_cache[key]
    kw = {} if variant == "default" else _variant_kwargs(variant, caches, tokens, n, h)
    assert variant == "default" or variant in VARIANTS
    tree = "chain" if n == 1 else "bushy"
    call, _ = _make_call(caches, tokens, n, h, tree, seed=0, **kw)
    per_layer_ms = statistics.median(_time_graph(call, args.layers, 5)) / args.layers
    graph = layers_graph(call, args.layers)  # the same graph under the profiler
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            graph.replay()
        torch.cuda.synchronize()
    del graph
    floor, _, _ = floor_s(tokens, n, h, args)
    row = {"context": tokens, "heads": h, "nodes": n, "variant": variant,
           "graph_us_per_call": round(per_layer_ms * 1e3, 2), "floor_us": round(floor * 1e6, 2),
           "fraction": round(floor / (per_layer_ms / 1e3), 3)}
    row.update(summarise(device_intervals(prof), args.layers * args.replays))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="ctx:HxN, comma separated")
    p.add_argument("--variants", default="default", help="'default' (the engine's choice) or bench variants")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--replays", type=int, default=3)
    p.add_argument("--bw", type=float, default=4.24e12)
    p.add_argument("--peak", type=float, default=779e12)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_verify needs a CUDA device", file=sys.stderr)
        return 2

    rows, caches = [], {}
    shapes = sorted((parse_shape(s) for s in args.shapes.split(",")), key=lambda s: s[0])
    for tokens, h, n in shapes:
        for variant in args.variants.split(","):
            try:
                r = profile_shape(caches, tokens, h, n, variant, args)
            except Exception as e:  # one shape failing must not lose the others
                r = {"context": tokens, "heads": h, "nodes": n, "variant": variant, "error": repr(e)}
            rows.append(r)
            if "error" in r:
                print(f"{tokens // 1024}k {h}x{n} {variant}: ERROR {r['error']}", flush=True)
                continue
            print(f"{tokens // 1024:>4}k {h:>2}x{n:<2} {variant:<8} graph {r['graph_us_per_call']:7.1f} us "
                  f"(floor {r['floor_us']:6.1f}, {r['fraction']:.2f})  span {r['span_us_per_call']:7.1f}  "
                  f"busy {r['busy_us_per_call']:7.1f}  gaps {r['gap_us_per_call']:5.1f} "
                  f"(median {r['gap_us_median']:.1f})", flush=True)
            for k in r["kernels"]:
                print(f"        {k['us_mean']:8.2f} us x {k['per_call']:.1f}  {k['name']}", flush=True)
    write_rows(args.out, "profile-verify", rows, layers=args.layers, replays=args.replays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
