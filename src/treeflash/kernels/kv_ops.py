"""KV write and KV commit as Triton kernels: moving latent rows into and within paged KV.

`kv_write` stores the new rows' latents at their positions before verify; `kv_commit`
moves the accepted nodes' rows down into sequential positions after verify (all layers in
one launch). Both are pure copies, so they run at memory speed; the point of doing them as
kernels is one launch per step with no host sync (CUDA-graph friendly).

An fp8_e4m3 cache (`kvcache.format`: uint8 rows) is written through the one quantiser here
(`_quantize_row`: per-128 amax scales, `_e4m3_code`, k_pe through `_bf16_code`), which
`mla_prep.py` shares; its spec is `kvcache.format.quantize_rows`. Both encoders are integer
arithmetic, not Triton's casts: the interpreter's fp32 -> float8e4nv cast misrounds where the
mantissa carries into the exponent (-7.98 -> -4) and its fp32 -> bf16 cast truncates, so the
casts would give the CPU and the GPU different bytes. The commit moves bytes, whatever the rows.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from treeflash.kvcache.format import GROUP, check_fp8_rows, fp8_rope_offset, is_fp8_rows  # noqa: E402


@triton.jit
def _slot_offset(PT, pt_row, pos, page_size, s_kp, s_ks, mask):
    page = tl.load(PT + pt_row + pos // page_size, mask=mask, other=0).to(tl.int64)
    return page * s_kp + (pos % page_size).to(tl.int64) * s_ks


@triton.jit
def _kv_write_kernel(KV, PT, START, LAT, N, D, page_size, s_kp, s_ks, s_ptb, s_lb, s_ln,
                     BLOCK_D: tl.constexpr):
    i = tl.program_id(0)  # node
    b = tl.program_id(1)
    pid_d = tl.program_id(2)
    offs = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs < D
    pos = tl.load(START + b) + i
    dst = _slot_offset(PT, b.to(tl.int64) * s_ptb, pos, page_size, s_kp, s_ks, True)
    row = tl.load(LAT + b.to(tl.int64) * s_lb + i * s_ln + offs, mask=d_ok)
    tl.store(KV + dst + offs, row.to(KV.dtype.element_ty), mask=d_ok)


@triton.jit
def _kv_commit_kernel(KV, PT, PL, ACC, NACC, M, D, page_size, s_kl, s_kp, s_ks, s_ptb, s_ab,
                      BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr):
    layer = tl.program_id(0)
    b = tl.program_id(1)
    pid_d = tl.program_id(2)
    offs = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs < D
    prefix = tl.load(PL + b)
    n_acc = tl.minimum(tl.load(NACC + b), M)
    base = KV + layer.to(tl.int64) * s_kl
    pt_row = b.to(tl.int64) * s_ptb
    # Move j <- accept_idx[j] in chunks of BLOCK_A, loading a chunk before storing it.
    # accept_idx is increasing with accept_idx[j] >= j, so a chunk never reads a row an
    # earlier chunk wrote, and a row it overwrites was read before the barrier.
    for j0 in range(0, n_acc, BLOCK_A):
        j = j0 + tl.arange(0, BLOCK_A)
        ok = j < n_acc
        src_node = tl.load(ACC + b.to(tl.int64) * s_ab + j, mask=ok, other=0)
        src = _slot_offset(PT, pt_row, prefix + src_node, page_size, s_kp, s_ks, ok)
        dst = _slot_offset(PT, pt_row, prefix + j, page_size, s_kp, s_ks, ok)
        mask = ok[:, None] & d_ok[None, :]
        rows = tl.load(base + src[:, None] + offs[None, :], mask=mask)
        tl.debug_barrier()
        tl.store(base + dst[:, None] + offs[None, :], rows, mask=mask & (src != dst)[:, None])
        tl.debug_barrier()


def kv_write_triton(kv_cache, page_table, start_lens, latents, v_dim=None):
    """Store latents [B, N, D] at positions start_lens[b] .. start_lens[b] + N - 1 (in place).

    kv_cache [num_pages, page_size, D] (last dim contiguous); position p of request b is
    kv_cache[page_table[b, p // page_size], p % page_size]; page_table [B, max_pages] int32;
    start_lens [B] int32. Latents are cast to the cache dtype. Grid (N, B, D / BLOCK_D).
    An fp8_e4m3 cache ([num_pages, page_size, row_bytes] uint8) takes the rows quantised
    (`_quantize_row`; v_dim = the quantised part, kv_lora_rank): grid (N, B).
    """
    b, n, d = latents.shape
    assert latents.stride(2) == 1
    assert page_table.dtype == torch.int32 and page_table.shape[0] == b and page_table.stride(1) == 1
    assert start_lens.dtype == torch.int32 and start_lens.shape == (b,) and start_lens.is_contiguous()
    if is_fp8_rows(kv_cache):
        return _kv_write_fp8(kv_cache, page_table, start_lens, latents, v_dim)
    assert kv_cache.dim() == 3 and kv_cache.shape[2] == d and kv_cache.stride(2) == 1
    if n == 0:
        return
    block_d = min(1024, triton.next_power_of_2(d))
    _kv_write_kernel[(n, b, triton.cdiv(d, block_d))](
        kv_cache, page_table, start_lens, latents, n, d, kv_cache.shape[1],
        kv_cache.stride(0), kv_cache.stride(1), page_table.stride(0),
        latents.stride(0), latents.stride(1), BLOCK_D=block_d,
    )


def kv_commit_triton(kv_cache, page_table, prefix_lens, accept_idx, num_accepted):
    """After verify, move row prefix + accept_idx[b, j] to prefix + j for j < num_accepted[b].

    kv_cache [..., num_pages, page_size, D], contiguous (leading dims = layers; all layers move
    in one launch, grid (layers, B, D / BLOCK_D)); page_table [B, max_pages] int32;
    prefix_lens [B] int32; accept_idx [B, M] int32/int64, increasing, accept_idx[b, 0] = 0;
    num_accepted [B] int32/int64. In place; rows past num_accepted are left as they are.
    """
    assert kv_cache.dim() >= 3
    # Each layer contiguous; the layers may be strided (the pool's coarse view, kvcache.coarse,
    # leaves out the pages past its last whole coarse page): the layer stride is passed as it is.
    kv_cache = kv_cache if kv_cache.dim() == 4 else kv_cache.reshape(-1, *kv_cache.shape[-3:])
    assert kv_cache[0].is_contiguous()
    layers, num_pages, page_size, d = kv_cache.shape
    b, m = accept_idx.shape
    assert page_table.dtype == torch.int32 and page_table.shape[0] == b and page_table.stride(1) == 1
    assert prefix_lens.dtype == torch.int32 and prefix_lens.shape == (b,) and prefix_lens.is_contiguous()
    assert num_accepted.shape == (b,)
    if m == 0 or layers == 0:
        return
    # Read in their own int dtype (the walk's are int64): a cast to int32 was two launches a step.
    acc, nacc = accept_idx.contiguous(), num_accepted.contiguous()
    block_d = min(256, triton.next_power_of_2(d))
    block_a = min(64, max(2, triton.next_power_of_2(m)))
    _kv_commit_kernel[(layers, b, triton.cdiv(d, block_d))](
        kv_cache, page_table, prefix_lens, acc, nacc, m, d, page_size,
        kv_cache.stride(0), page_size * d, d, page_table.stride(0), acc.stride(0),
        BLOCK_A=block_a, BLOCK_D=block_d,
    )


# ---- the fp8_e4m3 row format (kvcache/format.py) ------------------------------------------
# constexpr: a compiled kernel reads no plain Python global (the interpreter does, so CPU tests
# would not notice; tests/kernels/test_jit_globals.py checks every kernel module)
E4M3_MAX = tl.constexpr(448.0)
SMALLEST_NORMAL = tl.constexpr(0.015625)  # 2^-6: below it e4m3 codes are subnormal, steps of 2^-9


@triton.jit
def _e4m3_code(x):
    """float32 x (finite, |x| <= 448) -> its float8_e4m3fn byte as int32 0..255, rounded to
    nearest even (torch's cast): normal values keep 3 mantissa bits (a carry moves the exponent),
    subnormal ones are round(|x| x 2^9) x 2^-9."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    a = mag.to(tl.float32, bitcast=True)
    r = mag + 0x7FFFF + ((mag >> 20) & 1)  # round the 20 dropped mantissa bits to nearest even
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)  # exponent bias 127 -> 7
    t = a * 512.0
    f = tl.floor(t)
    k = f.to(tl.int32)
    d = t - f
    k = k + ((d > 0.5) | ((d == 0.5) & ((k & 1) == 1))).to(tl.int32)
    return tl.where(a < SMALLEST_NORMAL, k, normal) | sign


@triton.jit
def _bf16_code(x):
    """float32 x (finite) -> its bfloat16 bits as int32, rounded to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def _quantize_row(c, DST, cols, ok, V_DIM, GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    """c [BLOCK] float32 (0 where not ok): c_kv of one row -> e4m3 codes at DST + cols (uint8
    pointer: the row's first byte) and the scales (fp32) at DST + V_DIM + 4 g. A group is 128
    columns (BLOCK // GROUPS when BLOCK < 128: one group); scale = amax / 448, codes
    clamp(c / scale, +-448) (`kvcache.format.quantize_rows`)."""
    GS: tl.constexpr = BLOCK // GROUPS
    c2 = tl.reshape(c, (GROUPS, GS))
    amax = tl.max(tl.abs(c2), 1)
    scale = tl.div_rn(amax, E4M3_MAX)
    safe = tl.where(scale > 0, scale, 1.0)
    q = tl.div_rn(c2, safe[:, None])
    q = tl.where(scale[:, None] > 0, q, 0.0)
    q = tl.minimum(tl.maximum(q, -E4M3_MAX), E4M3_MAX)
    codes = tl.reshape(_e4m3_code(q), (BLOCK,))
    tl.store(DST + cols, codes.to(tl.uint8), mask=ok)
    g = tl.arange(0, GROUPS)
    tl.store((DST + V_DIM + 4 * g).to(tl.pointer_type(tl.float32)), scale, mask=g * GS < V_DIM)


@triton.jit
def _store_rope_bf16(x, DST, offs, ok, ROPE_OFF):
    """k_pe values x (float32) as bf16 at byte ROPE_OFF of the row at DST (uint8 pointer)."""
    tl.store((DST + ROPE_OFF).to(tl.pointer_type(tl.int16)) + offs, _bf16_code(x).to(tl.int16), mask=ok)


@triton.jit
def _zero_padding(DST, V_DIM, ROPE_OFF, ROPE_END, ROW_BYTES):
    """Zeros in the fp8 row's two gaps (< 16 bytes each): after the scales, after k_pe."""
    pad = tl.arange(0, 16)
    scales_end = V_DIM + 4 * tl.cdiv(V_DIM, 128)
    tl.store(DST + scales_end + pad, tl.zeros([16], tl.uint8), mask=scales_end + pad < ROPE_OFF)
    tl.store(DST + ROPE_END + pad, tl.zeros([16], tl.uint8), mask=ROPE_END + pad < ROW_BYTES)


@triton.jit
def _kv_write_fp8_kernel(KV, PT, START, LAT, D, V_DIM, ROPE_OFF, ROW_BYTES, page_size, s_kp, s_ks,
                         s_ptb, s_lb, s_ln, GROUPS: tl.constexpr, BLOCK_V: tl.constexpr,
                         BLOCK_R: tl.constexpr):
    i = tl.program_id(0)  # node
    b = tl.program_id(1)
    pos = tl.load(START + b) + i
    dst = KV + _slot_offset(PT, b.to(tl.int64) * s_ptb, pos, page_size, s_kp, s_ks, True)
    lat = LAT + b.to(tl.int64) * s_lb + i * s_ln
    cols = tl.arange(0, BLOCK_V)
    ok = cols < V_DIM
    c = tl.load(lat + cols, mask=ok, other=0.0).to(tl.float32)
    _quantize_row(c, dst, cols, ok, V_DIM, GROUPS, BLOCK_V)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < D - V_DIM
    _store_rope_bf16(tl.load(lat + V_DIM + rs, mask=r_ok, other=0.0).to(tl.float32), dst, rs, r_ok,
                     ROPE_OFF)
    _zero_padding(dst, V_DIM, ROPE_OFF, ROPE_OFF + 2 * (D - V_DIM), ROW_BYTES)


def fp8_geometry(kv_cache: torch.Tensor, d: int, v_dim: int | None) -> dict:
    """The constexprs / offsets of an fp8_e4m3 row write (`kvcache.format`): checks the cache."""
    if v_dim is None:
        raise ValueError("an fp8_e4m3 cache needs v_dim (the quantised part of a row, kv_lora_rank)")
    if kv_cache.dim() != 3 or kv_cache.stride(2) != 1:
        raise ValueError(f"an fp8 cache must be [pages, page_size, row_bytes] with unit last stride, "
                         f"got {tuple(kv_cache.shape)}")
    check_fp8_rows(kv_cache, d, v_dim)
    block_v = triton.next_power_of_2(v_dim)
    return dict(GROUPS=max(1, block_v // GROUP), BLOCK_V=block_v,
                rope_off=fp8_rope_offset(v_dim), row_bytes=kv_cache.shape[2])


def _kv_write_fp8(kv_cache, page_table, start_lens, latents, v_dim):
    b, n, d = latents.shape
    geo = fp8_geometry(kv_cache, d, v_dim)
    if n == 0 or b == 0:
        return
    _kv_write_fp8_kernel[(n, b)](
        kv_cache, page_table, start_lens, latents, d, v_dim, geo["rope_off"], geo["row_bytes"],
        kv_cache.shape[1], kv_cache.stride(0), kv_cache.stride(1), page_table.stride(0),
        latents.stride(0), latents.stride(1), GROUPS=geo["GROUPS"], BLOCK_V=geo["BLOCK_V"],
        BLOCK_R=triton.next_power_of_2(max(d - v_dim, 1)),
    )
