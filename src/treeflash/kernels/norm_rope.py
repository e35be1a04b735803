"""RMSNorm (optionally after a residual add) and rotary embedding, one launch each.

Why: a decoder layer's norms and rotations are ~45 tiny torch kernels (a norm is cast, pow,
mean, add, rsqrt, mul, cast, mul; a rotation is four muls, a sub, an add and a cat). Under
CUDA graphs each still costs ~2-3 us of GPU time, about 0.1 ms a layer, more than the
weights a batch-1 layer reads. These kernels do the same arithmetic in one pass, rounding
where the torch code rounds (the normalised row to the input dtype before the weight; each
product of the rotation to the output dtype), so on half types they give the torch path's
bits up to the order of the variance sum.

Both compile without FP contraction (`enable_fp_fusion=False`): with it, LLVM narrows the
rotation to bf16 arithmetic and fuses x1*c - round(x2*s) into one bf16 FMA, which is not
torch's rounding (sm_90 PTX, Triton 3.9: `fma.rn.bf16`; on the H200 only ~75% of the rotary's
bf16 outputs matched torch's bits, 2026-12-02).

Both write into `out`, which may alias the input (each program loads its whole row before
storing it): MLA normalises c_kv and rotates k_pe in place inside the latent row.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _rms_norm_kernel(X, RES, RES_OUT, W, OUT, D, s_x, s_r, s_ro, s_o, eps,
                     HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(X + row * s_x + offs, mask=ok, other=0.0)
    if HAS_RES:  # x + residual, rounded to the input dtype (the torch add), kept as the new residual
        r = tl.load(RES + row * s_r + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(RES_OUT + row * s_ro + offs, x, mask=ok)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / D + eps)
    n = (x32 * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * s_o + offs, (w * n).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _round(v, DT: tl.constexpr):
    return v.to(DT).to(tl.float32)


@triton.jit
def _rope_kernel(X, COS, SIN, W, OUT, H, HALF, s_xt, s_xh, s_ct, s_ot, s_oh, eps,
                 INTERLEAVE: tl.constexpr, NORM: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # token row; one program rotates all its heads
    hs = tl.arange(0, BLOCK_H)[:, None]
    ds = tl.arange(0, BLOCK_HALF)[None, :]
    ok = (hs < H) & (ds < HALF)
    if INTERLEAVE:  # pairs (x0, x1), (x2, x3)...: evens and odds
        i1, i2 = 2 * ds, 2 * ds + 1
    else:
        i1, i2 = ds, HALF + ds
    row = X + t * s_xt + hs * s_xh
    x1 = tl.load(row + i1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(row + i2, mask=ok, other=0.0).to(tl.float32)
    DT: tl.constexpr = OUT.dtype.element_ty
    if NORM:  # per-head RMSNorm first (Qwen3's q_norm / k_norm), as _rms_norm_kernel rounds
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + i1, mask=ds < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(W + i2, mask=ds < HALF, other=0.0).to(tl.float32)
        x1 = _round(w1 * _round(x1 * rstd, DT), DT)
        x2 = _round(w2 * _round(x2 * rstd, DT), DT)
    c = tl.load(COS + t * s_ct + ds, mask=ds < HALF, other=0.0).to(tl.float32)
    s = tl.load(SIN + t * s_ct + ds, mask=ds < HALF, other=0.0).to(tl.float32)
    o1 = _round(x1 * c, DT) - _round(x2 * s, DT)
    o2 = _round(x2 * c, DT) + _round(x1 * s, DT)
    dst = OUT + t * s_ot + hs * s_oh
    tl.store(dst + ds, o1.to(DT), mask=ok)
    tl.store(dst + HALF + ds, o2.to(DT), mask=ok)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {tuple(x.stride())}")
    return x.reshape(-1, x.shape[-1])


def rms_norm_triton(x, weight, eps, residual=None, out=None, residual_out=None):
    """Triton twin of `reference.rms_norm` (same contract)."""
    d = x.shape[-1]
    x2 = _rows(x, "x")
    dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device) if out is None else out
    o2 = _rows(out, "out")
    if o2.data_ptr() != out.data_ptr() or out.shape != x.shape:
        raise ValueError("out must have x's shape and rows that flatten without a copy")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        residual_out = torch.empty_like(x) if residual_out is None else residual_out
        r2, ro2 = _rows(residual, "residual"), _rows(residual_out, "residual_out")
    else:
        r2 = ro2 = x2
    if x2.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, ro2, weight, o2, d, x2.stride(0), r2.stride(0), ro2.stride(0), o2.stride(0),
            float(eps), HAS_RES=residual is not None, BLOCK_D=block,
            num_warps=max(1, min(8, block // 256)), enable_fp_fusion=False,
        )
    return out if residual is None else (out, residual_out)


def rope_triton(x, cos, sin, interleave, out=None, norm_weight=None, eps=1e-6):
    """Triton twin of `reference.rope` (same contract)."""
    heads = x.dim() == cos.dim() + 1
    lead = x.shape[:-2] if heads else x.shape[:-1]
    if tuple(cos.shape[:-1]) != tuple(lead) or cos.shape != sin.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} must cover x {tuple(x.shape)}'s leading dims")
    dim = x.shape[-1]
    half = dim // 2
    if cos.shape[-1] != half or dim % 2:
        raise ValueError(f"rotary dim {dim} needs cos/sin of {dim // 2} columns, got {cos.shape[-1]}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    x3 = x if heads else x.unsqueeze(-2)
    o3 = out if heads else out.unsqueeze(-2)
    if x3.stride(-1) != 1 or o3.stride(-1) != 1:
        raise ValueError("x and out must have unit stride in their last dim")
    x3 = x3.reshape(-1, x3.shape[-2], dim)
    o3v = o3.reshape(-1, o3.shape[-2], dim)
    c2, s2 = cos.reshape(-1, half), sin.reshape(-1, half)
    if c2.stride(-1) != 1 or s2.stride() != c2.stride():
        c2, s2 = c2.contiguous(), s2.contiguous()
    if o3v.data_ptr() != o3.data_ptr():
        raise ValueError("out's leading dims must flatten without a copy")
    t, h = x3.shape[0], x3.shape[1]
    if t:
        _rope_kernel[(t,)](
            x3, c2, s2, x3 if norm_weight is None else norm_weight, o3v, h, half,
            x3.stride(0), x3.stride(1), c2.stride(0), o3v.stride(0), o3v.stride(1), float(eps),
            INTERLEAVE=bool(interleave), NORM=norm_weight is not None,
            BLOCK_H=triton.next_power_of_2(h), BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
            enable_fp_fusion=False,  # else x1*c - r(x2*s) becomes one bf16 FMA: not torch's rounding
        )
    return out
