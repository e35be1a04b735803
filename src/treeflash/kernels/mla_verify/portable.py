"""The portable MLA verify kernels (Triton `tl`): what runs where the Hopper kernel does not.

Two kernels over the same inputs, split plan and partials (`plan.py`, `combine.py`):

- `_portable_kernel` (impl "portable"): one [BLOCK_M, BLOCK_V] accumulator, the prefix cut into
  full tiles (one page id a tile when a tile fits in a page, pipelined by Triton, through TMA
  descriptors where the layout allows) plus at most one masked tail tile, then the tree part.
  Plain decode (<= 16 rows), prefill chunks and pages of 32 keys.
- `_portable_tree_kernel` (impl "portable_tree"): for verify trees above 16 rows over whole
  tiles, S = QK^T computed once per latent tile and PV accumulated into two [BLOCK_M,
  BLOCK_V / 2] halves. Triton gives a dot whose result feeds another dot ("chained", flash
  attention) all its warps along M, so a 64-row tile on 8 warps computed the same S in both
  warpgroups (1664 tensor units per 1088 useful). Every QK dot hands its result on through an
  `if` on a condition that is always true (`_unchain`): the forward slice stops there and each
  warpgroup computes S for half the tile's keys, once. The row max crosses the warpgroups
  through shared memory, P (bf16) goes through shared memory so both feed their PV halves
  (FlashMLA's sm90 layout, in Triton), and the row sums come out of the tensor cores as P times
  a block of ones. Order of work: the masked tiles first (the end of the prefix that does not
  fill a tile and the tree part, one loop of BLOCK_T keys that always runs at least once), then
  the full prefix tiles: with the full-tile loop first, Triton 3.6 emits register moves that
  make ptxas serialise every wgmma (C7515; `benchmarks/DESIGN_NOTES.md` 1.7). Its masked loop is
  not pipelined: verify trees (N <= 256), not prefill. Value parts narrower than 32 columns
  (halves under 16 columns cannot feed a dot) run `_portable_kernel` on the same tile.

H200 (2026-12-02, `h200-20261202-kernel-v4`, fraction of the floor, contiguous page 64): the
tree kernel took 8 x 33 at 256k from 0.26 to 0.39 and 64 x 16 from 0.31 to 0.47 against
`_portable_kernel`'s 64-row tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.kernels.mla_verify.gathered import (
    _attend,
    _attend_tree,
    _fp8_decode,
    _fp8_scales,
    _load_fp8_rows,
    _load_latent_block,
    _store_rows,
)
from treeflash.kernels.mla_verify.plan import Call, KernelConfig, fit_chunk, interpreting, split_grid
from treeflash.kvcache.format import fp8_rope_offset, is_fp8_rows

try:  # host-side TMA descriptors (Triton >= 3.4; the interpreter runs them too)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads
    TensorDescriptor = None


@triton.jit
def _load_full_tile(KV, KVD, KRD, PT, pt_row, start, s_kp, s_ks, offs_v, offs_r, v_dim, D,
                    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROPE: tl.constexpr,
                    TILE_PAGES: tl.constexpr, USE_TMA: tl.constexpr, EVEN_V: tl.constexpr,
                    EVEN_R: tl.constexpr, EVICT: tl.constexpr, KV_FP8: tl.constexpr = False,
                    KT: tl.constexpr = None):
    """Rows start .. start + BLOCK_N - 1 of one request, all of them valid (no row masks).

    TILE_PAGES (page_size % BLOCK_N == 0, start % BLOCK_N == 0): the tile lies in one page,
    so its address is one page-table entry plus an affine offset. The pipeliner then treats
    the page id as a scalar indirect load a stage ahead and streams the tile with 16-byte
    cp.async (or one TMA copy per operand with USE_TMA) into multi-buffered shared memory;
    there is no per-row index and no mask on the tile. Otherwise (page_size < BLOCK_N) one
    page-table entry per row, still without masks. EVICT: "evict_first" when one M tile reads
    the prefix (nothing else will), "" when several M tiles share it through L2.
    KV_FP8: fp8_e4m3 rows (byte offsets), decoded to KT in the tile (`_load_full_tile_fp8`)."""
    if KV_FP8:
        return _load_full_tile_fp8(KV, KVD, KRD, PT, pt_row, start, s_kp, s_ks, offs_v, offs_r, v_dim,
                                   D, PAGE_SIZE, BLOCK_N, HAS_ROPE, TILE_PAGES, USE_TMA, KT)
    else:
        ar = tl.arange(0, BLOCK_N)
        if TILE_PAGES:
            page = tl.load(PT + pt_row + start // PAGE_SIZE)
            if USE_TMA:  # descriptors over the [num_pages * page_size, D] row view
                r0 = page * PAGE_SIZE + start % PAGE_SIZE
                k_main = KVD.load([r0, 0])
                if HAS_ROPE:
                    k_rope = KRD.load([r0, 0])
                else:
                    k_rope = k_main
                return k_main, k_rope
            row = page.to(tl.int64) * s_kp + (start % PAGE_SIZE) * s_ks + ar.to(tl.int64) * s_ks
        else:
            pos = start + ar
            page = tl.load(PT + pt_row + pos // PAGE_SIZE).to(tl.int64)
            row = page * s_kp + (pos % PAGE_SIZE).to(tl.int64) * s_ks
        if EVEN_V:
            k_main = tl.load(KV + row[:, None] + offs_v[None, :], eviction_policy=EVICT)
        else:
            k_main = tl.load(KV + row[:, None] + offs_v[None, :], mask=offs_v[None, :] < v_dim,
                             other=0.0, eviction_policy=EVICT)
        if HAS_ROPE:
            if EVEN_R:
                k_rope = tl.load(KV + row[:, None] + v_dim + offs_r[None, :],
                                 eviction_policy=EVICT)
            else:
                k_rope = tl.load(KV + row[:, None] + v_dim + offs_r[None, :],
                                 mask=offs_r[None, :] < D - v_dim, other=0.0,
                                 eviction_policy=EVICT)
        else:
            k_rope = k_main
        return k_main, k_rope


@triton.jit
def _load_full_tile_fp8(KV, KVD, KRD, PT, pt_row, start, s_kp, s_ks, offs_v, offs_r, v_dim, D,
                        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROPE: tl.constexpr,
                        TILE_PAGES: tl.constexpr, USE_TMA: tl.constexpr, KT: tl.constexpr):
    """`_load_full_tile` over fp8_e4m3 rows: the codes (by TMA where USE_TMA: `_fp8_tma_tile`),
    their scales and the bf16 k_pe, decoded to KT."""
    ar = tl.arange(0, BLOCK_N)
    if TILE_PAGES:
        page = tl.load(PT + pt_row + start // PAGE_SIZE)
        row = page.to(tl.int64) * s_kp + (start % PAGE_SIZE) * s_ks + ar.to(tl.int64) * s_ks
    else:
        pos = start + ar
        page = tl.load(PT + pt_row + pos // PAGE_SIZE).to(tl.int64)
        row = page * s_kp + (pos % PAGE_SIZE).to(tl.int64) * s_ks
    if USE_TMA:
        r0 = page * PAGE_SIZE + start % PAGE_SIZE
        k_main = _fp8_tma_tile(KV, KVD, r0, s_ks, 0, v_dim, KT)
        if HAS_ROPE:
            k_rope = KRD.load([r0, 0]).to(KT)
        else:
            k_rope = k_main
    else:
        k_main, k_rope = _load_fp8_rows(KV, row, None, offs_v, offs_r, 0, v_dim, D, HAS_ROPE, False, KT)
    return k_main, k_rope


@triton.jit
def _fp8_tma_tile(KV, KVD, r0, s_ks, c0, v_dim, KT: tl.constexpr):
    """Columns c0 .. of the fp8 rows r0 .. r0 + BLOCK_N - 1 of the [rows, row_bytes] view: the
    codes by TMA (KVD: uint8 boxes over bytes 0 .. v_dim), the scales by pointer; decoded to KT."""
    codes = KVD.load([r0, c0])
    W: tl.constexpr = codes.shape[1]
    G: tl.constexpr = W // 128 if W >= 128 else 1
    row = (r0 + tl.arange(0, codes.shape[0])).to(tl.int64) * s_ks
    return _fp8_decode(codes, _fp8_scales(KV, row, None, c0, v_dim, G, False), KT)


@triton.jit
def _portable_kernel(
    Q, KV, KVD, KRD, PT, PL, TM, O, LSE, PO, PLSE,
    qk_scale, H, N, M, v_dim, D, chunk_max, num_splits,
    s_qb, s_qn, s_qh, s_kp, s_ks, s_ptb, s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln,
    PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, DIRECT: tl.constexpr, HAS_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, TILE_PAGES: tl.constexpr,
    USE_TMA: tl.constexpr, EVEN_V: tl.constexpr, EVEN_R: tl.constexpr, EVICT: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    """Grid (M tiles, splits, B): the prefix cut into full tiles (no masks, one page id a tile
    when a tile fits in a page, pipelined) plus at most one masked tail tile; then the tree
    part (`gathered._attend_tree`); the output or this split's partial (`_store_rows`).
    KV_FP8: fp8_e4m3 rows, decoded in each tile to q's dtype."""
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

    # prefix part, full tiles: every row sees every key, nothing to mask
    hi = tl.minimum(lo + chunk, prefix)
    hi_full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, hi_full, BLOCK_N):
        k_main, k_rope = _load_full_tile(KV, KVD, KRD, PT, pt_row, start, s_kp, s_ks, offs_v,
                                         offs_r, v_dim, D, PAGE_SIZE, BLOCK_N, HAS_ROPE,
                                         TILE_PAGES, USE_TMA, EVEN_V, EVEN_R, EVICT, KV_FP8, kv_ty)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q_main, q_rope, k_main, k_rope, None,
                                qk_scale, HAS_ROPE, DOT_PREC, DOT_F32, False)
    # prefix part, the one partial tile at the end of the prefix (masked rows)
    for start in range(hi_full, hi, BLOCK_N):
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
                 EVEN_R: tl.constexpr, EVICT: tl.constexpr, KV_FP8: tl.constexpr = False,
                 KT: tl.constexpr = None):
    """Rows at `row`: value halves [BLOCK_N, V_HALF] x 2 and rope part [BLOCK_N, BLOCK_R].
    MASK_ROWS=False: every row is valid (`valid` unused); EVEN_*: no column masks.
    KV_FP8: fp8_e4m3 rows at byte offsets `row`, decoded to KT."""
    if KV_FP8:
        k_lo, k_rope = _load_fp8_rows(KV, row, valid, offs_h, offs_r, 0, v_dim, D, HAS_ROPE,
                                      MASK_ROWS, KT)
        k_hi, _ = _load_fp8_rows(KV, row, valid, offs_h, offs_r, V_HALF, v_dim, D, False,
                                 MASK_ROWS, KT)
    else:
        k_lo, k_hi, k_rope = _load_halves_16(KV, row, valid, offs_h, offs_r, v_dim, D, HAS_ROPE, V_HALF,
                                             MASK_ROWS, EVEN_V, EVEN_R, EVICT)
    return k_lo, k_hi, k_rope


