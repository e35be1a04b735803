"""Per-head matrix products of MLA's absorbed path, written where they are consumed.

    out[m, h, n] = sum_k a[m, h, k] * b[h, k, n]        (float32 sums, out in its own dtype)

MLA absorbs each head's W_UK into its query before attention (q_nope [M, H, nope] x
W_UK [H, nope, kv_lora] -> the first kv_lora columns of q_abs [M, H, kv_lora + rope]) and
expands the attention output after it (out_lat [M, H, kv_lora] x W_UV^T -> [M, H, v], o_proj's
input). With torch these are an einsum each: a bmm over a permuted view, then a copy of its
[H, M, N] result into q_abs' strided slice or into o_proj's [M, H * v] layout: two launches
apiece at decode, ~5 us a layer on an H100 (2026-12-06 profile: bmm 3.1 us, copy 2.3). Here
each is one launch that reads a and b through their strides (a permuted or sliced view costs
nothing) and stores straight into `out`'s strides, q_abs' slice included. The absorb launch can
also rotate q_pe into q_abs' last columns (`rope`: one more column of programs, each rotating
one head of an m tile), which took a launch of its own (~1.1 us a layer on an H100, 2026-12-06).
Bit for bit the rope launch (interpreter; H100 in bf16 since 2026-12-06, when this launch, as the
rope launch, turned FP contraction off: with it LLVM fused a product and the difference into one
FMA). MLA uses it in 16-bit at decode and verify sizes (`models.mla.ROPE_IN_ABSORB_ROWS`).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from treeflash.kernels.norm_rope import _rotate  # noqa: E402


@triton.jit
def _head_matmul_kernel(A, B, OUT, M, K, N, s_am, s_ah, s_ak, s_bh, s_bk, s_bn, s_om, s_oh, s_on,
                        X, COS, SIN, XO, HALF, s_xm, s_xh, s_cm, s_sm, s_xom, s_xoh,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
                        ROPE: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Program (n tile, m tile, head): out[m tile, h, n tile] over the whole K. With ROPE, the
    programs of n tile cdiv(N, BLOCK_N) rotate x [m tile, h, 2 HALF] by cos / sin [m, HALF] into
    xo instead (`_rope_kernel`'s arithmetic: interleaved pairs come out de-interleaved)."""
    h = tl.program_id(2).to(tl.int64)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < M
    if ROPE:
        if tl.program_id(0) == tl.cdiv(N, BLOCK_N):
            ds = tl.arange(0, BLOCK_HALF)[None, :]
            ok = m_ok[:, None] & (ds < HALF)
            if INTERLEAVE:  # pairs (x0, x1), (x2, x3)...: evens and odds
                i1, i2 = 2 * ds, 2 * ds + 1
            else:
                i1, i2 = ds, HALF + ds
            rows = ms[:, None].to(tl.int64)
            x = X + h * s_xh + rows * s_xm
            x1 = tl.load(x + i1, mask=ok, other=0.0).to(tl.float32)
            x2 = tl.load(x + i2, mask=ok, other=0.0).to(tl.float32)
            c = tl.load(COS + rows * s_cm + ds, mask=ok, other=0.0).to(tl.float32)
            s = tl.load(SIN + rows * s_sm + ds, mask=ok, other=0.0).to(tl.float32)
            o1, o2 = _rotate(x1, x2, c, s, XO.dtype.element_ty)
            dst = XO + h * s_xoh + rows * s_xom
            tl.store(dst + ds, o1.to(XO.dtype.element_ty), mask=ok)
            tl.store(dst + HALF + ds, o2.to(XO.dtype.element_ty), mask=ok)
            return
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
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


def _rope_args(rope, m: int, h: int) -> tuple[tuple, dict]:
    """The kernel's rotation arguments for `rope` = (x [M, H, R], cos [M, R/2], sin, interleave,
    xo [M, H, R]), checked; placeholders without it."""
    if rope is None:
        return (None,) * 4 + (0,) * 7, dict(ROPE=False, INTERLEAVE=False, BLOCK_HALF=1)
    x, cos, sin, interleave, xo = rope
    r = x.shape[-1]
    if x.dim() != 3 or tuple(x.shape[:2]) != (m, h) or r % 2 or xo.shape != x.shape:
        raise ValueError(f"rope's x {tuple(x.shape)} and out {tuple(xo.shape)} must be [{m}, {h}, even]")
    if cos.shape != (m, r // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope's cos / sin {tuple(cos.shape)} / {tuple(sin.shape)} must be {(m, r // 2)}")
    if x.dtype not in (torch.bfloat16, torch.float16) or len({x.dtype, cos.dtype, sin.dtype, xo.dtype}) != 1:
        # (float32 would need the launch compiled without FP contraction, which the dot must keep)
        got = f"{x.dtype} {cos.dtype} {sin.dtype} {xo.dtype}"
        raise ValueError(f"rope's tensors must share one 16-bit dtype, got {got}")
    if x.stride(-1) != 1 or xo.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope's tensors must have unit stride in their last dim")
    args = (x, cos, sin, xo, r // 2, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), xo.stride(0), xo.stride(1))
    return args, dict(ROPE=True, INTERLEAVE=bool(interleave), BLOCK_HALF=triton.next_power_of_2(r // 2))


def head_matmul_triton(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, rope=None) -> torch.Tensor:
    """Triton twin of `kernels.head_matmul` (same contract, one launch)."""
    m, h, k = a.shape
    if b.dim() != 3 or b.shape[0] != h or b.shape[1] != k or a.dtype != b.dtype:
        raise ValueError(f"a {tuple(a.shape)} / {a.dtype} and b {tuple(b.shape)} / {b.dtype} do not multiply by head")
    r_args, r_meta = _rope_args(rope, m, h)
    n = b.shape[2]
    if out is None:
        out = torch.empty(m, h, n, dtype=a.dtype, device=a.device)
    elif out.shape != (m, h, n):
        raise ValueError(f"out {tuple(out.shape)} must be {(m, h, n)}")
    if m == 0:
        return out
    if n == 0 or k == 0:  # (rare shapes: the rotation by itself)
        out.zero_()
        if rope is not None:
            from treeflash.kernels.norm_rope import rope_triton

            rope_triton(rope[0], rope[1], rope[2], rope[3], out=rope[4])
        return out
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 64 if n >= 256 else 32
    interp = not a.is_cuda
    prec = "ieee" if (interp or a.dtype == torch.float32) else "tf32"  # (tf32: unused by 16-bit dots)
    grid = (triton.cdiv(n, block_n) + (rope is not None), triton.cdiv(m, block_m), h)
    _head_matmul_kernel[grid](
        a, b, out, m, k, n, *a.stride(), *b.stride(), *out.stride(), *r_args,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, DOT_PREC=prec, DOT_F32=interp, num_warps=4, **r_meta,
        # the rotation as `_rope_kernel` rounds it: with contraction LLVM fuses x1*c - round(x2*s)
        # into one bf16 FMA (an H100 mismatch, 2026-12-06); the dots are MMAs either way
        enable_fp_fusion=rope is None,
    )
    return out
