"""Grouped expert GEMMs for MoE: every routed (token, expert) pair in three launches, no host sync.

The token-expert assignments are sorted by expert on the device (one routing launch,
`route_blocks`) and cut into blocks of BLOCK_M rows that never straddle two experts. One
program computes one block against one tile of the expert's weights, so at decode sizes
(a 16-64 node tree: most touched experts get a few rows, one block) each touched expert's
weights are read once per step, and an untouched expert costs nothing. The grid is sized from host-known shapes only
(cdiv(A, BLOCK_M) + min(E, A) blocks, A = T * top_k), idle blocks return at once: the
launch is CUDA-graph capturable and never asks the host how many experts were hit.

    gate_up: H[r, :] = silu(x[t] @ w_gate[e]^T) * (x[t] @ w_up[e]^T)   (row r = sorted pair)
    down:    Y[a, :] = weight[a] * (H[r] @ w_down[e]^T)                 (a = t * top_k + j)
    out[t]  = sum_j Y[t * top_k + j]                                    (fixed order: deterministic)

Split K (`split_k`, auto by default): at decode a token touches top_k experts, and gate_up has
inter / BLOCK_N column tiles an expert (4 at Kimi K2 TP8), so one token gives 32 programs, each
streaming 1.8 MB of weights alone on an SM: a quarter of the HBM bandwidth (H200, 2026-12-02:
55 us where the bytes take 14). With split K the hidden dimension is cut into S chunks; each
program stores fp32 partials of gate and up and counts itself in on its tile's counter, and the
tile's last program to arrive sums the S partials in split order (deterministic), applies
silu(g) * u and stores H as without the split, then resets the counter for the next call (no
extra launch, no memset, graph-capturable).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from treeflash.kernels.device import num_sms as _num_sms
from treeflash.kernels.device import tile_counters as _tile_counters

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BLOCK_M = 16  # rows per block: a tree's typical rows per expert fit one block
# GPU tiles (gate_up BLOCK_N, BLOCK_K, down BLOCK_N, BLOCK_K, num_stages). gate_up's 128-wide K
# step: H200, Kimi K2 TP8 + the shared expert (bench_moe_split --tiles, 2026-12-06), the call
# 42.6 -> 39.6 / 116.9 -> 102.4 / 323.4 -> 319.4 / 571.9 -> 528.7 us at 1 / 4 / 16 / 32 rows
# against 64; a wider down K step (128, 256) or 4 stages were slower.
# float32 keeps the 64-wide step: at 128, gate_up's 3 stages take 144 KB of shared memory (sm_90
# compile), more than a consumer GPU's 99 KB, and float32 was not timed.
GPU_TILES = (64, 128, 64, 64, 3)
GPU_TILES_FP32 = (64, 64, 64, 64, 3)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _block_head(BLK_E, BLK_R0, BLK_R1, pid_m, NB):
    """A routed block's (local expert or -1 if idle, first row, end row) of the sorted pairs;
    a shared block (pid_m >= NB) gets (0, 0, 0): it always runs."""
    if pid_m < NB:
        e = tl.load(BLK_E + pid_m)
        r0 = tl.load(BLK_R0 + pid_m)
        r1 = tl.load(BLK_R1 + pid_m)
    else:
        e = pid_m - pid_m  # int32 0, the type tl.load gives above
        r0 = e
        r1 = e
    return e, r0, r1


@triton.jit
def _shared_rows(pid_m, NB, S_CH, T, BLOCK_M: tl.constexpr):
    """Shared block pid_m >= NB: (its chunk c, its BLOCK_M token ids as int64, which exist)."""
    sb = pid_m - NB
    t32 = (sb // S_CH) * BLOCK_M + tl.arange(0, BLOCK_M)
    return sb % S_CH, t32.to(tl.int64), t32 < T


@triton.jit
def _gate_up_kernel(X, WG, WU, HOUT, ORDER, BLK_E, BLK_R0, BLK_R1, HID, INTER, TOPK,
                    s_xt, s_we, s_wn, s_ht, PART, CNT, k_chunk, s_ps, s_pr,
                    WSG, WSU, NB, T, A, S_CH, s_swe, s_swn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, SPLIT_K: tl.constexpr):
    """HOUT [A + T * S_CH, INTER] = silu(gate) * up in the output dtype. Programs m < NB are
    the routed blocks (rows = sorted pairs); m >= NB are the shared experts' blocks: BLOCK_M
    tokens x one chunk c of S_CH (weights WSG / WSU + c * s_swe, H rows A + t * S_CH + c).
    SPLIT_K > 1: program (m, n, s)
    sums hidden columns s * k_chunk .. into fp32 partials PART [SPLIT_K, rows, 2 * INTER] (gate
    at columns 0 .. INTER - 1, up at INTER ..; strides s_ps, s_pr), then adds one to CNT[m, n];
    the program that finds SPLIT_K - 1 there sums the partials in split order, stores H and
    sets the counter back to 0."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, r0, r1 = _block_head(BLK_E, BLK_R0, BLK_R1, pid_m, NB)
    if e < 0:
        return
    if pid_m < NB:
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < r1
        tok = (tl.load(ORDER + rows, mask=row_ok, other=0) // TOPK).to(tl.int64)
        hrows = rows.to(tl.int64)
        wg_p = WG + e.to(tl.int64) * s_we
        wu_p = WU + e.to(tl.int64) * s_we
        swn = s_wn
    else:
        c, tok, row_ok = _shared_rows(pid_m, NB, S_CH, T, BLOCK_M)
        hrows = A + tok * S_CH + c
        wg_p = WSG + c.to(tl.int64) * s_swe
        wu_p = WSU + c.to(tl.int64) * s_swe
        swn = s_swn
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = 0
    k_hi = HID
    if SPLIT_K > 1:
        k_lo = tl.program_id(2) * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, HID)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(X + tok[:, None] * s_xt + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_off = cols[None, :].to(tl.int64) * swn + ks[:, None]  # [BLOCK_K, BLOCK_N] = W^T tile
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(wg_p + w_off, mask=w_mask, other=0.0)
        wu = tl.load(wu_p + w_off, mask=w_mask, other=0.0)
        if DOT_F32:  # the interpreter's half-precision dot is not faithful
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(x, wg, acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(x, wu, acc_u, input_precision=DOT_PREC)
    ok2 = row_ok[:, None] & col_ok[None, :]
    out = HOUT + hrows[:, None] * s_ht + cols[None, :]
    if SPLIT_K > 1:
        part = PART + hrows[:, None] * s_pr + cols[None, :]
        tl.store(part + tl.program_id(2).to(tl.int64) * s_ps, acc_g, mask=ok2)
        tl.store(part + tl.program_id(2).to(tl.int64) * s_ps + INTER, acc_u, mask=ok2)
        tl.debug_barrier()  # every thread's partial stored before the release below
        cnt = CNT + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            acc_g = tl.load(part, mask=ok2, other=0.0, cache_modifier=".cg")
            acc_u = tl.load(part + INTER, mask=ok2, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                acc_g += tl.load(part + s * s_ps, mask=ok2, other=0.0, cache_modifier=".cg")
                acc_u += tl.load(part + s * s_ps + INTER, mask=ok2, other=0.0, cache_modifier=".cg")
            h = acc_g * tl.sigmoid(acc_g) * acc_u
            tl.store(out, h.to(HOUT.dtype.element_ty), mask=ok2)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call
    else:
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(out, h.to(HOUT.dtype.element_ty), mask=ok2)


@triton.jit
def _down_kernel(HIN, WD, Y, ORDER, WEIGHT, BLK_E, BLK_R0, BLK_R1, HID, INTER,
                 s_ht, s_we, s_wn, s_yt, WSD, NB, T, A, TOPK, S_CH, s_swe, s_swn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """Y [T, TOPK + S_CH, HID] fp32: routed pair a = t * TOPK + j at row t * (TOPK + S_CH) + j
    (times its weight), shared chunk c of token t at row t * (TOPK + S_CH) + TOPK + c."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, r0, r1 = _block_head(BLK_E, BLK_R0, BLK_R1, pid_m, NB)
    if e < 0:
        return
    if pid_m < NB:
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < r1
        pair = tl.load(ORDER + rows, mask=row_ok, other=0).to(tl.int64)
        hrows = rows.to(tl.int64)
        yrows = (pair // TOPK) * (TOPK + S_CH) + pair % TOPK
        wt = tl.load(WEIGHT + pair, mask=row_ok, other=0.0)
        w_p = WD + e.to(tl.int64) * s_we
        swn = s_wn
    else:
        c, tok, row_ok = _shared_rows(pid_m, NB, S_CH, T, BLOCK_M)
        hrows = A + tok * S_CH + c
        yrows = tok * (TOPK + S_CH) + TOPK + c
        wt = tl.where(row_ok, 1.0, 0.0)
        w_p = WSD + c.to(tl.int64) * s_swe
        swn = s_swn
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < HID
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < INTER
        h = tl.load(HIN + hrows[:, None] * s_ht + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_p + cols[None, :].to(tl.int64) * swn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=DOT_PREC)
    acc = acc * wt[:, None]
    tl.store(Y + yrows[:, None] * s_yt + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_rows_kernel(Y, OUT, HID, s_yt, s_ot, KS: tl.constexpr, KS_PAD: tl.constexpr,
                     BLOCK: tl.constexpr):
    """OUT[t, :] = sum over j < KS of Y[t * KS + j, :] (fp32, one fixed tree order), cast to
    OUT's dtype: the top-k (+ shared) sum and the cast in one launch."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, KS_PAD)
    ok = (j[:, None] < KS) & (cols[None, :] < HID)
    y = tl.load(Y + (t * KS + j[:, None]) * s_yt + cols[None, :], mask=ok, other=0.0)
    tl.store(OUT + t * s_ot + cols, tl.sum(y, axis=0).to(OUT.dtype.element_ty), mask=cols < HID)


# Size limits of the fused routing kernel (one program holds all pairs, all local experts and
# all blocks in registers); beyond them route_blocks falls back to route_blocks_torch.
ROUTE_MAX_PAIRS = 4096
ROUTE_MAX_LOCAL = 512


@triton.jit(do_not_specialize=["A", "NUM_LOCAL", "OFFSET", "MAX_BLOCKS"])
def _route_kernel(IDS, ORDER, BLK_E, BLK_R0, BLK_R1, COUNTS, S_KEY, S_SEG, S_CUM, LAST, TOTAL,
                  A, NUM_LOCAL, OFFSET, MAX_BLOCKS,
                  BM: tl.constexpr, A_PAD: tl.constexpr, LOG_A: tl.constexpr,
                  E_PAD: tl.constexpr, LOG_E: tl.constexpr, MB_PAD: tl.constexpr, STATS: tl.constexpr):
    """route_blocks in one program (`_route_body`)."""
    _route_body(IDS, ORDER, BLK_E, BLK_R0, BLK_R1, COUNTS, S_KEY, S_SEG, S_CUM, LAST, TOTAL, A, NUM_LOCAL, OFFSET,
                MAX_BLOCKS, BM, A_PAD, LOG_A, E_PAD, LOG_E, MB_PAD, STATS)


@triton.jit
def _route_body(IDS, ORDER, BLK_E, BLK_R0, BLK_R1, COUNTS, S_KEY, S_SEG, S_CUM, LAST, TOTAL,
                A, NUM_LOCAL, OFFSET, MAX_BLOCKS,
                BM: tl.constexpr, A_PAD: tl.constexpr, LOG_A: tl.constexpr,
                E_PAD: tl.constexpr, LOG_E: tl.constexpr, MB_PAD: tl.constexpr, STATS: tl.constexpr):
    """route_blocks by one program (`_route_kernel`).
    S_KEY [A_PAD], S_SEG / S_CUM [E_PAD] int32 are global scratch: values written there are
    re-read (gathered) after a CTA barrier. STATS (every expert local): the counts are also the
    routing statistics, LAST[:] = counts, TOTAL += counts."""
    # 1. key = local expert (NUM_LOCAL: owned elsewhere; NUM_LOCAL + 1: padding lane), stable
    #    sort through the unique composite key * A_PAD + pair (< 2^31 at the size limits).
    idx = tl.arange(0, A_PAD)
    in_a = idx < A
    local = tl.load(IDS + idx, mask=in_a, other=0).to(tl.int64) - OFFSET
    owned = (local >= 0) & (local < NUM_LOCAL)
    key = tl.where(owned, local, NUM_LOCAL).to(tl.int32)
    key = tl.where(in_a, key, NUM_LOCAL + 1)
    comp = tl.sort(key * A_PAD + idx)
    tl.store(ORDER + idx, comp & (A_PAD - 1), mask=in_a)
    tl.store(S_KEY + idx, comp >> LOG_A)
    tl.debug_barrier()
    # 2. per local expert e: seg_start = #sorted keys < e, seg_end = #keys < e + 1 (binary
    #    searches over the sorted keys), counts, blocks, inclusive block prefix sum.
    e = tl.arange(0, E_PAD)
    e_ok = e < NUM_LOCAL
    lo_s = tl.zeros([E_PAD], dtype=tl.int32)
    hi_s = lo_s + A_PAD
    lo_t = lo_s
    hi_t = hi_s
    for _ in tl.static_range(LOG_A + 1):
        act_s = lo_s < hi_s
        mid_s = (lo_s + hi_s) >> 1
        v_s = tl.load(S_KEY + mid_s, mask=act_s, other=0)
        go_s = act_s & (v_s < e)
        lo_s = tl.where(go_s, mid_s + 1, lo_s)
        hi_s = tl.where(act_s & (v_s >= e), mid_s, hi_s)
        act_t = lo_t < hi_t
        mid_t = (lo_t + hi_t) >> 1
        v_t = tl.load(S_KEY + mid_t, mask=act_t, other=0)
        go_t = act_t & (v_t < e + 1)
        lo_t = tl.where(go_t, mid_t + 1, lo_t)
        hi_t = tl.where(act_t & (v_t >= e + 1), mid_t, hi_t)
    cnt = tl.where(e_ok, lo_t - lo_s, 0)
    cum = tl.cumsum((cnt + BM - 1) // BM, 0)
    tl.store(COUNTS + e, cnt.to(tl.int64), mask=e_ok)
    if STATS:
        tl.store(LAST + e, cnt.to(tl.int64), mask=e_ok)
        tl.store(TOTAL + e, tl.load(TOTAL + e, mask=e_ok, other=0) + cnt.to(tl.int64), mask=e_ok)
    tl.store(S_SEG + e, lo_s, mask=e_ok)
    tl.store(S_CUM + e, cum, mask=e_ok)
    tl.debug_barrier()
    # 3. block b -> expert = #(cum <= b) over the local experts (searchsorted right=True);
    #    idle blocks (b >= total blocks) take the last expert's numbers, as the torch version.
    b = tl.arange(0, MB_PAD)
    lo = tl.zeros([MB_PAD], dtype=tl.int32)
    hi = lo + NUM_LOCAL
    for _ in tl.static_range(LOG_E + 1):
        act = lo < hi
        mid = (lo + hi) >> 1
        v = tl.load(S_CUM + mid, mask=act, other=0)
        lo = tl.where(act & (v <= b), mid + 1, lo)
        hi = tl.where(act & (v > b), mid, hi)
    ec = tl.minimum(lo, NUM_LOCAL - 1)
    seg = tl.load(S_SEG + ec)
    n = tl.load(COUNTS + ec).to(tl.int32)
    first = tl.load(S_CUM + ec) - (n + BM - 1) // BM
    b_ok = b < MAX_BLOCKS
    tl.store(BLK_E + b, tl.where(lo >= NUM_LOCAL, -1, lo), mask=b_ok)
    tl.store(BLK_R0 + b, seg + (b - first) * BM, mask=b_ok)
    tl.store(BLK_R1 + b, seg + n, mask=b_ok)


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def route_blocks(topk_ids: torch.Tensor, num_local: int, expert_offset: int, block_m: int = BLOCK_M,
                 stats: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Sort the pairs by local expert and cut them into blocks, on the device (no host sync).
    stats: (last, total) [num_local] int64 routing statistics to fill where every expert is local
    (expert_offset 0) and the one-launch path runs: last[:] = counts, total += counts in the same
    launch. Returns the five tensors below and whether it filled stats.

    topk_ids [T, K] global expert ids. Returns order [A] int32 (pair index a = t*K + j,
    sorted by local expert, stable; pairs of experts this rank does not own last),
    block_expert / block_row0 / block_row1 [max_blocks] int32 (local expert or -1 for an
    idle block; its rows [row0, row1) of the sorted order) and counts [num_local] int64,
    max_blocks = cdiv(A, block_m) + min(num_local, A) (host-known: the GEMM grids need no sync).

    One Triton launch (`_route_kernel`, a single program) for A <= ROUTE_MAX_PAIRS and
    1 <= num_local <= ROUTE_MAX_LOCAL on CUDA (or in the interpreter); otherwise
    `route_blocks_torch`, whose outputs it reproduces exactly (idle blocks' rows included).
    It replaces that torch version's ~35 small ops (where, sort, scatter_add, two cumsums,
    searchsorted, gathers, clamp, ...): measured on an H200 (2026-12-02, batch-1 decode,
    1 token x top-8 over 384 local experts, profile-moe-rows1.txt) one MoE call cost 645 us
    of host time for 123 us of GPU time, and even under CUDA graphs those tiny kernels cost
    ~2-3 us of GPU time each, more than the expert GEMMs (gate_up 54 us, down 10 us).
    With it one MoE call took 194 / 451 / 1077 / 1224 us at 1 / 17 / 129 / 257 rows on the
    H200 (before: 797 / 1050 / 1646 / 1851; floor 21 / 299 / 930 / 997 us).
    """
    plan = route_plan(topk_ids.numel(), num_local, expert_offset, topk_ids.device, block_m, stats)
    if plan is None:
        return (*route_blocks_torch(topk_ids, num_local, expert_offset, block_m), False)
    _route_kernel[(1,)](topk_ids.reshape(-1), *plan.args, **plan.meta,
                        num_warps=4 if plan.meta["A_PAD"] <= 1024 else 8)
    return (*plan.outputs(), plan.stats_filled)


@dataclasses.dataclass
class RoutePlan:
    """The one-program routing (`_route_body`) for A pairs: its outputs and scratch (`args`, in
    `_route_body`'s order after IDS), its constants (`meta`), whether it fills the routing
    statistics."""
    args: tuple
    meta: dict
    stats_filled: bool

    def outputs(self) -> tuple:
        """(order, block_expert, block_row0, block_row1, counts), as route_blocks returns them."""
        return self.args[:5]


def route_plan(a: int, num_local: int, expert_offset: int, device: torch.device, block_m: int = BLOCK_M,
               stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> RoutePlan | None:
    """Buffers and constants of the one-program routing of A pairs, or None where route_blocks
    takes the torch path (too many pairs or experts, CPU tensors outside the interpreter).
    stats: filled by the routing where every expert is local (see route_blocks)."""
    if not (0 < a <= ROUTE_MAX_PAIRS and 0 < num_local <= ROUTE_MAX_LOCAL
            and (device.type == "cuda" or _interpreting())):
        return None
    fill = stats is not None and expert_offset == 0 and all(
        s.shape == (num_local,) and s.dtype == torch.int64 and s.is_contiguous() for s in stats)
    max_blocks = triton.cdiv(a, block_m) + min(num_local, a)
    a_pad = max(16, triton.next_power_of_2(a))
    e_pad = max(16, triton.next_power_of_2(num_local))
    mb_pad = max(16, triton.next_power_of_2(max_blocks))
    # One int32 buffer for the outputs and the scratch, every piece 64-byte aligned (so the
    # GEMM kernels see the same pointer alignment whatever A is).
    o_blk = _pad16(a)
    o_s = o_blk + 3 * _pad16(max_blocks)
    buf = torch.empty(o_s + a_pad + 2 * e_pad, dtype=torch.int32, device=device)
    mb16 = _pad16(max_blocks)
    counts = torch.empty(num_local, dtype=torch.int64, device=device)
    last, total = stats if fill else (counts, counts)
    args = (buf[:a], buf[o_blk:o_blk + max_blocks], buf[o_blk + mb16:o_blk + mb16 + max_blocks],
            buf[o_blk + 2 * mb16:o_blk + 2 * mb16 + max_blocks], counts,
            buf[o_s:], buf[o_s + a_pad:], buf[o_s + a_pad + e_pad:], last, total,
            a, num_local, expert_offset, max_blocks)
    meta = dict(BM=block_m, A_PAD=a_pad, LOG_A=a_pad.bit_length() - 1, E_PAD=e_pad, LOG_E=e_pad.bit_length() - 1,
                MB_PAD=mb_pad, STATS=fill)
    return RoutePlan(args, meta, fill)


def route_blocks_torch(topk_ids: torch.Tensor, num_local: int, expert_offset: int, block_m: int = BLOCK_M):
    """`route_blocks` in ~35 torch ops: the CPU path, the fallback beyond the fused kernel's
    sizes and the reference its tests compare against exactly."""
    a = topk_ids.numel()
    dev = topk_ids.device
    local = topk_ids.reshape(-1) - expert_offset
    key = torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, num_local))
    order = torch.sort(key, stable=True).indices.to(torch.int32)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_local]
    seg_start = torch.cumsum(counts, 0) - counts
    nblk = (counts + block_m - 1) // block_m
    blk_cum = torch.cumsum(nblk, 0)
    max_blocks = triton.cdiv(a, block_m) + min(num_local, a)
    pid = torch.arange(max_blocks, device=dev)
    e = torch.searchsorted(blk_cum, pid, right=True)
    ec = e.clamp(max=num_local - 1)
    row0 = seg_start[ec] + (pid - (blk_cum[ec] - nblk[ec])) * block_m
    row1 = seg_start[ec] + counts[ec]
    idle = e >= num_local
    block_expert = torch.where(idle, -1, e).to(torch.int32)
    return order, block_expert, row0.to(torch.int32), row1.to(torch.int32), counts


MAX_SPLIT_K = 8
MIN_SPLIT_STEPS = 4  # BLOCK_K steps a split keeps at least
# what split K aims gate_up's busy programs at: one an SM. On the H200 (bench_moe_split.py,
# 2026-12-05) 8 rows (57 experts, 228-256 busy programs) lost 6 us with 2 splits (171 vs 165),
# while 1-4 rows (32-128) gained 10-32 us
PROGRAMS_PER_SM = 1


@functools.lru_cache(maxsize=8)
def default_tiles(dtype: torch.dtype, interp: bool) -> tuple:
    """The grouped call's tiles (see moe_experts_triton's `tiles`) when none are given."""
    if interp:
        return (32, 32, 32, 32, 3)
    return GPU_TILES_FP32 if dtype == torch.float32 else GPU_TILES


def plan_split_k(pairs: int, num_local: int, inter: int, hid: int, block_n: int, block_k: int,
                 num_sms: int, extra_blocks: int = 0) -> int:
    """gate_up's split count from host-known shapes (graph-capturable): the busy programs are
    at most min(pairs, experts) blocks x inter / block_n column tiles; split K (a power of two,
    at most MAX_SPLIT_K, each split MIN_SPLIT_STEPS BLOCK_K steps or more) until they reach
    PROGRAMS_PER_SM x SMs. A decode token at Kimi K2 TP8 (8 pairs, 4 tiles): 32 programs -> 8
    splits (H200: the routed-experts call 71.8 -> 39.4 us). extra_blocks: the shared experts'
    blocks (always busy)."""
    busy = (max(1, min(pairs, num_local)) + extra_blocks) * triton.cdiv(inter, block_n)
    s = 1
    while (s < MAX_SPLIT_K and busy * s < PROGRAMS_PER_SM * num_sms
           and hid >= 2 * s * MIN_SPLIT_STEPS * block_k):
        s *= 2
    return s


def shared_chunks(shared, inter: int) -> int:
    """How many routed-sized experts the shared MLP (gate [Si, hidden], up, down [hidden, Si])
    splits into, or 0 when it cannot join the grouped call (Si not a multiple of inter). A
    SwiGLU MLP is a sum over its intermediate columns, so Si = c * inter is c experts of
    weight 1."""
    sg, su, sd = shared
    si = sg.shape[0]
    if si == 0 or si % inter or su.shape != sg.shape or sd.shape != (sg.shape[1], si):
        return 0
    return si // inter


def _count_stats(topk_ids, stats) -> None:
    """`kernels.expert_counts` with impl=None, for a call whose routing launch did not count."""
    from treeflash.kernels import reference
    from treeflash.kernels.moe_router import COUNT_MAX_IDS, expert_counts_triton

    if topk_ids.is_cuda and topk_ids.numel() <= COUNT_MAX_IDS:
        expert_counts_triton(topk_ids, *stats)
    else:
        reference.expert_counts(topk_ids, *stats)


def _k_chunks(split_k: int, hid: int, bk: int) -> tuple[int, int]:
    """(splits, K a split, a multiple of bk) for a wanted split count: none empty."""
    split_k = max(1, min(int(split_k), triton.cdiv(hid, bk)))
    k_chunk = triton.cdiv(triton.cdiv(hid, split_k), bk) * bk
    return triton.cdiv(hid, k_chunk), k_chunk


def _check_call(x, topk_weights, topk_ids, w_gate, w_up, w_down, shared) -> int:
    """The shapes, strides and dtypes `moe_experts_triton` takes; the shared experts' chunks of
    the routed intermediate size (0 without them)."""
    t, hid = x.shape
    e, inter, hid_w = w_gate.shape
    assert hid_w == hid and w_up.shape == w_gate.shape and w_down.shape == (e, hid, inter)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == t
    for w in (x, w_gate, w_up, w_down):
        assert w.stride(-1) == 1 and w.dtype == x.dtype, (w.dtype, w.stride())
    assert w_gate.stride() == w_up.stride()
    if shared is None:
        return 0
    s_ch = shared_chunks(shared, inter)
    if not s_ch:
        raise ValueError(f"shared experts of {shared[0].shape[0]} columns do not split into "
                         f"experts of {inter}")
    for w in shared:
        assert w.stride(-1) == 1 and w.dtype == x.dtype, (w.dtype, w.stride())
    assert shared[0].stride() == shared[1].stride()
    return s_ch


def moe_experts_triton(x, topk_weights, topk_ids, w_gate, w_up, w_down, expert_offset=0,
                       num_experts=None, split_k=None, shared=None, stats=None, tiles=None):
    """Triton twin of `treeflash.kernels.reference.moe_experts` (same contract).

    x [T, hidden] (fp32/bf16/fp16, last dim contiguous); topk_weights [T, K] float;
    topk_ids [T, K] int (global expert ids); w_gate, w_up [E, inter, hidden] and w_down
    [E, hidden, inter] (this rank's experts expert_offset .. +E, last dim contiguous,
    dtype of x); num_experts = the router's width (None: E, every expert is local).
    Returns out [T, hidden] (x.dtype). Scratch: H [A, inter] (x.dtype, sorted order) and
    Y [A, hidden] fp32 (pair order), A = T * K. Weight tiles are loaded transposed
    ([BLOCK_K, BLOCK_N] of W[e] [N, K]), so no weight copy is ever made.
    shared: the shared experts' (gate [Si, hidden], up [Si, hidden], down [hidden, Si]), added
    to every token in the same two launches (`shared_chunks` blocks of inter columns each,
    weight 1; their rows are summed with the routed ones in fp32, one cast at the end).
    tiles: (gate_up BLOCK_N, BLOCK_K, down BLOCK_N, BLOCK_K, num_stages[, gate_up warps, down
    warps]), by default GPU_TILES (GPU_TILES_FP32 for float32, 32s in the interpreter), 4 warps
    each (`RuntimeOptions.moe_tiles` sets them for a tuning run).
    Grid (cdiv(A, 16) + min(E, A) [+ cdiv(T, 16) x chunks], cdiv(inter or hidden, BLOCK_N)) per launch, x split_k for
    gate_up (None: `plan_split_k` on CUDA, 1 in the
    interpreter; above 1 the scratch H is fp32 partials [split_k, A, 2 inter]).
    """
    s_ch = _check_call(x, topk_weights, topk_ids, w_gate, w_up, w_down, shared)
    t, hid = x.shape
    e, inter, _ = w_gate.shape
    k = topk_ids.shape[1]
    a = t * k
    out_dtype = x.dtype
    sg, su, sd = shared if s_ch else (w_gate,) * 3  # (unused pointers and strides without them)
    if a == 0:
        if stats is not None:
            _count_stats(topk_ids, stats)
        return torch.zeros_like(x)
    order, blk_e, blk_r0, blk_r1, _, counted = route_blocks(topk_ids, e, expert_offset, stats=stats)
    if stats is not None and not counted:
        _count_stats(topk_ids, stats)
    weight = topk_weights.reshape(-1).float().contiguous()
    # Pairs of experts this rank does not own are never written: zero them (EP only).
    owned_all = expert_offset == 0 and (num_experts is None or num_experts == e)
    ks = k + s_ch  # Y rows a token
    y = (torch.empty if owned_all else torch.zeros)(t * ks, hid, device=x.device, dtype=torch.float32)
    nb = blk_e.shape[0]
    sh_blocks = triton.cdiv(t, BLOCK_M) * s_ch
    interp = _interpreting()
    prec = "ieee" if x.dtype == torch.float32 or interp else "tf32"
    tiles = tuple(tiles or default_tiles(x.dtype, interp))
    bn, bk, d_bn, d_bk, stages = tiles[:5]
    gu_warps, d_warps = tiles[5:7] if len(tiles) >= 7 else (4, 4)
    if split_k is None:
        split_k = 1 if interp or not x.is_cuda else plan_split_k(
            a, e, inter, hid, bn, bk, _num_sms(x.device.index or 0), sh_blocks)
    split_k, k_chunk = _k_chunks(split_k, hid, bk)
    h = torch.empty(a + t * s_ch, inter, device=x.device, dtype=x.dtype)
    grid_m, n_tiles = nb + sh_blocks, triton.cdiv(inter, bn)
    if split_k > 1:
        part = torch.empty(split_k, a + t * s_ch, 2 * inter, device=x.device, dtype=torch.float32)
        cnt = _tile_counters(x.device, grid_m * n_tiles)
    else:
        part, cnt = h, blk_e  # unused
    _gate_up_kernel[(grid_m, n_tiles, split_k)](
        x, w_gate, w_up, h, order, blk_e, blk_r0, blk_r1, hid, inter, k,
        x.stride(0), w_gate.stride(0), w_gate.stride(1), h.stride(0), part, cnt, k_chunk,
        part.stride(0) if split_k > 1 else 0, part.stride(1) if split_k > 1 else 0,
        sg, su, nb, t, a, max(s_ch, 1), inter * sg.stride(0), sg.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec, DOT_F32=interp, SPLIT_K=split_k,
        num_stages=stages, num_warps=gu_warps,
    )
    # the shared down weight [hidden, Si]: chunk c is columns c * inter .., row stride Si
    _down_kernel[(grid_m, triton.cdiv(hid, d_bn))](
        h, w_down, y, order, weight, blk_e, blk_r0, blk_r1, hid, inter,
        h.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0),
        sd, nb, t, a, k, s_ch, inter, sd.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=d_bn, BLOCK_K=d_bk, DOT_PREC=prec, DOT_F32=interp, num_stages=stages,
        num_warps=d_warps,
    )
    return _sum_rows(y, t, ks, out_dtype, interp)


def _sum_rows(y: torch.Tensor, t: int, ks: int, out_dtype: torch.dtype, interp: bool) -> torch.Tensor:
    """out [T, hidden] = the sum of each token's ks rows of y [T * ks, hidden] fp32, cast once: one
    launch (torch's sum over the middle dim of [1, 9, 7168] and its cast took 4.1 + 1.6 us on the
    H200, profile-preset-off-step.txt)."""
    hid = y.shape[1]
    out = torch.empty(t, hid, device=y.device, dtype=out_dtype)
    block = 128 if interp else 1024
    _sum_rows_kernel[(t, triton.cdiv(hid, block))](
        y, out, hid, y.stride(0), out.stride(0), KS=ks, KS_PAD=max(2, triton.next_power_of_2(ks)),
        BLOCK=block, num_warps=4)
    return out
