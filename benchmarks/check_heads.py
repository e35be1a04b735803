"""GPU check and cost of MLA's per-head absorb / expand kernel (`kernels.head_matmul`,
`kernels/mla_heads.py`) against the einsums it replaces, at Kimi K2 TP8 (8 heads) and
DeepSeek-V3 TP1 (128 heads) shapes, through MLA's own views (q_nope a slice of q, the absorb's
output a slice of q_abs, W_UV transposed).

    python benchmarks/check_heads.py --out benchmarks/results     (CUDA)

Each row: rows M (1 = decode, 16-64 = verify, 1024 = a prefill chunk), the error against a
float64 einsum relative to max |ref| (the einsum's own error beside it: both must be within
2 ulps of the dtype at that scale), and us a call in a CUDA graph (kernel; einsum + its copy).
Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from benchutil import finish_checks, graph_us  # noqa: E402

from treeflash import kernels  # noqa: E402


def _rel(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    nope, rope, r, v = 128, 64, 512, 128
    rows, fails = [], []
    for heads in (8, 128):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            w = (torch.randn(heads, nope + v, r, device=dev, generator=g) / r ** 0.5).to(dt)  # kv_b [H, nope + v, r]
            w_uk, w_uv = w[:, :nope], w[:, nope:]
            for m in (1, 16, 64, 1024):
                q = torch.randn(m, heads, nope + rope, device=dev, generator=g).to(dt)
                q_abs = torch.empty(m, heads, r + rope, device=dev, dtype=dt)
                out_lat = torch.randn(m, heads, r, device=dev, generator=g).to(dt)
                cases = {
                    "absorb": (q[..., :nope], w_uk, q_abs[..., :r]),
                    "expand": (out_lat, w_uv.transpose(1, 2), None),
                }
                for name, (a, b, out) in cases.items():
                    ref = torch.einsum("mhk,hkn->mhn", a.double(), b.double())
                    got = kernels.head_matmul(a, b, out=out, impl="triton")
                    base = kernels.head_matmul(a, b, out=out, impl="torch")
                    err, err_torch = _rel(got, ref), _rel(base, ref)
                    tol = max(2 * torch.finfo(dt).eps, 2 * err_torch) if dt != torch.float32 else 1e-5
                    row = {"heads": heads, "dtype": str(dt).split(".")[-1], "rows": m, "product": name,
                           "rel_err": err, "einsum_rel_err": err_torch, "tol": tol, "ok": err <= tol,
                           "kernel_us": graph_us(lambda a=a, b=b, out=out: kernels.head_matmul(a, b, out=out,
                                                                                             impl="triton")),
                           "einsum_us": graph_us(lambda a=a, b=b, out=out: kernels.head_matmul(a, b, out=out,
                                                                                             impl="torch"))}
                    if not row["ok"]:
                        fails.append(f"{name} H{heads} {row['dtype']} M{m}: {err:.2e} > {tol:.2e}")
                    rows.append(row)
                    print(f"{name:6s} H {heads:3d} {row['dtype']:8s} M {m:4d} | err {err:.2e} (einsum {err_torch:.2e}) "
                          f"| kernel {row['kernel_us']:7.2f} us | einsum {row['einsum_us']:7.2f} us", flush=True)
    return finish_checks(args.out, "check-heads", rows, fails, argv)


if __name__ == "__main__":
    sys.exit(main())
