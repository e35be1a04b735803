"""y = x W^T (+ b) for a few rows of x: split K across the SMs (`kernels.skinny_linear`).

Why it was written: at decode a layer's dense projections have 1-32 rows, so they are weight
reads, and the eager profile showed cuBLAS running Kimi K2 TP8's q_b_proj ([1536, 1536], 4.7 MB)
as 24 CTAs of 64 columns, 7.1 us on the H200 (0.66 TB/s, profile-preset-off-step.txt, session
23). Measured with the weights read from HBM (`benchmarks/lab/bench_skinny.py`, H100, session 23)
cuBLAS is faster at all three of that model's MLA shapes, so the model uses this kernel only
when asked (TREEFLASH_SKINNY_GEMM=1); it is faster at the larger DeepSeek-V3 TP1 o_proj
([7168, 16384]: 82 against 94 us at one row). Program
(n tile, k split) reads a BLOCK_N x k_chunk slab of W, as many programs as the SMs can keep busy;
with more than one split each writes an fp32 partial and the last of an n tile's splits to arrive
(an arrival counter) sums them in split order, adds the bias and stores the tile: one launch,
deterministic.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MAX_ROWS = 32  # beyond, cuBLAS' own tiles
PROGRAMS_PER_SM = 2


@triton.jit
def _skinny_kernel(X, W, BIAS, OUT, PART, CNT, M, N, K, k_chunk, s_xm, s_wn, s_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    k_lo = pid_s * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)
    ks = tl.arange(0, BLOCK_K)
    x_p = X + ms[:, None].to(tl.int64) * s_xm + ks[None, :]
    w_p = W + ns[:, None].to(tl.int64) * s_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]: along W's rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = k0 + ks < k_hi
        x = tl.load(x_p + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_p + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:  # the interpreter's half-precision dot is not faithful: the same sums in float32
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PREC)
    ok2 = m_ok[:, None] & n_ok[None, :]
    out = OUT + ms[:, None].to(tl.int64) * s_om + ns[None, :]
    if SPLIT > 1:
        part = PART + ms[:, None] * N + ns[None, :]  # PART [SPLIT, M, N] fp32
        tl.store(part + pid_s.to(tl.int64) * M * N, acc, mask=ok2)
        tl.debug_barrier()  # every thread's partial stored before the release below
        cnt = CNT + pid_n
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            acc = tl.load(part, mask=ok2, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                acc += tl.load(part + s * M * N, mask=ok2, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(BIAS + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out, acc.to(OUT.dtype.element_ty), mask=ok2)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=ok2)


def plan(m: int, n: int, k: int, num_sms: int, programs_per_sm: int = PROGRAMS_PER_SM,
         block_k: int = 128) -> tuple[int, int, int]:
    """(BLOCK_N, split, k_chunk) from host-known shapes (graph-capturable): 32-column tiles (64
    from 4096 columns), K split until the programs reach programs_per_sm x SMs, each split at
    least one BLOCK_K step, at most 16 splits; k_chunk a multiple of block_k, no empty split."""
    bn = 64 if n >= 4096 else 32
    tiles = triton.cdiv(n, bn)
    split = max(1, min(triton.cdiv(programs_per_sm * num_sms, tiles), k // block_k, 16))
    k_chunk = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return bn, triton.cdiv(k, k_chunk), k_chunk


def skinny_linear_triton(x, weight, bias=None, out=None, split=None, programs_per_sm=None, block_k=None):
    """Triton twin of `reference.skinny_linear` (same contract). split / programs_per_sm /
    block_k: override the plan (benchmarks, tests)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply as x W^T")
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {m}")
    if weight.dtype != x.dtype or (bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype)):
        raise ValueError(f"weight {weight.dtype} / bias must be x's dtype {x.dtype} (bias [{n}])")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need unit stride along K")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if out.shape != (m, n) or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be [{m}, {n}] with unit last stride")
    if m == 0 or n == 0:
        return out
    interp = not x.is_cuda
    bk = block_k or (32 if interp else 128)
    sms = 4 if interp else torch.cuda.get_device_properties(x.device).multi_processor_count
    bn, s, k_chunk = plan(m, n, k, sms, programs_per_sm or PROGRAMS_PER_SM, bk)
    if split is not None:
        k_chunk = triton.cdiv(triton.cdiv(k, max(1, split)), bk) * bk
        s = triton.cdiv(k, k_chunk) if k else 1
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    if s > 1:
        from treeflash.kernels.moe_gemm import _tile_counters

        part = torch.empty(s, m, n, dtype=torch.float32, device=x.device)
        cnt = _tile_counters(x.device, triton.cdiv(n, bn))
    else:
        part, cnt = out, out  # unused
    prec = "ieee" if interp or x.dtype == torch.float32 else "tf32"  # (tf32: unused by 16-bit dots)
    _skinny_kernel[(triton.cdiv(n, bn), s)](
        x, weight, weight if bias is None else bias, out, part, cnt, m, n, k, k_chunk,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk,
        SPLIT=s, DOT_PREC=prec, DOT_F32=interp, num_warps=4, num_stages=3,
    )
    return out