@triton.jit
def _load_halves_16(KV, row, valid, offs_h, offs_r, v_dim, D, HAS_ROPE: tl.constexpr,
                    V_HALF: tl.constexpr, MASK_ROWS: tl.constexpr, EVEN_V: tl.constexpr,
                    EVEN_R: tl.constexpr, EVICT: tl.constexpr):
    """`_load_halves` over 16-bit rows."""
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
def _load_full_tile_halves(KV, KVD, KRD, PT, pt_row, start, s_kp, s_ks, offs_h, offs_r, v_dim, D,
                       PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROPE: tl.constexpr,
                       V_HALF: tl.constexpr, TILE_PAGES: tl.constexpr, USE_TMA: tl.constexpr,
                       EVEN_V: tl.constexpr, EVEN_R: tl.constexpr, EVICT: tl.constexpr,
                       KV_FP8: tl.constexpr = False, KT: tl.constexpr = None):
    """Rows start .. start + BLOCK_N - 1, all valid: as `_load_full_tile`, in halves.
    USE_TMA: one descriptor over the value columns (box [BLOCK_N, V_HALF], read at column 0
    and V_HALF; columns past v_dim read as zero) and one over the rope columns."""
    if USE_TMA:
        page = tl.load(PT + pt_row + start // PAGE_SIZE)
        return _load_page_tile_halves(KV, KVD, KRD, page, start, s_kp, s_ks, offs_h, offs_r, v_dim, D,
                                  PAGE_SIZE, BLOCK_N, HAS_ROPE, V_HALF, USE_TMA, EVEN_V, EVEN_R, EVICT,
                                  KV_FP8, KT)
    row = _tile_rows(PT, pt_row, start, s_kp, s_ks, PAGE_SIZE, BLOCK_N, TILE_PAGES)
    return _load_halves(KV, row, None, offs_h, offs_r, v_dim, D, HAS_ROPE, V_HALF, False,
                        EVEN_V, EVEN_R, EVICT, KV_FP8, KT)


@triton.jit
def _load_page_tile_halves(KV, KVD, KRD, page, start, s_kp, s_ks, offs_h, offs_r, v_dim, D,
                       PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROPE: tl.constexpr,
                       V_HALF: tl.constexpr, USE_TMA: tl.constexpr, EVEN_V: tl.constexpr,
                       EVEN_R: tl.constexpr, EVICT: tl.constexpr, KV_FP8: tl.constexpr = False,
                       KT: tl.constexpr = None):
    """As `_load_full_tile_halves` with TILE_PAGES, the tile's page id `page` given."""
    if USE_TMA and KV_FP8:
        r0 = page * PAGE_SIZE + start % PAGE_SIZE
        k_lo = _fp8_tma_tile(KV, KVD, r0, s_ks, 0, v_dim, KT)
        k_hi = _fp8_tma_tile(KV, KVD, r0, s_ks, V_HALF, v_dim, KT)
        if HAS_ROPE:
            k_rope = KRD.load([r0, 0]).to(KT)
        else:
            k_rope = k_lo
        return k_lo, k_hi, k_rope
    elif USE_TMA:
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
                        EVEN_V, EVEN_R, EVICT, KV_FP8, KT)


