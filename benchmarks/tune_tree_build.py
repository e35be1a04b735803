"""The one-launch DDTree build (kernels/tree_build.py) over its warp count. One program a request
walks 15 depths, each a bitonic top-k of ~budget * ln(budget) candidate keys, then a global top-k;
every compare-and-swap stage whose partner lies in another warp goes through shared memory and a
barrier, so fewer warps may be faster for these small arrays (the shipped pair, H200 2026-12-03:
24.5 us a step at 4 warps, budget 31, the largest spec-only kernel). Each figure: per-launch us
of a CUDA graph of 50 builds; every variant is checked equal (all six outputs) to 4 warps first.

    PYTHONPATH=src python3 benchmarks/tune_tree_build.py --out $OUT        (CUDA, ~20 s)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from benchutil import graph_us, write_rows  # noqa: E402  (this folder)

CASES = ((1, 15, 4096, 15), (1, 15, 4096, 31), (1, 15, 4096, 63), (4, 15, 4096, 31))  # batch, depth, V, budget
WARPS = (1, 2, 4, 8)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_tree_build needs a CUDA device", file=sys.stderr)
        return 2
    from treeflash.kernels.topk_lp import topk_logprobs_triton
    from treeflash.kernels.tree_build import build_ddtree_triton

    rows = []
    for b, d, v, budget in CASES:
        gen = torch.Generator(device="cuda").manual_seed(budget + b)
        x = torch.randn(b, d, v, device="cuda", generator=gen) * 3
        lp, tok = topk_logprobs_triton(x, min(budget, v))
        root = torch.randint(0, v, (b,), device="cuda", generator=gen)
        start = torch.randint(0, 1000, (b,), device="cuda", generator=gen)
        ref = build_ddtree_triton(lp, tok, root, start, budget, num_warps=4)
        line = f"batch {b} budget {budget:3d} |"
        for w in WARPS:
            try:
                got = build_ddtree_triton(lp, tok, root, start, budget, num_warps=w)
                ok = all(torch.equal(a, c) for a, c in zip(ref, got, strict=True))
                us = graph_us(lambda w=w, lp=lp, tok=tok, root=root, start=start, budget=budget:
                              build_ddtree_triton(lp, tok, root, start, budget, num_warps=w))
            except Exception as e:  # noqa: BLE001 - a warp count that fails to compile is a result
                rows.append({"batch": b, "budget": budget, "warps": w, "error": repr(e)[:200]})
                line += f" {w}w error"
                continue
            rows.append({"batch": b, "depth": d, "vocab": v, "budget": budget, "warps": w,
                         "us": round(us, 2), "equal": ok})
            line += f" {w}w {us:6.2f}{'' if ok else ' MISMATCH'}"
        print(line, flush=True)
    write_rows(args.out, "tune-tree-build", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
