"""How soon a PDL-launched kernel can run after its predecessor on this GPU (DESIGN_NOTES.md
1.5): the release of `griddepcontrol.wait` against a plain kernel boundary.

Two tiny kernels, 132 programs of 4 warps each (they fit beside each other on an SM):
  A  every program stamps %globaltimer at entry, spins `--spin-us`, stamps its exit;
     with TRIGGER it runs `griddepcontrol.launch_dependents` first;
  B  every program stamps its entry, runs `griddepcontrol.wait` (with PDL), stamps again.
Pairs A -> B are captured `--pairs` times in one CUDA graph (as the bench's 61 calls are) and
replayed; per pair (median over pairs, then over replays), in us:
  entry      B's first entry - A's last exit (negative: B was resident before A ended)
  released   B's first post-wait stamp - A's last exit (when B could read A's results)
  entered    B's first entry - A's first entry
Modes: `plain` (B launched as usual), `pdl` (B with launch_pdl, A triggers at its start),
`pdl-exit` (B with launch_pdl, A never triggers: the implicit trigger at its exit).
%globaltimer ticks every 256 ns on the H200, so each figure is +-0.26 us before the medians.

  PYTHONPATH=src python3 benchmarks/lab/probe_pdl.py --out $OUT     # on the GPU (~10 s)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: benchutil, compile_v5
os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MODES = ("plain", "pdl", "pdl-exit")


@triton.jit
def _primary(ST, spin_ns, TRIGGER: tl.constexpr):
    pid = tl.program_id(0)
    t0 = tl.extra.cuda.globaltimer()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    t = t0
    while t - t0 < spin_ns:
        t = tl.extra.cuda.globaltimer()
    tl.store(ST + pid * 2, t0)
    tl.store(ST + pid * 2 + 1, t)


@triton.jit
def _secondary(ST, PDL: tl.constexpr):
    pid = tl.program_id(0)
    t0 = tl.extra.cuda.globaltimer()
    if PDL:
        tl.extra.cuda.gdc_wait()
    t1 = tl.extra.cuda.globaltimer()
    tl.store(ST + pid * 2, t0)
    tl.store(ST + pid * 2 + 1, t1)


def run(mode: str, programs: int, pairs: int, spin_us: float, replays: int) -> dict:
    """The mode's three figures (module docstring), median over pairs and replays."""
    a = torch.zeros(pairs, programs, 2, dtype=torch.int64, device="cuda")
    b = torch.zeros_like(a)
    pdl = mode != "plain"

    def chain():
        for k in range(pairs):
            _primary[(programs,)](a[k], int(spin_us * 1e3), TRIGGER=mode == "pdl", num_warps=4)
            _secondary[(programs,)](b[k], PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))

    chain()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    figs = {"entry": [], "released": [], "entered": []}
    for _ in range(replays):
        g.replay()
        torch.cuda.synchronize()
        ae, ax, be, bw = (x.double() / 1e3 for x in (a[..., 0], a[..., 1], b[..., 0], b[..., 1]))
        last_exit = ax.max(1).values
        figs["entry"].append(float((be.min(1).values - last_exit).median()))
        figs["released"].append(float((bw.min(1).values - last_exit).median()))
        figs["entered"].append(float((be.min(1).values - ae.min(1).values).median()))
    return {"mode": mode, "programs": programs, "pairs": pairs, "spin_us": spin_us,
            **{k: statistics.median(v) for k, v in figs.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--pairs", type=int, default=40)
    p.add_argument("--spin-us", type=float, default=5.0)
    p.add_argument("--replays", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", flush=True)
        return 2
    from benchutil import write_rows

    programs = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)} | {programs} programs x 4 warps | spin {args.spin_us} us | "
          f"{args.pairs} pairs in a graph", flush=True)
    print(f"{'mode':<10} {'entry':>8} {'released':>9} {'entered':>8}   (us, vs A's last exit / first entry)")
    rows = []
    for mode in MODES:
        r = run(mode, programs, args.pairs, args.spin_us, args.replays)
        rows.append(r)
        print(f"{mode:<10} {r['entry']:>8.2f} {r['released']:>9.2f} {r['entered']:>8.2f}", flush=True)
    write_rows(args.out, "probe-pdl", rows, spin_us=args.spin_us, pairs=args.pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
