"""The tree build's top-k kernel (kernels/topk_lp.py) over its warp count, against torch's
log_softmax + topk (H200, 2026-12-03, check_fused.py: 15.6 us at 8 warps for [1, 15, 4096] k = 31
against torch's 31.5 us). Each figure: per-launch us of a CUDA graph of 50 launches; every
variant is checked equal (tokens) to the 8-warp default first.

    PYTHONPATH=src python3 benchmarks/tune_topk.py --out $OUT        (CUDA, ~10 s)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from benchutil import graph_us, write_rows  # noqa: E402  (this folder)

CASES = ((1, 15, 4096, 31), (1, 15, 4096, 15))  # the pair at budgets 31 / 15 (each warp count compiles once)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_topk needs a CUDA device", file=sys.stderr)
        return 2
    from treeflash.kernels.topk_lp import topk_logprobs_triton

    rows = []
    for b, d, v, k in CASES:
        x = torch.randn(b, d, v, device="cuda", generator=torch.Generator(device="cuda").manual_seed(k)) * 3
        ref_lp, ref_tok = topk_logprobs_triton(x, k)
        torch_us = graph_us(lambda x=x, k=k: torch.log_softmax(x.float(), dim=-1).topk(k, dim=-1))
        line = f"[{b}, {d}, {v}] k={k:<3d} torch {torch_us:6.2f} us |"
        for w in (4, 8, 16, 32):
            try:
                lp, tok = topk_logprobs_triton(x, k, num_warps=w)
                ok = bool(torch.equal(tok, ref_tok)) and bool(torch.equal(lp, ref_lp))
                us = graph_us(lambda x=x, k=k, w=w: topk_logprobs_triton(x, k, num_warps=w))
            except Exception as e:  # noqa: BLE001 - a warp count that fails to compile is a result
                rows.append({"shape": [b, d, v], "k": k, "warps": w, "error": repr(e)[:200]})
                line += f" {w}w error"
                continue
            rows.append({"shape": [b, d, v], "k": k, "warps": w, "us": round(us, 2), "equal": ok,
                         "torch_us": round(torch_us, 2)})
            line += f" {w}w {us:5.2f}{'' if ok else ' MISMATCH'}"
        print(line, flush=True)
    write_rows(args.out, "tune-topk", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
