"""v4 of the MLA verify split kernel (`mla_verify.py`): S = QK^T computed once per latent
tile, PV accumulated into two [BLOCK_M, BLOCK_V / 2] halves. Written for M = N x H > 16 rows
(64-row tiles on 8 warps, wgmma); `KernelConfig(version=4)`, not a default yet.

Why (KERNEL_NOTES.md, v3 finding 2): Triton gives a dot whose result feeds another dot
("chained", flash attention) all its warps along M (`warpsPerTileV3` in Triton's
AccelerateMatmul looks for a dot in the forward SSA slice of the dot's result). wgmma
computes 64 rows per warpgroup, so a 64-row tile on 8 warps computes the same S in both
warpgroups: 2 x 576 + 512 = 1664 tensor units per 1088 useful, with narrow (N = 16)
wgmma instructions that re-read Q from shared memory for every 16 keys.

How: every QK dot hands its result on through an `if` on a condition that is always true
(`_unchain`): the forward slice stops at the `scf.yield` inside the `if`, so the QK dots
get Triton's default warp tiling [4, 2] and each warpgroup computes S for half the tile's
keys, once. The row max then crosses the two warpgroups through shared memory, P (bf16)
goes through shared memory so that both warpgroups feed their PV halves (FlashMLA's sm90
layout, written in Triton), and the row sums come out of the tensor cores as P times a
block of ones (no second cross-warpgroup reduction). The PV products are two dots into `acc_lo` / `acc_hi`
(wgmma 64 x 128 per warpgroup; a single [64, 512] accumulator, wgmma 64 x 256, spilled
and had its wgmmas serialised in an earlier form of this kernel under Triton 3.9), with V
read as two BLOCK_V / 2 column halves.

Order of work: the masked tiles first (the end of the prefix that does not fill a tile and
the ancestor-masked tree part, one loop of BLOCK_T keys that always runs at least once),
then the full prefix tiles. With the full-tile loop first, a split without full tiles
merges zero-initialised accumulators into the loop's results, and Triton 3.6 (the H200's)
emits register moves there that make ptxas serialise every wgmma of the kernel (C7515);
a loop that always runs once leaves the accumulators defined by a wgmma on every path.
Read off the sm_90 compile report (`bench kernel --compile-report`, KERNEL_NOTES.md).

Two opt-in variants with fewer CTA barriers a tile (the row max met in registers, the next
page id loaded a tile ahead; bench variants v4m / v4s) gained 1-2% on the H200, under the 2%
bar for a default (KERNEL_NOTES.md "v4m / v4s measured"); with v4 now only v5's fallback they
were removed in session 16 (they live in git at 4efd675).

Same inputs, partials and combine as v3: full prefix tiles through one page id per tile
(pointer or TMA) or gathered row by row (page sizes that do not hold a tile), the tree
mask or causal chain, the split-K plan `plan_splits_v3`. Value parts narrower than 32
columns (halves under 16 columns cannot feed a dot) run v3 (`mla_verify_attention_triton`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from treeflash.kernels.mla_verify import _fit_chunk, _store_rows, launch_tiled

# Keys per masked tile (the prefix's last partial tile and the tree part; loaded through
# registers, not pipelined). 64: the split holding the end of the prefix runs 2-3 masked
# tiles for a 33-node tree instead of 7 of 16 keys (it finishes last); every other split
# runs one empty tile. 16, 32 and 64 all compile spill-free under Triton 3.6 (sm_90 report).
BLOCK_T = 64


@triton.jit
def _tile_rows(PT, pt_row, start, s_kp, s_ks, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
               TILE_PAGES: tl.constexpr):
    """Element offsets [BLOCK_N] of the full tile at `start` (one page id if it fits a page)."""
    ar = tl.arange(0, BLOCK_N)
    if TILE_PAGES:
        page = tl.load(PT + pt_row + start // PAGE_SIZE)
        return page.to(tl.int64) * s_kp + (start % PAGE_SIZE) * s_ks + ar.to(tl.int64) * s_ks
    pos = start + ar
    page = tl.load(PT + pt_row + pos // PAGE_SIZE).to(tl.int64)
    return page * s_kp + (pos % PAGE_SIZE).to(tl.int64) * s_ks


@triton.jit
def _load_halves(KV, row, valid, offs_h, offs_r, v_dim, D, HAS_ROPE: tl.constexpr,
                 V_HALF: tl.constexpr, MASK_ROWS: tl.constexpr, EVEN_V: tl.constexpr,
                 EVEN_R: tl.constexpr, EVICT: tl.constexpr):
    """Rows at `row`: value halves [BLOCK_N, V_HALF] x 2 and rope part [BLOCK_N, BLOCK_R].
    MASK_ROWS=False: every row is valid (`valid` unused); EVEN_*: no column masks."""
    lo_ok = offs_h[None, :] < v_dim
    hi_ok = offs_h[None, :] + V_HALF < v_dim
    r_ok = offs_r[None, :] < D - v_dim
    if MASK_ROWS:
        lo_ok = lo_ok & valid[:, None]
        hi_ok = hi_ok & valid[:, None]
        r_ok = r_ok & valid[:, None]
    base = KV + row[:, None]
    if EVEN_V and not MASK_ROWS:
        k_lo = tl.load(base + offs_h[None, :], eviction_policy=EVICT)
        k_hi = tl.load(base + V_HALF + offs_h[None, :], eviction_policy=EVICT)
    else:
        k_lo = tl.load(base + offs_h[None, :], mask=lo_ok, other=0.0, eviction_policy=EVICT)
        k_hi = tl.load(base + V_HALF + offs_h[None, :], mask=hi_ok, other=0.0,
                       eviction_policy=EVICT)
    if HAS_ROPE:
        if EVEN_R and not MASK_ROWS:
            k_rope = tl.load(base + v_dim + offs_r[None, :], eviction_policy=EVICT)
        else:
            k_rope = tl.load(base + v_dim + offs_r[None, :], mask=r_ok, other=0.0,
                             eviction_policy=EVICT)
    else:
        k_rope = k_lo
    return k_lo, k_hi, k_rope


@triton.jit
def _load_full_tile_v4(KV, KVD, KRD, PT, pt_row, start, s_kp, s_ks, offs_h, offs_r, v_dim, D,
                       PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROPE: tl.constexpr,
                       V_HALF: tl.constexpr, TILE_PAGES: tl.constexpr, USE_TMA: tl.constexpr,
                       EVEN_V: tl.constexpr, EVEN_R: tl.constexpr, EVICT: tl.constexpr):
    """Rows start .. start + BLOCK_N - 1, all valid: as v3's `_load_full_tile`, in halves.
    USE_TMA: one descriptor over the value columns (box [BLOCK_N, V_HALF], read at column 0
    and V_HALF; columns past v_dim read as zero) and one over the rope columns."""
    if USE_TMA:
        page = tl.load(PT + pt_row + start // PAGE_SIZE)
        return _load_page_tile_v4(KV, KVD, KRD, page, start, s_kp, s_ks, offs_h, offs_r, v_dim, D,
                                  PAGE_SIZE, BLOCK_N, HAS_ROPE, V_HALF, USE_TMA, EVEN_V, EVEN_R, EVICT)
    row = _tile_rows(PT, pt_row, start, s_kp, s_ks, PAGE_SIZE, BLOCK_N, TILE_PAGES)
    return _load_halves(KV, row, None, offs_h, offs_r, v_dim, D, HAS_ROPE, V_HALF, False,
                        EVEN_V, EVEN_R, EVICT)


@triton.jit
def _load_page_tile_v4(KV, KVD, KRD, page, start, s_kp, s_ks, offs_h, offs_r, v_dim, D,
                       PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROPE: tl.constexpr,
                       V_HALF: tl.constexpr, USE_TMA: tl.constexpr, EVEN_V: tl.constexpr,
                       EVEN_R: tl.constexpr, EVICT: tl.constexpr):
    """As `_load_full_tile_v4` with TILE_PAGES, the tile's page id `page` given."""
    if USE_TMA:
        r0 = page * PAGE_SIZE + start % PAGE_SIZE
        k_lo = KVD.load([r0, 0])
        k_hi = KVD.load([r0, V_HALF])
        if HAS_ROPE:
            k_rope = KRD.load([r0, 0])
        else:
            k_rope = k_lo
        return k_lo, k_hi, k_rope
    row = (page.to(tl.int64) * s_kp + (start % PAGE_SIZE) * s_ks
           + tl.arange(0, BLOCK_N).to(tl.int64) * s_ks)
    return _load_halves(KV, row, None, offs_h, offs_r, v_dim, D, HAS_ROPE, V_HALF, False,
                        EVEN_V, EVEN_R, EVICT)


