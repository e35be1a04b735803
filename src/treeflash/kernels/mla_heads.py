"""Per-head matrix products of MLA's absorbed path, written where they are consumed.

    out[m, h, n] = sum_k a[m, h, k] * b[h, k, n]        (float32 sums, out in its own dtype)

MLA absorbs each head's W_UK into its query before attention (q_nope [M, H, nope] x
W_UK [H, nope, kv_lora] -> the first kv_lora columns of q_abs [M, H, kv_lora + rope]) and
expands the attention output after it (out_lat [M, H, kv_lora] x W_UV^T -> [M, H, v], o_proj's
input). With torch these are an einsum each: a bmm over a permuted view, then a copy of its
[H, M, N] result into q_abs' strided slice or into o_proj's [M, H * v] layout: two launches
apiece at decode, ~5 us a layer on an H100 (session 22's profile: bmm 3.1 us, copy 2.3). Here
each is one launch that reads a and b through their strides (a permuted or sliced view costs
nothing) and stores straight into `out`'s strides, q_abs' slice included.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _head_matmul_kernel(A, B, OUT, M, K, N, s_am, s_ah, s_ak, s_bh, s_bk, s_bn, s_om, s_oh, s_on,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (n tile, m tile, head): out[m tile, h, n tile] over the whole K."""
    h = tl.program_id(2).to(tl.int64)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = ms < M
    n_ok = ns < N
    ks = tl.arange(0, BLOCK_K)
    a_ptr = A + h * s_ah + ms[:, None].to(tl.int64) * s_am + ks[None, :] * s_ak  # [BLOCK_M, BLOCK_K]
    b_ptr = B + h * s_bh + ks[:, None] * s_bk + ns[None, :].to(tl.int64) * s_bn  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        a = tl.load(a_ptr + k0 * s_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + k0 * s_bk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_F32:  # the interpreter's half-precision dot is not faithful: the same sums in float32
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
    out = OUT + h * s_oh + ms[:, None].to(tl.int64) * s_om + ns[None, :].to(tl.int64) * s_on
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def head_matmul_triton(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of `kernels.head_matmul` (same contract, one launch)."""
    m, h, k = a.shape
    if b.dim() != 3 or b.shape[0] != h or b.shape[1] != k or a.dtype != b.dtype:
        raise ValueError(f"a {tuple(a.shape)} / {a.dtype} and b {tuple(b.shape)} / {b.dtype} do not multiply by head")
    n = b.shape[2]
    if out is None:
        out = torch.empty(m, h, n, dtype=a.dtype, device=a.device)
    elif out.shape != (m, h, n):
        raise ValueError(f"out {tuple(out.shape)} must be {(m, h, n)}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 64 if n >= 256 else 32
    interp = not a.is_cuda
    prec = "ieee" if (interp or a.dtype == torch.float32) else "tf32"  # (tf32: unused by 16-bit dots)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), h)
    _head_matmul_kernel[grid](
        a, b, out, m, k, n, *a.stride(), *b.stride(), *out.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, DOT_PREC=prec, DOT_F32=interp, num_warps=4,
    )
    return out
