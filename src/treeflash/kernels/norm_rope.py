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
from triton.language.extra import libdevice  # noqa: E402


@triton.jit
def _rms_norm_row(x, W, offs, ok, D, eps):
    """weight * round(x / rms(x)) in float32 for one row x (masked lanes 0), the normalised row
    rounded to x's dtype before the weight (the torch order); the caller rounds the result."""
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / D + eps)
    n = (x32 * rstd).to(x.dtype).to(tl.float32)
    return tl.load(W + offs, mask=ok, other=0.0).to(tl.float32) * n


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
    tl.store(OUT + row * s_o + offs, _rms_norm_row(x, W, offs, ok, D, eps).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _round(v, DT: tl.constexpr):
    return v.to(DT).to(tl.float32)


@triton.jit
def _rope_kernel(X, COS, SIN, W, OUT, H, HALF, s_xt, s_xh, s_ct, s_ot, s_oh, eps,
                 INTERLEAVE: tl.constexpr, NORM: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # token row; one program rotates all its heads
    ds = tl.arange(0, BLOCK_HALF)[None, :]
    c = tl.load(COS + t * s_ct + ds, mask=ds < HALF, other=0.0).to(tl.float32)
    s = tl.load(SIN + t * s_ct + ds, mask=ds < HALF, other=0.0).to(tl.float32)
    _norm_rotate_heads(X, W, OUT, t, H, HALF, s_xt, s_xh, s_ot, s_oh, c, s, eps,
                       INTERLEAVE, NORM, BLOCK_H, BLOCK_HALF, OUT.dtype.element_ty)


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


# ---- the DFlash drafter's fused path (models/drafter.py, `DFlashDrafter.propose`) -------------
# Its q, k, v come out of one GEMM as column slices of one [T, (Hq + 2 Hkv) D] tensor; one launch
# normalises and rotates both the q and the k heads in place there, with cos/sin computed from
# the positions inside the kernel (no [T, D/2] tables: Rotary.cos_sin's six launches go), and
# one launch does SwiGLU's silu(gate) * up.


@triton.jit
def _rotate(x1, x2, c, s, DT: tl.constexpr):
    """The rotation of the pairs (x1, x2) by c / s (float32 holding DT values), each product
    rounded to DT as torch rounds (in 16-bit no product can meet an add unrounded: FMA
    contraction cannot change the bits; a float32 caller launches with enable_fp_fusion=False)."""
    return _round(x1 * c, DT) - _round(x2 * s, DT), _round(x2 * c, DT) + _round(x1 * s, DT)


@triton.jit
def _norm_rotate_heads(X, W, OUT, t, H, HALF, s_xt, s_xh, s_ot, s_oh, c, s, eps,
                       INTERLEAVE: tl.constexpr, NORM: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, DT: tl.constexpr):
    """One token row's H heads: an optional per-head RMSNorm (Qwen3's q_norm / k_norm, rounded as
    _rms_norm_kernel rounds), then the rotation by c / s [1, BLOCK_HALF] (already in the
    model dtype's values), each product rounded to DT as torch rounds; `_rope_kernel` (tables)
    and `_qk_norm_rope_kernel` (cos / sin from positions) share it."""
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
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + i1, mask=ds < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(W + i2, mask=ds < HALF, other=0.0).to(tl.float32)
        x1 = _round(w1 * _round(x1 * rstd, DT), DT)
        x2 = _round(w2 * _round(x2 * rstd, DT), DT)
    o1, o2 = _rotate(x1, x2, c, s, DT)
    dst = OUT + t * s_ot + hs * s_oh
    tl.store(dst + ds, o1.to(DT), mask=ok)
    tl.store(dst + HALF + ds, o2.to(DT), mask=ok)


@triton.jit
def _qk_norm_rope_kernel(Q, K, QO, KO, WQ, WK, POS, INV_FREQ, HQ, HK, HALF,
                         s_qt, s_qh, s_kt, s_kh, s_qot, s_qoh, s_kot, s_koh, s_pt, scale, eps_q, eps_k,
                         INTERLEAVE: tl.constexpr, NORM: tl.constexpr, HAS_SCALE: tl.constexpr,
                         BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # token row: all its q heads and all its k heads
    ds = tl.arange(0, BLOCK_HALF)[None, :]
    DT: tl.constexpr = QO.dtype.element_ty
    # Rotary.cos_sin: positions cast to float32 times inv_freq upcast to float32 (in a bf16
    # model the buffer is bf16; the product is not), cos / sin in float32, times the scale,
    # rounded to the model dtype
    p = tl.load(POS + t * s_pt).to(tl.float32)
    f = p * tl.load(INV_FREQ + ds, mask=ds < HALF, other=0.0).to(tl.float32)
    c = tl.cos(f)  # libdevice's __nv_cosf / __nv_sinf on NVIDIA: CUDA's cosf / sinf, as torch's
    s = tl.sin(f)
    if HAS_SCALE:
        c = c * scale
        s = s * scale
    c = _round(c, DT)
    s = _round(s, DT)
    _norm_rotate_heads(Q, WQ, QO, t, HQ, HALF, s_qt, s_qh, s_qot, s_qoh, c, s, eps_q,
                       INTERLEAVE, NORM, BLOCK_HQ, BLOCK_HALF, DT)
    _norm_rotate_heads(K, WK, KO, t, HK, HALF, s_kt, s_kh, s_kot, s_koh, c, s, eps_k,
                       INTERLEAVE, NORM, BLOCK_HK, BLOCK_HALF, DT)


def _heads_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., T, H, D] as a [N, H, D] view (no copy), last dim unit-stride."""
    if x.dim() < 2 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [..., H, D] with unit stride in D, got {tuple(x.shape)}, "
                         f"strides {tuple(x.stride())}")
    v = x.reshape(-1, x.shape[-2], x.shape[-1])
    if v.numel() and v.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
        raise ValueError(f"{name}'s leading dims must flatten without a copy")
    return v


def qk_norm_rope_triton(q, k, positions, inv_freq, q_weight, k_weight, eps_q, eps_k, interleave,
                        scale=1.0, out_q=None, out_k=None):
    """Triton twin of `kernels._qk_norm_rope_torch` (same contract, one launch)."""
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1] or q.dtype != k.dtype:
        raise ValueError(f"q {tuple(q.shape)} / {q.dtype} and k {tuple(k.shape)} / {k.dtype} must share "
                         "leading dims, head dim and dtype")
    if tuple(positions.shape) != tuple(q.shape[:-2]) or positions.is_floating_point():
        raise ValueError(f"positions {tuple(positions.shape)} must be integers covering q's "
                         f"leading dims {tuple(q.shape[:-2])}")
    dim = q.shape[-1]
    half = dim // 2
    if dim % 2 or inv_freq.shape != (half,) or inv_freq.stride(0) != 1:
        raise ValueError(f"head dim {dim} needs a contiguous inv_freq of {half}, got {tuple(inv_freq.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("norm weights: both or neither")
    if q_weight is not None and (q_weight.shape != (dim,) or k_weight.shape != (dim,)
                                 or q_weight.dtype != q.dtype or k_weight.dtype != q.dtype):
        raise ValueError(f"norm weights must be [{dim}] in {q.dtype}")
    out_q = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out_q is None else out_q
    out_k = torch.empty(k.shape, dtype=k.dtype, device=k.device) if out_k is None else out_k
    if out_q.shape != q.shape or out_k.shape != k.shape or out_q.dtype != q.dtype or out_k.dtype != k.dtype:
        raise ValueError("out_q / out_k must have q's / k's shape and dtype")
    q3, k3 = _heads_rows(q, "q"), _heads_rows(k, "k")
    qo3, ko3 = _heads_rows(out_q, "out_q"), _heads_rows(out_k, "out_k")
    pos = positions.reshape(-1)
    t = q3.shape[0]
    if t:
        norm = q_weight is not None
        hq, hk = q3.shape[1], k3.shape[1]
        _qk_norm_rope_kernel[(t,)](
            q3, k3, qo3, ko3, q_weight if norm else q3, k_weight if norm else k3, pos, inv_freq,
            hq, hk, half, q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
            qo3.stride(0), qo3.stride(1), ko3.stride(0), ko3.stride(1), pos.stride(0),
            float(scale), float(eps_q), float(eps_k),
            INTERLEAVE=bool(interleave), NORM=norm, HAS_SCALE=float(scale) != 1.0,
            BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
            enable_fp_fusion=False,  # as _rope_kernel: torch's roundings, no bf16 FMA
            enable_reflect_ftz=False,  # libdevice's cosf / sinf without flush-to-zero, as nvcc builds torch's
        )
    return out_q, out_k


@triton.jit
def _silu_mul_kernel(G, U, OUT, N, s_g, s_u, s_o, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    DT: tl.constexpr = OUT.dtype.element_ty
    g = tl.load(G + row * s_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * s_u + offs, mask=ok, other=0.0).to(tl.float32)
    # torch's silu: x / (1 + exp(-x)) in float32 with expf and an IEEE division, rounded to the
    # dtype; then the product of the rounded silu and up, rounded. tl.exp is ex2.approx and `/`
    # div.full on NVIDIA: libdevice's expf (the interpreter has no libdevice: numpy's exp there)
    # and div_rn keep torch's float32 values.
    if PRECISE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    a = _round(tl.math.div_rn(g, 1.0 + e), DT)
    tl.store(OUT + row * s_o + offs, (a * u).to(DT), mask=ok)


def silu_mul_triton(gate, up, out=None):
    """Triton twin of `kernels._silu_mul_torch` (same contract, one launch)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} / {gate.dtype} and up {tuple(up.shape)} / {up.dtype} differ")
    n = gate.shape[-1]
    g2, u2 = _rows(gate, "gate"), _rows(up, "up")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if out is None else out
    o2 = _rows(out, "out")
    if o2.data_ptr() != out.data_ptr() or out.shape != gate.shape or out.dtype != gate.dtype:
        raise ValueError("out must have gate's shape and dtype and rows that flatten without a copy")
    rows = g2.shape[0]
    if rows and n:
        block = min(triton.next_power_of_2(n), 2048)
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](
            g2, u2, o2, n, g2.stride(0), u2.stride(0), o2.stride(0), PRECISE=gate.is_cuda, BLOCK=block,
            num_warps=max(1, min(8, block // 256)), enable_fp_fusion=False, enable_reflect_ftz=False,
        )
    return out
