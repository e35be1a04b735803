"""Where a verify call's time goes outside the CTAs' tile loops (DESIGN_NOTES.md 1.4).

The profile (H200, 2026-12-03, benchmarks/profile_verify.py) put a 32k 8 x 1 call at ~17 us of
split kernel + 2.8 us of combine, while the traced CTAs ran only ~11.5 us. This script replays
the bench's CUDA graph (one call per layer over `--layers` layer caches, as `treeflash bench
kernel` times it) with the v5 split kernel compiled with EDGES: every CTA of every call stamps
%globaltimer at its entry, where its partitions start, and after they have all ended. From the
stamps, per call (median over the graph's calls):

  entry spread   last CTA entry - first CTA entry (how long the grid takes to become resident)
  prologue       a CTA's entry -> its partitions' start (barrier init, Q request)
  body           partitions' start -> all ended (tile loop, epilogue, stores), median and max
  span           first entry -> last exit of the split kernel
  between        last exit of call k -> first entry of call k + 1 (the combine, the launches,
                 the kernel boundaries)
  period         first entry of call k -> of call k + 1 (= the graph's per-layer time)

Variants: `default` (the default kernel and combine), `nocombine` (the combine not launched:
what a kernel boundary costs alone; outputs wrong, timing only), `carve` (the combine kernel
with cudaFuncAttributePreferredSharedMemoryCarveout = 100, the split kernel's shared-memory
configuration: does switching the SM's L1 / shared split between kernels cost time?), and the
bench variant `v5bw` (the default without the staged store). The PDL, fused-combine and
L2-prefetch variants measured here on 2026-12-03/04 (v5e, v5cwpc, v5cwpe*, v5cwla*) were removed
in 29133dd (git 4efd675). Each variant's graph is timed without EDGES too (`graph us`), so the
stamps' own cost shows.

  PYTHONPATH=src python3 benchmarks/lab/edges_v5.py --out $OUT        # on the H200 (~1-2 min)

Writes edges-v5-<date>.json under --out (GPU, date, commit, per shape and variant: the table's
figures and one call's raw stamps).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchutil
os.environ.setdefault("TRITON_INTERPRET", "0")

SHAPES = (  # (name, context, nodes, heads, tree)
    ("8x1-32k", 32768, 1, 8, "chain"),
    ("8x1-64k", 65536, 1, 8, "chain"),
    ("64x1-64k", 65536, 1, 64, "chain"),
    ("8x16-64k", 65536, 16, 8, "bushy"),
    ("8x32-64k", 65536, 32, 8, "bushy"),
    ("128x1-256k", 262144, 1, 128, "chain"),
    ("8x16-256k", 262144, 16, 8, "bushy"),
)
VARIANTS = ("default", "nocombine", "carve", "v5bw")
# bench_kernel variants (treeflash.bench.kernel.VARIANTS)
CONFIG_VARIANTS = ("v5bw",)
CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


def _set_carveout(kernel, percent: int) -> None:
    """cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT) on a compiled Triton kernel."""
    kernel._init_handles()
    lib = ctypes.CDLL("libcuda.so.1")
    rc = lib.cuFuncSetAttribute(ctypes.c_void_p(kernel.function),
                                CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, percent)
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute failed: CUresult {rc}")


class _Combine:
    """Stands in for mla_verify._mla_combine_kernel: skip it, or launch it with a carveout."""

    def __init__(self, real, mode: str):
        self.real, self.mode, self.done = real, mode, set()

    def __getitem__(self, grid):
        def launch(*args, **kw):
            if self.mode == "nocombine":
                return None
            k = self.real[grid](*args, **kw)
            if id(k) not in self.done:
                _set_carveout(k, 100)
                self.done.add(id(k))
            return k
        return launch


def _stats(ed, layers: int) -> dict:
    """Per-call figures (us) from ed [layers, CTAs, 4] (int64 ns), median over calls 1 .. L-2."""
    import torch

    entry, ws, exit_ = ed[..., 0].double(), ed[..., 1].double(), ed[..., 2].double()
    rows = {k: [] for k in ("entry_spread", "prologue", "body_med", "body_max", "span",
                            "between", "period", "late_exit_entry_offset", "exit_spread")}
    for k in range(1, layers - 1):
        e0, e1, e2 = entry[k], ws[k], exit_[k]
        t0 = e0.min()
        rows["entry_spread"].append(float(e0.max() - t0))
        rows["prologue"].append(float((e1 - e0).median()))
        body = e2 - e1
        rows["body_med"].append(float(body.median()))
        rows["body_max"].append(float(body.max()))
        rows["span"].append(float(e2.max() - t0))
        rows["exit_spread"].append(float(e2.max() - e2.median()))
        late = int(torch.argmax(e2))
        rows["late_exit_entry_offset"].append(float(e0[late] - t0))
        rows["between"].append(float(entry[k + 1].min() - e2.max()))
        rows["period"].append(float(entry[k + 1].min() - t0))
    return {k: statistics.median(v) / 1e3 for k, v in rows.items()}


def run_shape(name, ctx, n, h, tree, variant, layers, replays, seed=0) -> dict:
    import torch
    from benchutil import replay_us

    from treeflash.bench.kernel import VARIANTS as BENCH_VARIANTS
    from treeflash.bench.kernel import LayerCaches, _make_call, layers_graph
    from treeflash.kernels import mla_verify
    from treeflash.kernels import mla_verify_v5 as v5

    caches = LayerCaches(layers, ctx + n, "contiguous", seed)
    kw = BENCH_VARIANTS[variant](n * h) if variant in CONFIG_VARIANTS else {}
    call, _ = _make_call(caches, ctx, n, h, tree, seed, **kw)
    state = {"edges": None, "layer": 0, "grid": None}
    orig_launch, orig_combine = v5.launch_v5, mla_verify._mla_combine_kernel

    def wrapped(grid, *a, **kw):
        state["grid"] = list(grid)
        if state["edges"] is not None:
            kw["edges"] = state["edges"][state["layer"]]
        return orig_launch(grid, *a, **kw)

    def fn(layer):
        state["layer"] = layer
        return call(layer)

    v5.launch_v5 = wrapped
    if variant in ("nocombine", "carve"):
        mla_verify._mla_combine_kernel = _Combine(orig_combine, variant)
    try:
        def timed(graph):
            return replay_us(graph, replays, layers)

        g = layers_graph(fn, layers)  # no EDGES: the figure bench_kernel reports
        plain_us = timed(g)
        del g
        grid = state["grid"]
        ctas = grid[0] * grid[1] * grid[2]
        buf = torch.full((layers, ctas * len(v5.EDGE_FIELDS)), -1, dtype=torch.int64, device="cuda")
        state["edges"] = buf
        g = layers_graph(fn, layers)
        edges_us = timed(g)
        buf.fill_(-1)
        g.replay()
        torch.cuda.synchronize()
        del g
        ed = buf.view(layers, ctas, len(v5.EDGE_FIELDS)).cpu()
    finally:
        v5.launch_v5 = orig_launch
        mla_verify._mla_combine_kernel = orig_combine
        state["edges"] = None
    missing = int((ed[..., :3] < 0).sum())
    row = {"shape": name, "variant": variant, "context": ctx, "n": n, "h": h, "tree": tree,
           "grid": grid, "ctas": ctas, "graph_us": plain_us, "graph_edges_us": edges_us,
           "missing_stamps": missing}
    if missing:
        row["error"] = f"{missing} stamps not written"
        return row
    row.update(_stats(ed, layers))
    row["raw_call_1"] = ed[1].tolist()
    del caches
    torch.cuda.empty_cache()
    return row


COLS = ("graph_us", "graph_edges_us", "period", "span", "between", "entry_spread", "prologue",
        "body_med", "body_max", "exit_spread", "late_exit_entry_offset")


def gpu_run(args) -> int:
    import torch

    from treeflash.bench.sweep import git_commit

    if not torch.cuda.is_available():
        print("no CUDA device", flush=True)
        return 2
    t0 = time.time()
    res = {"gpu": torch.cuda.get_device_name(0),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "torch": torch.__version__, "layers": args.layers,
           "units": "us", "rows": []}
    print(f"{res['gpu']} | commit {res['commit']} | {res['date']} | {args.layers} layers", flush=True)
    print(f"{'shape':<12} {'variant':<10} {'grid':<14} " + " ".join(f"{c[:13]:>13}" for c in COLS),
          flush=True)
    status = 0
    shapes = [s for s in SHAPES if not args.shape or s[0] in args.shape]
    for name, ctx, n, h, tree in shapes:
        for variant in args.variants:
            try:
                row = run_shape(name, ctx, n, h, tree, variant, args.layers, args.replays)
            except Exception as e:  # noqa: BLE001 - a failing variant is the result
                msg = f"{type(e).__name__}: {str(e)[:3000]}"
                print(f"{name} {variant}: FAILED {msg}", flush=True)
                traceback.print_exc()
                res["rows"].append({"shape": name, "variant": variant, "error": msg})
                status = 2
                continue
            res["rows"].append(row)
            if "error" in row:
                print(f"{name:<12} {variant:<10} {row['error']}", flush=True)
                status = 2
                continue
            print(f"{name:<12} {variant:<10} {str(row['grid']):<14} "
                  + " ".join(f"{row[c]:>13.2f}" for c in COLS), flush=True)
        if time.time() - t0 > args.budget_s:
            print(f"budget {args.budget_s} s reached; the rest skipped", flush=True)
            break
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"edges-v5-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path} ({time.time() - t0:.1f} s)", flush=True)
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--shape", action="append", default=[], help=f"only these: {[s[0] for s in SHAPES]}")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--replays", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=150.0)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {VARIANTS}")
    return gpu_run(args)


if __name__ == "__main__":
    sys.exit(main())