@triton.jit
def _load_block_v4(KV, PT, pt_row, pos, valid, s_kp, s_ks, offs_h, offs_r, v_dim, D,
                   PAGE_SIZE: tl.constexpr, HAS_ROPE: tl.constexpr, V_HALF: tl.constexpr):
    """Rows `pos` of one request where `valid` (tail and tree tiles), in halves."""
    page = tl.load(PT + pt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    row = page * s_kp + (pos % PAGE_SIZE).to(tl.int64) * s_ks
    return _load_halves(KV, row, valid, offs_h, offs_r, v_dim, D, HAS_ROPE, V_HALF, True,
                        False, False, "evict_first")


@triton.jit
def _unchain(s, gate, x):
    """`s` (gate is always true at run time) through an `if`: the forward SSA slice of the dot
    that made `s` ends here, so Triton does not treat it as chained (module docstring)."""
    if gate:
        out = s
    else:  # never taken; computed inside the branch so the `if` is not folded to a select
        out = s + x
    return out


@triton.jit
def _attend_v4(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_rope, k_lo, k_hi, k_rope, allowed,
               qk_scale, gate, HAS_ROPE: tl.constexpr, DOT_PREC: tl.constexpr,
               DOT_F32: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step (log2 domain) against one latent block, S computed once;
    l_i is [BLOCK_M, 16], every column the running row sum.

    S = q_lo k_lo^T + q_hi k_hi^T + q_rope k_rope^T, each partial passed through `_unchain`
    (`gate` is always true): a dot whose result reaches another dot, as the accumulator of
    the next QK dot or through P into PV, would be "chained" and computed by both
    warpgroups (module docstring). P is rounded to the value dtype once for both halves."""
    if DOT_F32:  # the interpreter's bf16 dot is wrong (Triton 3.9): do it in fp32 there
        k_lo = k_lo.to(tl.float32)
        k_hi = k_hi.to(tl.float32)
        k_rope = k_rope.to(tl.float32)
    s = _unchain(tl.dot(q_lo, tl.trans(k_lo), input_precision=DOT_PREC), gate, qk_scale)
    s = _unchain(tl.dot(q_hi, tl.trans(k_hi), s, input_precision=DOT_PREC), gate, qk_scale)
    if HAS_ROPE:
        s = _unchain(tl.dot(q_rope, tl.trans(k_rope), s, input_precision=DOT_PREC), gate,
                     qk_scale)
    s = s * qk_scale
    if MASKED:
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    p = p.to(k_lo.dtype)  # one bf16 P for both PV halves
    # the row sums of P on the tensor cores (P times a column block of ones) instead of a
    # second cross-warpgroup reduction (3 of the loop's barriers); every column holds l
    l_i = l_i * alpha[:, None] + tl.dot(p, tl.full((k_lo.shape[0], 16), 1.0, p.dtype),
                                        input_precision=DOT_PREC)
    acc_lo = acc_lo * alpha[:, None] + tl.dot(p, k_lo, input_precision=DOT_PREC)
    acc_hi = acc_hi * alpha[:, None] + tl.dot(p, k_hi, input_precision=DOT_PREC)
    return acc_lo, acc_hi, m_new, l_i


@triton.jit
def _attend_masked_v4(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_rope, KV, PT, TM, pt_row, b, n_of,
                      row_ok, start, t_hi, prefix, s_kp, s_ks, s_tb, s_tn, offs_h, offs_r, v_dim,
                      D, qk_scale, gate, PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr,
                      HAS_ROPE: tl.constexpr, V_HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                      DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """Keys start .. start + BLOCK_T - 1 below t_hi: prefix keys (j < 0) are seen by every
    row, tree node j by row (n, h) when tree_mask[b, n, j] (causal: j <= n)."""
    pos = start + tl.arange(0, BLOCK_T)
    valid = pos < t_hi
    j = pos - prefix  # tree node of a key; < 0 in the prefix
    k_lo, k_hi, k_rope = _load_block_v4(KV, PT, pt_row, pos, valid, s_kp, s_ks, offs_h, offs_r,
                                        v_dim, D, PAGE_SIZE, HAS_ROPE, V_HALF)
    if IS_CAUSAL:
        tree_ok = j[None, :] <= n_of[:, None]
    else:
        tm = tl.load(TM + b.to(tl.int64) * s_tb + n_of[:, None] * s_tn + j[None, :],
                     mask=row_ok[:, None] & (valid & (j >= 0))[None, :], other=0)
        tree_ok = tm != 0
    allowed = valid[None, :] & ((j < 0)[None, :] | tree_ok)
    return _attend_v4(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_rope, k_lo, k_hi, k_rope, allowed,
                      qk_scale, gate, HAS_ROPE, DOT_PREC, DOT_F32, True)


@triton.jit
def _mla_split_kernel_v4(
    Q, KV, KVD, KRD, PT, PL, TM, O, LSE, PO, PLSE,
    qk_scale, H, N, M, v_dim, D, chunk_max, num_splits,
    s_qb, s_qn, s_qh, s_kp, s_ks, s_ptb, s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln,
    PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, DIRECT: tl.constexpr, HAS_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, TILE_PAGES: tl.constexpr,
    USE_TMA: tl.constexpr, EVEN_V: tl.constexpr, EVEN_R: tl.constexpr, EVICT: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """v4 split kernel: grid (M tiles, splits, B) and outputs as v3 (`_store_rows`: the
    output directly, or this split's normalised partial and log2 LSE). Work order in the
    module docstring."""
    V_HALF: tl.constexpr = BLOCK_V // 2
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    prefix = tl.load(PL + b)
    chunk = _fit_chunk(prefix + N, num_splits, BLOCK_N)
    lo = pid_s * chunk
    if lo >= prefix + N:  # past this request's keys: the combine never reads this split
        return
    # Always true. Triton's passes do not know it (the `if` in _attend_v4 stays in the IR
    # through the layout choice); LLVM does (program ids are >= 0), so no branch is left.
    gate = pid_m >= 0
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    n_of = rows // H
    h_of = rows % H
    offs_h = tl.arange(0, V_HALF)
    offs_r = tl.arange(0, BLOCK_R)
    q_row = Q + (b.to(tl.int64) * s_qb + n_of * s_qn + h_of * s_qh)[:, None]
    kv_ty = tl.float32 if DOT_F32 else KV.dtype.element_ty
    q_lo = tl.load(q_row + offs_h[None, :], mask=row_ok[:, None] & (offs_h[None, :] < v_dim),
                   other=0.0).to(kv_ty)
    q_hi = tl.load(q_row + V_HALF + offs_h[None, :],
                   mask=row_ok[:, None] & (offs_h[None, :] + V_HALF < v_dim), other=0.0).to(kv_ty)
    if HAS_ROPE:
        q_rope = tl.load(q_row + v_dim + offs_r[None, :],
                         mask=row_ok[:, None] & (offs_r[None, :] < D - v_dim), other=0.0).to(kv_ty)
    else:
        q_rope = q_lo
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M, 16], tl.float32)  # 16 equal columns (_attend_v4)
    acc_lo = tl.zeros([BLOCK_M, V_HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, V_HALF], tl.float32)
    pt_row = b.to(tl.int64) * s_ptb

    # Masked tiles first (module docstring): the end of the prefix that does not fill a
    # tile, then the N rows' own latents at prefix .. prefix + N - 1, ancestor-masked.
    hi = tl.minimum(lo + chunk, prefix)
    hi_full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    n_end = N
    if IS_CAUSAL:  # a causal tile never looks past its last row's node
        n_end = tl.minimum(N, (pid_m * BLOCK_M + BLOCK_M - 1) // H + 1)
    t_hi = tl.maximum(hi, tl.minimum(lo + chunk, prefix + n_end))
    # a do-while: the first masked tile runs even when it is empty (it then adds nothing)
    start = hi_full
    more = gate
    while more:
        acc_lo, acc_hi, m_i, l_i = _attend_masked_v4(
            acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_rope, KV, PT, TM, pt_row, b, n_of, row_ok,
            start, t_hi, prefix, s_kp, s_ks, s_tb, s_tn, offs_h, offs_r, v_dim, D, qk_scale,
            gate, PAGE_SIZE, IS_CAUSAL, HAS_ROPE, V_HALF, BLOCK_T, DOT_PREC, DOT_F32)
        start += BLOCK_T
        more = start < t_hi

    # prefix part, full tiles: every row sees every key, nothing to mask
    for start in range(lo, hi_full, BLOCK_N):
        k_lo, k_hi, k_rope = _load_full_tile_v4(KV, KVD, KRD, PT, pt_row, start, s_kp, s_ks,
                                                offs_h, offs_r, v_dim, D, PAGE_SIZE, BLOCK_N,
                                                HAS_ROPE, V_HALF, TILE_PAGES, USE_TMA, EVEN_V,
                                                EVEN_R, EVICT)
        acc_lo, acc_hi, m_i, l_i = _attend_v4(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_rope,
                                              k_lo, k_hi, k_rope, None, qk_scale, gate,
                                              HAS_ROPE, DOT_PREC, DOT_F32, False)

    l_i = tl.max(l_i, 1)
    # each half stores its columns (and the same LSE: 4 bytes a row, written twice)
    _store_rows(acc_lo, m_i, l_i, O, LSE, PO, PLSE, b, n_of, h_of, rows, row_ok, offs_h, v_dim,
                M, num_splits, pid_s, s_ob, s_on, s_oh, s_lb, s_ln, DIRECT)
    _store_rows(acc_hi, m_i, l_i, O, LSE, PO, PLSE, b, n_of, h_of, rows, row_ok,
                V_HALF + offs_h, v_dim, M, num_splits, pid_s, s_ob, s_on, s_oh, s_lb, s_ln,
                DIRECT)


def launch_v4(grid, cfg, q, kv_cache, page_table, prefix_lens, tm, out, lse, po, plse,
              sm_scale, h, n, m_rows, v_dim, d, chunk, splits, tree_mask, direct,
              block_v, block_r, fp32) -> None:
    """Launch `_mla_split_kernel_v4` (same arguments as mla_verify._launch_v3; the caller
    has checked block_v >= 32)."""
    launch_tiled(_mla_split_kernel_v4, block_v // 2, grid, cfg, q, kv_cache, page_table, prefix_lens,
                 tm, out, lse, po, plse, sm_scale, h, n, m_rows, v_dim, d, chunk, splits, tree_mask,
                 direct, block_v, block_r, fp32, BLOCK_T=BLOCK_T)


__all__ = ["launch_v4"]
