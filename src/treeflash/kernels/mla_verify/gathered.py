"""The gathered MLA verify kernel: the fp32 path and the fallback for pages that hold no tile.

Every key tile is gathered row by row through the page table (one page-table entry a row,
masked at the chunk's end), so it runs at any page size; it is the implementation for fp32
caches (the correctness path) and for more than 16 rows a call over pages that do not hold the
portable kernel's tile (page 1, the incident's layout: H200, 2026-12-02, scattered page 1 at
64k, 64 x 16 0.31 of the floor against the portable kernel's gathered tiles' 0.25,
`h200-20261202-kernel-v3`). Its building blocks (the row gather, the online-softmax step, the
tree part, the row store) serve the portable kernel too (`portable.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.kernels.mla_verify.plan import Call, KernelConfig, fit_chunk, interpreting, split_grid
from treeflash.kvcache.format import is_fp8_rows


@triton.jit
def _row_offsets(PT, pt_row, pos, valid, page_size, s_kp, s_ks):
    """Element offsets [BLOCK_N] of positions `pos` of one request (page-table lookup)."""
    page = tl.load(PT + pt_row + pos // page_size, mask=valid, other=0).to(tl.int64)
    return page * s_kp + (pos % page_size).to(tl.int64) * s_ks


@triton.jit
def _load_rows(KV, row, valid, offs_v, offs_r, v_dim, D, HAS_ROPE: tl.constexpr,
               KV_FP8: tl.constexpr = False, KT: tl.constexpr = None):
    """K/V main part [BLOCK_N, BLOCK_V] and rope part [BLOCK_N, BLOCK_R] of rows at `row`.
    KV_FP8: `row` are byte offsets of fp8_e4m3 rows (`kvcache.format`), decoded to KT here."""
    if KV_FP8:
        k_main, k_rope = _load_fp8_rows(KV, row, valid, offs_v, offs_r, 0, v_dim, D, HAS_ROPE, True, KT)
    else:
        k_main = tl.load(KV + row[:, None] + offs_v[None, :],
                         mask=valid[:, None] & (offs_v[None, :] < v_dim), other=0.0,
                         eviction_policy="evict_first")
        if HAS_ROPE:
            k_rope = tl.load(KV + row[:, None] + v_dim + offs_r[None, :],
                             mask=valid[:, None] & (offs_r[None, :] < D - v_dim), other=0.0,
                             eviction_policy="evict_first")
        else:
            k_rope = k_main
    return k_main, k_rope


@triton.jit
def _fp8_scales(KV, row, valid, c0, v_dim, G: tl.constexpr, MASK_ROWS: tl.constexpr):
    """[BLOCK_N, G] fp32 scales of the groups c0 // 128 .. of the fp8 rows at byte offsets `row`
    (groups past v_dim: 0)."""
    gi = c0 // 128 + tl.arange(0, G)
    ok = gi[None, :] * 128 < v_dim
    if MASK_ROWS:
        ok = ok & valid[:, None]
    ptr = (KV + row[:, None] + v_dim + 4 * gi[None, :]).to(tl.pointer_type(tl.float32))
    return tl.load(ptr, mask=ok, other=0.0, eviction_policy="evict_first")


@triton.jit
def _fp8_decode(codes, scales, KT: tl.constexpr):
    """codes [BLOCK_N, W] uint8 (e4m3), scales [BLOCK_N, G] (one per 128 columns, or one for
    all W < 128) -> [BLOCK_N, W] values code x scale in KT (float32 products, then rounded)."""
    BN: tl.constexpr = codes.shape[0]
    W: tl.constexpr = codes.shape[1]
    G: tl.constexpr = scales.shape[1]
    x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    x = tl.reshape(x, (BN, G, W // G)) * scales[:, :, None]
    return tl.reshape(x, (BN, W)).to(KT)


@triton.jit
def _fp8_rope(KV, row, valid, offs_r, v_dim, D, MASK_ROWS: tl.constexpr, KT: tl.constexpr):
    """The bf16 k_pe [BLOCK_N, BLOCK_R] of the fp8 rows at byte offsets `row`, in KT."""
    rope_off = v_dim + 16 * tl.cdiv(tl.cdiv(v_dim, 128), 4)  # kvcache.format.fp8_rope_offset
    rope = (KV + row[:, None] + rope_off).to(tl.pointer_type(tl.bfloat16))
    ok = offs_r[None, :] < D - v_dim
    if MASK_ROWS:
        ok = ok & valid[:, None]
    return tl.load(rope + offs_r[None, :], mask=ok, other=0.0, eviction_policy="evict_first").to(KT)


@triton.jit
def _load_fp8_rows(KV, row, valid, offs_c, offs_r, c0, v_dim, D, HAS_ROPE: tl.constexpr,
                   MASK_ROWS: tl.constexpr, KT: tl.constexpr):
    """Value columns c0 + offs_c [BLOCK_N, W] and the rope part of fp8 rows at byte offsets
    `row`, decoded to KT. MASK_ROWS=False: every row valid (`valid` unused)."""
    W: tl.constexpr = offs_c.shape[0]
    G: tl.constexpr = W // 128 if W >= 128 else 1
    ok = offs_c[None, :] + c0 < v_dim
    if MASK_ROWS:
        ok = ok & valid[:, None]
    codes = tl.load(KV + row[:, None] + c0 + offs_c[None, :], mask=ok, other=0,
                    eviction_policy="evict_first")
    k_main = _fp8_decode(codes, _fp8_scales(KV, row, valid, c0, v_dim, G, MASK_ROWS), KT)
    if HAS_ROPE:
        k_rope = _fp8_rope(KV, row, valid, offs_r, v_dim, D, MASK_ROWS, KT)
    else:
        k_rope = k_main
    return k_main, k_rope


@triton.jit
def _load_latent_block(KV, PT, pt_row, pos, valid, page_size, s_kp, s_ks, offs_v, offs_r,
                       v_dim, D, HAS_ROPE: tl.constexpr, KV_FP8: tl.constexpr = False,
                       KT: tl.constexpr = None):
    """Rows `pos` of one request: K/V main part [BLOCK_N, BLOCK_V] and rope part [BLOCK_N, BLOCK_R]."""
    row = _row_offsets(PT, pt_row, pos, valid, page_size, s_kp, s_ks)
    return _load_rows(KV, row, valid, offs_v, offs_r, v_dim, D, HAS_ROPE, KV_FP8, KT)


@triton.jit
def _attend(acc, m_i, l_i, q_main, q_rope, k_main, k_rope, allowed, qk_scale,
            HAS_ROPE: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
            MASKED: tl.constexpr = True):
    """One online-softmax step (log2 domain) of the rows against one latent block.
    MASKED=False: every key of the block is visible to every row (`allowed` unused)."""
    if DOT_F32:  # the interpreter's bf16 dot is wrong (Triton 3.9): do it in fp32 there
        k_main = k_main.to(tl.float32)
        k_rope = k_rope.to(tl.float32)
    s = tl.dot(q_main, tl.trans(k_main), input_precision=DOT_PREC)
    if HAS_ROPE:
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PREC)
    if MASKED:
        s = tl.where(allowed, s * qk_scale, float("-inf"))
    else:
        s = s * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k_main.dtype), k_main, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _attend_tree(acc, m_i, l_i, q_main, q_rope, KV, PT, TM, pt_row, b, n_of, row_ok, pid_m, lo, chunk,
                 prefix, N, H, s_kp, s_ks, s_tb, s_tn, offs_v, offs_r, v_dim, D, qk_scale,
                 PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_ROPE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                 DOT_F32: tl.constexpr, KV_FP8: tl.constexpr = False, KT: tl.constexpr = None):
    """The tile's rows against the N new rows of this split (causal chain or ancestor mask)."""
    n_end = N
    if IS_CAUSAL:  # a causal tile never looks past its last row's node
        n_end = tl.minimum(N, (pid_m * BLOCK_M + BLOCK_M - 1) // H + 1)
    t_lo = tl.maximum(lo, prefix)
    t_hi = tl.minimum(lo + chunk, prefix + n_end)
    for start in range(t_lo, t_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < t_hi
        j = pos - prefix
        k_main, k_rope = _load_latent_block(KV, PT, pt_row, pos, valid, PAGE_SIZE, s_kp, s_ks,
                                            offs_v, offs_r, v_dim, D, HAS_ROPE, KV_FP8, KT)
        if IS_CAUSAL:
            allowed = (j[None, :] <= n_of[:, None]) & valid[None, :]
        else:
            tm = tl.load(TM + b.to(tl.int64) * s_tb + n_of[:, None] * s_tn + j[None, :],
                         mask=row_ok[:, None] & valid[None, :], other=0)
            allowed = tm != 0
        acc, m_i, l_i = _attend(acc, m_i, l_i, q_main, q_rope, k_main, k_rope, allowed,
                                qk_scale, HAS_ROPE, DOT_PREC, DOT_F32)

    return acc, m_i, l_i


@triton.jit
def _store_rows(acc, m_i, l_i, O, LSE, PO, PLSE, b, n_of, h_of, rows, row_ok, offs_v, v_dim, M,
                num_splits, pid_s, s_ob, s_on, s_oh, s_lb, s_ln, DIRECT: tl.constexpr):
    """Normalise and store: the output and natural-log LSE directly, or this split's partials."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    col_ok = offs_v[None, :] < v_dim
    if DIRECT:
        o_row = b.to(tl.int64) * s_ob + n_of * s_on + h_of * s_oh
        tl.store(O + o_row[:, None] + offs_v[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok)
        tl.store(LSE + b.to(tl.int64) * s_lb + n_of * s_ln + h_of, lse2 * 0.6931471805599453,
                 mask=row_ok)
    else:
        p_row = (b.to(tl.int64) * M + rows) * num_splits + pid_s  # partials [B, M, S, v_dim]
        tl.store(PO + p_row[:, None] * v_dim + offs_v[None, :], out.to(PO.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok, eviction_policy="evict_last")
        tl.store(PLSE + p_row, lse2, mask=row_ok, eviction_policy="evict_last")


@triton.jit
def _gathered_kernel(
    Q, KV, PT, PL, TM, O, LSE, PO, PLSE,
    qk_scale, H, N, M, v_dim, D, chunk_max, num_splits,
    s_qb, s_qn, s_qh, s_kp, s_ks, s_ptb, s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln,
    PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, DIRECT: tl.constexpr, HAS_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    """Grid (M tiles, splits, B): rows pid_m * BLOCK_M .. against split pid_s's keys, every key
    tile gathered row by row through the page table and masked (`_load_latent_block`); the
    prefix unmasked but for the chunk's end, then the tree part (`_attend_tree`); the output or
    this split's partial (`_store_rows`). KV_FP8: fp8_e4m3 rows, decoded in the tile."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    prefix = tl.load(PL + b)
    chunk = fit_chunk(prefix + N, num_splits, BLOCK_N)
    lo = pid_s * chunk
    if lo >= prefix + N:  # past this request's keys: the combine never reads this split
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    n_of = rows // H
    h_of = rows % H
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    q_row = b.to(tl.int64) * s_qb + n_of * s_qn + h_of * s_qh
    # the dots' dtype: float32 under the interpreter (its bf16 dot is wrong), else the cache's, or
    # q's for fp8_e4m3 rows (decoded to it)
    kv_ty = tl.float32 if DOT_F32 else (Q.dtype.element_ty if KV_FP8 else KV.dtype.element_ty)
    q_main = tl.load(Q + q_row[:, None] + offs_v[None, :],
                     mask=row_ok[:, None] & (offs_v[None, :] < v_dim), other=0.0).to(kv_ty)
    if HAS_ROPE:
        q_rope = tl.load(Q + q_row[:, None] + v_dim + offs_r[None, :],
                         mask=row_ok[:, None] & (offs_r[None, :] < D - v_dim), other=0.0).to(kv_ty)
    else:
        q_rope = q_main
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    pt_row = b.to(tl.int64) * s_ptb

    # prefix part: every row sees every key, only the chunk's end is masked
    hi = tl.minimum(lo + chunk, prefix)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        k_main, k_rope = _load_latent_block(KV, PT, pt_row, pos, valid, PAGE_SIZE, s_kp,
                                            s_ks, offs_v, offs_r, v_dim, D, HAS_ROPE, KV_FP8, kv_ty)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q_main, q_rope, k_main, k_rope,
                                valid[None, :], qk_scale, HAS_ROPE, DOT_PREC, DOT_F32)

    # tree part: the N rows' own latents at prefix .. prefix + N - 1, ancestor-masked
    acc, m_i, l_i = _attend_tree(acc, m_i, l_i, q_main, q_rope, KV, PT, TM, pt_row, b, n_of, row_ok,
                                 pid_m, lo, chunk, prefix, N, H, s_kp, s_ks, s_tb, s_tn, offs_v, offs_r,
                                 v_dim, D, qk_scale, PAGE_SIZE, IS_CAUSAL, HAS_ROPE, BLOCK_M, BLOCK_N,
                                 DOT_PREC, DOT_F32, KV_FP8, kv_ty)
    _store_rows(acc, m_i, l_i, O, LSE, PO, PLSE, b, n_of, h_of, rows, row_ok, offs_v, v_dim, M,
                num_splits, pid_s, s_ob, s_on, s_oh, s_lb, s_ln, DIRECT)


def launch(call: Call, cfg: KernelConfig) -> None:
    """Launch `_gathered_kernel` for `call` with `cfg`'s tile."""
    c, fp32 = call, torch.float32 in (call.kv_cache.dtype, call.q.dtype)
    fp8 = {"KV_FP8": True} if is_fp8_rows(call.kv_cache) else {}
    _gathered_kernel[split_grid(c, cfg.block_m)](
        c.q, c.kv_cache, c.page_table, c.prefix_lens, c.tm, c.out, c.lse, c.po, c.plse,
        c.qk_scale, c.h, c.n, c.m_rows, c.v_dim, c.d, c.chunk, c.splits,
        c.q.stride(0), c.q.stride(1), c.q.stride(2), c.kv_cache.stride(0), c.kv_cache.stride(1),
        c.page_table.stride(0), *c.mask_strides(), *c.out_strides(),
        PAGE_SIZE=c.kv_cache.shape[1], IS_CAUSAL=c.tree_mask is None, DIRECT=c.direct,
        HAS_ROPE=c.d > c.v_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_V=c.block_v,
        BLOCK_R=c.block_r, DOT_PREC="ieee" if fp32 or interpreting() else "tf32",
        DOT_F32=interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **fp8,
    )