@triton.jit
def _load_block_halves(KV, PT, pt_row, pos, valid, s_kp, s_ks, offs_h, offs_r, v_dim, D,
                   PAGE_SIZE: tl.constexpr, HAS_ROPE: tl.constexpr, V_HALF: tl.constexpr,
                   KV_FP8: tl.constexpr = False, KT: tl.constexpr = None):
    """Rows `pos` of one request where `valid` (tail and tree tiles), in halves."""
    page = tl.load(PT + pt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    row = page * s_kp + (pos % PAGE_SIZE).to(tl.int64) * s_ks
    return _load_halves(KV, row, valid, offs_h, offs_r, v_dim, D, HAS_ROPE, V_HALF, True,
                        False, False, "evict_first", KV_FP8, KT)


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
def _attend_halves(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_rope, k_lo, k_hi, k_rope, allowed,
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
def _attend_masked_halves(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_rope, KV, PT, TM, pt_row, b, n_of,
                      row_ok, start, t_hi, prefix, s_kp, s_ks, s_tb, s_tn, offs_h, offs_r, v_dim,
                      D, qk_scale, gate, PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr,
                      HAS_ROPE: tl.constexpr, V_HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                      DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, KV_FP8: tl.constexpr = False,
                      KT: tl.constexpr = None):
    """Keys start .. start + BLOCK_T - 1 below t_hi: prefix keys (j < 0) are seen by every
    row, tree node j by row (n, h) when tree_mask[b, n, j] (causal: j <= n)."""
    pos = start + tl.arange(0, BLOCK_T)
    valid = pos < t_hi
    j = pos - prefix  # tree node of a key; < 0 in the prefix
    k_lo, k_hi, k_rope = _load_block_halves(KV, PT, pt_row, pos, valid, s_kp, s_ks, offs_h, offs_r,
                                        v_dim, D, PAGE_SIZE, HAS_ROPE, V_HALF, KV_FP8, KT)
    if IS_CAUSAL:
        tree_ok = j[None, :] <= n_of[:, None]
    else:
        tm = tl.load(TM + b.to(tl.int64) * s_tb + n_of[:, None] * s_tn + j[None, :],
                     mask=row_ok[:, None] & (valid & (j >= 0))[None, :], other=0)
        tree_ok = tm != 0
    allowed = valid[None, :] & ((j < 0)[None, :] | tree_ok)
    return _attend_halves(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_rope, k_lo, k_hi, k_rope, allowed,
                      qk_scale, gate, HAS_ROPE, DOT_PREC, DOT_F32, True)


@triton.jit
def _portable_tree_kernel(
    Q, KV, KVD, KRD, PT, PL, TM, O, LSE, PO, PLSE,
    qk_scale, H, N, M, v_dim, D, chunk_max, num_splits,
    s_qb, s_qn, s_qh, s_kp, s_ks, s_ptb, s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln,
    PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, DIRECT: tl.constexpr, HAS_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, TILE_PAGES: tl.constexpr,
    USE_TMA: tl.constexpr, EVEN_V: tl.constexpr, EVEN_R: tl.constexpr, EVICT: tl.constexpr,
    BLOCK_T: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    """Grid (M tiles, splits, B) and outputs as `_portable_kernel` (`_store_rows`: the output
    directly, or this split's normalised partial and log2 LSE). Work order in the module
    docstring."""
    V_HALF: tl.constexpr = BLOCK_V // 2
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    prefix = tl.load(PL + b)
    chunk = fit_chunk(prefix + N, num_splits, BLOCK_N)
    lo = pid_s * chunk
    if lo >= prefix + N:  # past this request's keys: the combine never reads this split
        return
    # Always true. Triton's passes do not know it (the `if` in _attend_halves stays in the IR
    # through the layout choice); LLVM does (program ids are >= 0), so no branch is left.
    gate = pid_m >= 0
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    n_of = rows // H
    h_of = rows % H
    offs_h = tl.arange(0, V_HALF)
    offs_r = tl.arange(0, BLOCK_R)
    q_row = Q + (b.to(tl.int64) * s_qb + n_of * s_qn + h_of * s_qh)[:, None]
    kv_ty = tl.float32 if DOT_F32 else (Q.dtype.element_ty if KV_FP8 else KV.dtype.element_ty)
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
    l_i = tl.zeros([BLOCK_M, 16], tl.float32)  # 16 equal columns (_attend_halves)
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
        acc_lo, acc_hi, m_i, l_i = _attend_masked_halves(
            acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_rope, KV, PT, TM, pt_row, b, n_of, row_ok,
            start, t_hi, prefix, s_kp, s_ks, s_tb, s_tn, offs_h, offs_r, v_dim, D, qk_scale,
            gate, PAGE_SIZE, IS_CAUSAL, HAS_ROPE, V_HALF, BLOCK_T, DOT_PREC, DOT_F32, KV_FP8, kv_ty)
        start += BLOCK_T
        more = start < t_hi

    # prefix part, full tiles: every row sees every key, nothing to mask
    for start in range(lo, hi_full, BLOCK_N):
        k_lo, k_hi, k_rope = _load_full_tile_halves(KV, KVD, KRD, PT, pt_row, start, s_kp, s_ks,
                                                offs_h, offs_r, v_dim, D, PAGE_SIZE, BLOCK_N,
                                                HAS_ROPE, V_HALF, TILE_PAGES, USE_TMA, EVEN_V,
                                                EVEN_R, EVICT, KV_FP8, kv_ty)
        acc_lo, acc_hi, m_i, l_i = _attend_halves(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_rope,
                                              k_lo, k_hi, k_rope, None, qk_scale, gate,
                                              HAS_ROPE, DOT_PREC, DOT_F32, False)

    l_i = tl.max(l_i, 1)
    # each half stores its columns (and the same LSE: 4 bytes a row, written twice)
    _store_rows(acc_lo, m_i, l_i, O, LSE, PO, PLSE, b, n_of, h_of, rows, row_ok, offs_h, v_dim,
                M, num_splits, pid_s, s_ob, s_on, s_oh, s_lb, s_ln, DIRECT)
    _store_rows(acc_hi, m_i, l_i, O, LSE, PO, PLSE, b, n_of, h_of, rows, row_ok,
                V_HALF + offs_h, v_dim, M, num_splits, pid_s, s_ob, s_on, s_oh, s_lb, s_ln,
                DIRECT)


def launch(call: Call, cfg: KernelConfig) -> None:
    """Launch `_portable_kernel` for `call` with `cfg`'s tile."""
    _launch_tiled(_portable_kernel, call.block_v, call, cfg)


def launch_tree(call: Call, cfg: KernelConfig) -> None:
    """Launch `_portable_tree_kernel` for `call` with `cfg`'s tile; value parts under 32
    columns run `_portable_kernel` on the same tile (module docstring)."""
    if call.block_v < 32:
        _launch_tiled(_portable_kernel, call.block_v, call, cfg)
    else:
        _launch_tiled(_portable_tree_kernel, call.block_v // 2, call, cfg, BLOCK_T=BLOCK_T)


def _tma_ok(kv_cache: torch.Tensor, v_dim: int, cfg: KernelConfig) -> bool:
    """TMA needs the [num_pages * page_size, D] row view, 16-byte aligned bases and strides
    (fp8 rows: every part of a row starts at a multiple of 16 bytes, `kvcache.format`)."""
    es = kv_cache.element_size()
    return (TensorDescriptor is not None and cfg.tma and kv_cache.shape[1] % cfg.block_n == 0
            and kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.stride(1)
            and (kv_cache.stride(1) * es) % 16 == 0 and (v_dim * es) % 16 == 0
            and kv_cache.data_ptr() % 16 == 0)


def _fp8_descriptors(kv_cache: torch.Tensor, d: int, v_dim: int, cfg: KernelConfig, v_tile_cols: int,
                     block_r: int):
    """(KVD, KRD) over fp8 rows: uint8 boxes [block_n, v_tile_cols] over bytes 0 .. v_dim of the
    [rows, row_bytes] view (the codes) and bf16 boxes [block_n, block_r] over the rope part."""
    rows, row_bytes = kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(rows, row_bytes)
    kvd = krd = TensorDescriptor(flat, [rows, v_dim], [row_bytes, 1], [cfg.block_n, v_tile_cols])
    if d > v_dim:
        rope_off = fp8_rope_offset(v_dim)
        rope = flat[:, rope_off:rope_off + 2 * (d - v_dim)].view(torch.bfloat16)
        krd = TensorDescriptor(rope, [rows, d - v_dim], [row_bytes // 2, 1], [cfg.block_n, block_r])
    return kvd, krd


def _launch_tiled(kernel, v_tile_cols: int, call: Call, cfg: KernelConfig, **constexprs) -> None:
    """Launch a full-tile split kernel (both take one argument list): TMA descriptors over the
    [num_pages * page_size, D] row view when the layout allows (value tiles v_tile_cols
    wide), else the page-addressed pointer path."""
    c, kv_cache, d, v_dim = call, call.kv_cache, call.d, call.v_dim
    page_size = kv_cache.shape[1]
    tile_pages = page_size % cfg.block_n == 0
    use_tma = tile_pages and _tma_ok(kv_cache, v_dim, cfg)
    kvd = krd = kv_cache
    fp8 = is_fp8_rows(kv_cache)
    if fp8:
        constexprs["KV_FP8"] = True
        if use_tma:
            kvd, krd = _fp8_descriptors(kv_cache, d, v_dim, cfg, v_tile_cols, c.block_r)
    elif use_tma:
        rows = kv_cache.shape[0] * page_size
        flat = kv_cache.view(rows, d)  # one row per position slot
        kvd = krd = TensorDescriptor(flat, [rows, v_dim], [flat.stride(0), 1], [cfg.block_n, v_tile_cols])
        if d > v_dim:
            krd = TensorDescriptor(flat[:, v_dim:], [rows, d - v_dim], [flat.stride(0), 1],
                                   [cfg.block_n, c.block_r])
    grid = split_grid(c, cfg.block_m)
    fp32 = torch.float32 in (kv_cache.dtype, c.q.dtype)
    kernel[grid](
        c.q, kv_cache, kvd, krd, c.page_table, c.prefix_lens, c.tm, c.out, c.lse, c.po, c.plse,
        c.qk_scale, c.h, c.n, c.m_rows, v_dim, d, c.chunk, c.splits,
        c.q.stride(0), c.q.stride(1), c.q.stride(2), kv_cache.stride(0), kv_cache.stride(1),
        c.page_table.stride(0), *c.mask_strides(), *c.out_strides(),
        PAGE_SIZE=page_size, IS_CAUSAL=c.tree_mask is None, DIRECT=c.direct, HAS_ROPE=d > v_dim,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_V=c.block_v, BLOCK_R=c.block_r,
        DOT_PREC="ieee" if fp32 or interpreting() else "tf32", DOT_F32=interpreting(),
        TILE_PAGES=tile_pages, USE_TMA=use_tma, EVEN_V=c.block_v == v_dim,
        EVEN_R=c.block_r == d - v_dim, EVICT="evict_first" if grid[0] == 1 else "",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **constexprs,
    )
