"""MLA's work between the a-projection and q_b as one launch (`kernels.mla_latent_prep`).

Why: after kv_a_proj_with_mqa (and q_a_proj, one GEMM with it) a layer ran four small launches:
kv_a_layernorm over c_kv, the rotation of k_pe, the store of the row into its cache slot, and
q_a_layernorm. At decode each is ~1.3-2 us of a ~135 us layer (H100 profile, 2026-12-06) for a
few KB of data. One program a token row does all four: the row is read once, the normalised
c_kv and the rotated k_pe go straight into the cache, the normalised q_a into a new tensor.

The arithmetic is `_rms_norm_kernel`'s and `_rope_kernel`'s (the shared helpers), rounding where
the separate launches round (each result to the latents' dtype, then to the cache's on the store),
so the cache holds the separate path's bits. An fp8_e4m3 cache (uint8 rows, `kvcache.format`)
takes the normalised c_kv through `kv_ops._quantize_row` and the rotated k_pe as bf16: the bytes
`kv_write` stores for the separate path's row.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from treeflash.kernels.kv_ops import (  # noqa: E402
    _quantize_row,
    _slot_offset,
    _store_rope_bf16,
    _zero_padding,
    fp8_geometry,
)
from treeflash.kernels.norm_rope import _norm_rotate_heads, _rms_norm_row, _rotate  # noqa: E402
from treeflash.kvcache.format import is_fp8_rows  # noqa: E402


@triton.jit
def _mla_prep_kernel(LAT, KV, PT, START, WKV, COS, SIN, QA, WQ, QA_OUT,
                     N, R, HALF, Q, page_size, s_kp, s_ks, s_ptb, s_lb, s_ln, s_cb, s_cn,
                     s_qb, s_qn, s_ob, s_on, eps_kv, eps_q, ROPE_OFF, ROW_BYTES,
                     INTERLEAVE: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, BLOCK_Q: tl.constexpr, FP8: tl.constexpr = False,
                     GROUPS: tl.constexpr = 1):
    i = tl.program_id(0)  # node
    b = tl.program_id(1).to(tl.int64)
    lat = LAT + b * s_lb + i * s_ln
    dst = KV + _slot_offset(PT, b * s_ptb, tl.load(START + b) + i, page_size, s_kp, s_ks, True)
    dt = LAT.dtype.element_ty
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < R
    c_kv = _rms_norm_row(tl.load(lat + rs, mask=r_ok, other=0.0), WKV, rs, r_ok, R, eps_kv)
    ds = tl.arange(0, BLOCK_HALF)[None, :]
    c = tl.load(COS + b * s_cb + i * s_cn + ds, mask=ds < HALF, other=0.0).to(tl.float32)
    s = tl.load(SIN + b * s_cb + i * s_cn + ds, mask=ds < HALF, other=0.0).to(tl.float32)
    if FP8:  # the row kv_write stores: c_kv (in the latents' dtype) quantised, k_pe as bf16
        _quantize_row(c_kv.to(dt).to(tl.float32), dst, rs, r_ok, R, GROUPS, BLOCK_R)
        _store_rotated_fp8(lat + R, dst, c, s, HALF, ROPE_OFF, INTERLEAVE, BLOCK_HALF, dt)
        _zero_padding(dst, R, ROPE_OFF, ROPE_OFF + 4 * HALF, ROW_BYTES)
    else:
        tl.store(dst + rs, c_kv.to(dt), mask=r_ok)  # rounded to the latents' dtype, then the cache's
        _norm_rotate_heads(lat + R, WKV, dst + R, 0, 1, HALF, 0, 0, 0, 0, c, s, 0.0,
                           INTERLEAVE, False, 1, BLOCK_HALF, dt)
    if HAS_Q:
        qs = tl.arange(0, BLOCK_Q)
        q_ok = qs < Q
        qa = tl.load(QA + b * s_qb + i * s_qn + qs, mask=q_ok, other=0.0)
        out = QA_OUT + b * s_ob + i * s_on
        tl.store(out + qs, _rms_norm_row(qa, WQ, qs, q_ok, Q, eps_q).to(QA_OUT.dtype.element_ty), mask=q_ok)


@triton.jit
def _store_rotated_fp8(X, DST, c, s, HALF, ROPE_OFF, INTERLEAVE: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, DT: tl.constexpr):
    """k_pe at X rotated as `_norm_rotate_heads` rotates it (each product rounded to DT), stored
    as bf16 at byte ROPE_OFF of the fp8 row at DST."""
    ds = tl.arange(0, BLOCK_HALF)[None, :]
    ok = ds < HALF
    if INTERLEAVE:
        i1, i2 = 2 * ds, 2 * ds + 1
    else:
        i1, i2 = ds, HALF + ds
    x1 = tl.load(X + i1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(X + i2, mask=ok, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1, x2, c, s, DT)
    _store_rope_bf16(o1.to(DT).to(tl.float32), DST, ds, ok, ROPE_OFF)
    _store_rope_bf16(o2.to(DT).to(tl.float32), DST, HALF + ds, ok, ROPE_OFF)


def mla_latent_prep_triton(latents, kv_cache, page_table, start_lens, kv_weight, kv_eps, cos, sin,
                           interleave, qa=None, q_weight=None, q_eps=1e-6, qa_out=None):
    """Triton twin of `reference.mla_latent_prep` (same contract)."""
    b, n, d = latents.shape
    half = cos.shape[-1]
    r = d - 2 * half
    fp8 = is_fp8_rows(kv_cache)
    if fp8:  # fp8_e4m3 rows of c_kv (r values) | k_pe (kvcache.format)
        geo = fp8_geometry(kv_cache, d, r)
        fp8_args = dict(FP8=True, GROUPS=geo["GROUPS"])
        rope_off, row_bytes = geo["rope_off"], geo["row_bytes"]
    elif kv_cache.dim() != 3 or kv_cache.shape[2] != d or kv_cache.stride(2) != 1:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [pages, page_size, {d}] with unit last stride")
    else:
        fp8_args, rope_off, row_bytes = {}, 0, 0
    if latents.stride(2) != 1 or r <= 0 or kv_weight.shape != (r,):
        raise ValueError(f"latents {tuple(latents.shape)} (unit last stride) must be c_kv | k_pe with "
                         f"c_kv of kv_weight's {tuple(kv_weight.shape)} columns and k_pe of 2 x {half}")
    if tuple(cos.shape) != (b, n, half) or sin.shape != cos.shape or cos.stride(2) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"cos / sin {tuple(cos.shape)} / {tuple(sin.shape)} must be [{b}, {n}, {half}], same strides")
    if page_table.dtype != torch.int32 or page_table.shape[0] != b or page_table.stride(1) != 1:
        raise ValueError("page_table must be [B, max_pages] int32 with unit last stride")
    if start_lens.dtype != torch.int32 or tuple(start_lens.shape) != (b,) or not start_lens.is_contiguous():
        raise ValueError(f"start_lens must be [{b}] int32, contiguous")
    if kv_weight.dtype != latents.dtype:
        raise ValueError(f"kv_weight {kv_weight.dtype} must be the latents' dtype {latents.dtype}")
    has_q = qa is not None
    if has_q:
        nq = qa.shape[-1]
        if qa.shape[:2] != (b, n) or qa.stride(2) != 1 or q_weight is None or q_weight.shape != (nq,):
            raise ValueError(f"qa {tuple(qa.shape)} (unit last stride) needs rows of latents' and a q_weight of {nq}")
        if q_weight.dtype != qa.dtype:
            raise ValueError(f"q_weight {q_weight.dtype} must be qa's dtype {qa.dtype}")
        qa_out = torch.empty(b, n, nq, dtype=qa.dtype, device=qa.device) if qa_out is None else qa_out
        if qa_out.shape != (b, n, nq) or qa_out.stride(2) != 1:
            raise ValueError(f"qa_out {tuple(qa_out.shape)} must be [{b}, {n}, {nq}] with unit last stride")
    else:
        nq, qa, q_weight, qa_out = 1, latents, kv_weight, latents  # unread
    if n and b:
        _mla_prep_kernel[(n, b)](
            latents, kv_cache, page_table, start_lens, kv_weight, cos, sin, qa, q_weight, qa_out,
            n, r, half, nq, kv_cache.shape[1], kv_cache.stride(0), kv_cache.stride(1), page_table.stride(0),
            latents.stride(0), latents.stride(1), cos.stride(0), cos.stride(1),
            qa.stride(0), qa.stride(1), qa_out.stride(0), qa_out.stride(1), float(kv_eps), float(q_eps),
            rope_off, row_bytes,
            INTERLEAVE=bool(interleave), HAS_Q=has_q, BLOCK_R=triton.next_power_of_2(r),
            BLOCK_HALF=triton.next_power_of_2(half), BLOCK_Q=triton.next_power_of_2(nq),
            num_warps=4, enable_fp_fusion=False,  # the rotation's rounding, as `_rope_kernel`
            **fp8_args,
        )
    return qa_out if has_q else None
