"""Decode-size dense projections: `kernels.skinny_linear` (K split across the SMs) against
F.linear (cuBLAS), at the shapes of MLA's projections, checked and timed on the GPU.

    python benchmarks/lab/bench_skinny.py --out benchmarks/results     (CUDA)

Shapes (N x K, bf16): Kimi K2 at TP8 (kv_a + q_a as one GEMM 2112 x 7168, q_b 1536 x 1536,
o_proj 7168 x 1024) and DeepSeek-V3 at TP1 (q_b 24576 x 1536, o_proj 7168 x 16384). Rows 1 / 4 /
16 / 32. Each timing is the median us a call of a CUDA graph that cycles over enough distinct
weights (>= 256 MB) that every call reads its weight from HBM, as a model step's layers do; the
floor is the weight's bytes at the measured copy bandwidth. Variants: the plan's default and
other programs-per-SM / BLOCK_K choices. Exits 1 if a result is off F.linear's by more than the
dtype allows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: benchutil, compile_v5

from benchutil import finish_checks, graph_us  # noqa: E402

from treeflash.kernels import skinny  # noqa: E402

SHAPES = {"kimi-tp8 a": (2112, 7168), "kimi-tp8 q_b": (1536, 1536), "kimi-tp8 o_proj": (7168, 1024),
          "dsv3-tp1 q_b": (24576, 1536), "dsv3-tp1 o_proj": (7168, 16384)}
VARIANTS = {"plan": {}, "pps1": {"programs_per_sm": 1}, "pps4": {"programs_per_sm": 4},
            "bk64": {"block_k": 64}, "bk256": {"block_k": 256}, "bk512": {"block_k": 512},
            "bk256pps4": {"block_k": 256, "programs_per_sm": 4}}


def _copy_bw(dev) -> float:
    a = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    us = graph_us(lambda: b.copy_(a), calls=10)
    return 2 * a.numel() / (us * 1e-6)


def _cycled(fn, ws):
    """fn(w) over the weights in turn, one a call (so a graph of len(ws) calls or more reads each
    from HBM: the set is larger than L2)."""
    state = [0]

    def call():
        fn(ws[state[0] % len(ws)])
        state[0] += 1
    return call


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--rows", default="1,4,16,32")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    bw = _copy_bw(dev)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; us a call, weights cycled from HBM")
    rows, fails = [], []
    dt = torch.bfloat16
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // nbytes))
        ws = [(torch.randn(n, k, device=dev, generator=g) / k ** 0.5).to(dt) for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, generator=g).to(dt)
            ref = F.linear(x.double(), ws[0].double())
            row = {"shape": name, "n": n, "k": k, "rows": m, "floor_us": nbytes / bw * 1e6,
                   "cublas_us": graph_us(_cycled(lambda w, x=x: F.linear(x, w), ws), calls=copies * 2)}
            err_cublas = ((F.linear(x, ws[0]).double() - ref).abs().max() / ref.abs().max()).item()
            line = f"{name:16s} rows {m:2d} | floor {row['floor_us']:6.2f} | cuBLAS {row['cublas_us']:6.2f}"
            for v, kw in VARIANTS.items():
                got = skinny.skinny_linear_triton(x, ws[0], **kw)
                err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
                tol = max(2 * err_cublas, 2 * torch.finfo(dt).eps)
                if err > tol:
                    fails.append(f"{name} rows {m} {v}: err {err:.2e} > {tol:.2e}")
                row[f"{v}_us"] = graph_us(_cycled(lambda w, x=x, kw=kw: skinny.skinny_linear_triton(x, w, **kw), ws),
                                          calls=copies * 2)
                row[f"{v}_err"] = err
                line += f" | {v} {row[f'{v}_us']:6.2f}"
            bn, split, chunk = skinny.plan(m, n, k, torch.cuda.get_device_properties(dev).multi_processor_count)
            row.update(block_n=bn, split=split, k_chunk=chunk, cublas_err=err_cublas)
            rows.append(row)
            print(line + f" | plan {bn} x {split} splits", flush=True)
    return finish_checks(args.out, "bench-skinny", rows, fails, argv, copy_bw=bw)


if __name__ == "__main__":
    sys.exit(main())
