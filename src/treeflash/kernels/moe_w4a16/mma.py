"""The W4A16 grouped MoE on tensor cores with the weights' MMA operand built in registers: Gluon
(Triton's explicit-layout dialect), mma.sync (sm_80+), bf16 / fp16 activations, the checkpoint's
own layout (`kernels/int4.py`: no repack).

Why: Triton's `tl.dot` takes the unpacked weight tile through shared memory to reach the tensor
core's operand layout (STS + LDSM, a barrier a K step; `benchmarks/notes/moe-w4a16.md`). Here
each thread loads exactly the words its mma.sync A fragments need and unpacks them in place: the
operand's layout is the load's layout (`convert_layout(..., assert_trivial=True)`: the compile
fails otherwise), so no shared memory, no barrier, and the next step's words are loaded (into
registers) while this step computes.

Launches: gate_up (H = silu(gate) * up, split K with an arrival counter), down (Y rows, and
the last of a token's contributions to arrive sums its rows in fixed order into out: no extra
launch, deterministic), and before them the routing (`moe_gemm.route_blocks`) unless every
expert has at most BM pairs (T <= BM): then each pair slot is a block candidate, the first slot
of an expert gathers the tokens that picked it (SLOTS mode), and the call is two launches.

The operands themselves (register layouts, the word unpack, the K loops, the rows' addressing)
and their layout: `mma_operands.py`. This file: the blocks, the two kernels and the launches.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from treeflash.kernels import gluon_interp
from treeflash.kernels.device import num_sms as _num_sms
from treeflash.kernels.device import tile_counters as _tile_counters
from treeflash.kernels.int4 import PACK, Int4Weight
from treeflash.kernels.moe_gemm import route_blocks
from treeflash.kernels.moe_w4a16 import dispatch
from treeflash.kernels.moe_w4a16.dispatch import MmaTiles
from treeflash.kernels.moe_w4a16.mma_operands import (
    UNPACK8_PTX,
    _flat,
    _grid2,
    _mma,
    _round,
    _w4_acc,
    _w16_acc,
)

gl, jit, mma_v2, constexpr_function = gluon_interp.language()


# ---------------------------------------------------------------- blocks
@jit
def _routed_block(IDS, ORDER, BLK_E, BLK_R0, BLK_R1, blk, T, E, OFFSET, TOPK: tl.constexpr, KP: tl.constexpr,
                  A_PAD: tl.constexpr, BM: tl.constexpr, SLOTS: tl.constexpr, W: tl.constexpr):
    """Routed block blk: (local expert, < 0 if the block has no work; each column's pair index
    [BM] int64; which columns hold a pair). SLOTS: blk is a pair slot and a block iff it is the
    first slot of its expert; its columns are the tokens 0 .. BM - 1 (T <= BM, so an expert has
    at most BM pairs), each holding the pair of that token with this expert if there is one.
    Else: the routing's block (`moe_gemm.route_blocks`: rows r0 .. r1 of the sorted pairs)."""
    L2: gl.constexpr = _grid2(W)
    m = gl.arange(0, BM, layout=gl.SliceLayout(1, L2))
    if SLOTS:
        eg = gl.load(IDS + blk)
        a = gl.arange(0, A_PAD, layout=_flat(W))
        before = gl.load(IDS + a, mask=a < blk, other=-1)
        first = gl.sum((before == eg).to(gl.int32), 0) == 0
        e = (eg - OFFSET).to(gl.int32)
        e = gl.where(first & (e >= 0) & (e < E), e, -1)
        j = gl.arange(0, KP, layout=gl.SliceLayout(0, L2))
        tok_ids = gl.load(IDS + gl.expand_dims(m, 1) * TOPK + gl.expand_dims(j, 0),
                          mask=gl.expand_dims(m < T, 1) & gl.expand_dims(j < TOPK, 0), other=-1)
        hit = tok_ids == eg
        ok = (gl.max(hit.to(gl.int32), 1) > 0) & (m * 0 + e >= 0)  # (a 0-d operand of & upsets the interpreter)
        pair = m.to(gl.int64) * TOPK + gl.sum(gl.where(hit, gl.expand_dims(j, 0), 0), 1).to(gl.int64)
    else:
        e = gl.load(BLK_E + blk)
        rows = gl.load(BLK_R0 + blk) + m
        ok = (rows < gl.load(BLK_R1 + blk)) & (m * 0 + e >= 0)
        pair = gl.load(ORDER + rows, mask=ok, other=0).to(gl.int64)
    return e, pair, ok


@jit
def _shared_block(sb, T, S_CH, BM: tl.constexpr, W: tl.constexpr):
    """Shared block sb: (its chunk c of the shared experts, its tokens [BM] int64, which exist)."""
    t = (sb // S_CH) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, _grid2(W)))
    return sb % S_CH, t.to(gl.int64), t < T


# ---------------------------------------------------------------- gate_up
@jit
def _silu_mul(g, u):
    return g / (1.0 + gl.exp(-g)) * u


@jit
def _gate_up_out(acc, hrow, ok, n0, INTER, HOUT, s_ht, PART, s_ps, s_pr, cnt, sp, nsplit, BN: tl.constexpr,
                 BM: tl.constexpr, W: tl.constexpr, EMULATE: tl.constexpr):
    """acc [2 BN, BM] = gate and up (`_row_of`'s PAIRED rows) of H rows hrow [BM] (columns ok), H's
    columns n0 ..: H =
    silu(gate) * up in H's dtype; with nsplit > 1 this split's float32 partials go to PART
    [nsplit, H rows, 2 INTER] (up at column INTER ..), the program counts itself in on cnt and
    the last to arrive sums the partials in split order, stores H and resets the counter."""
    EPI: gl.constexpr = _mma(W)
    g, u = gl.split(gl.permute(gl.reshape(acc, (BN // 8, 2, 8, BM)), (0, 2, 3, 1)))
    g = gl.convert_layout(gl.reshape(g, (BN, BM)), EPI)
    u = gl.convert_layout(gl.reshape(u, (BN, BM)), EPI)
    n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, EPI))
    hr = gl.expand_dims(gl.convert_layout(hrow, gl.SliceLayout(0, EPI)), 0)
    ok2 = gl.expand_dims(n < INTER, 1) & gl.expand_dims(gl.convert_layout(ok, gl.SliceLayout(0, EPI)), 0)
    out = HOUT + hr * s_ht + gl.expand_dims(n, 1)
    if nsplit > 1:
        part = PART + hr * s_pr + gl.expand_dims(n, 1)
        gl.store(part + sp * s_ps, g, mask=ok2)
        gl.store(part + sp * s_ps + INTER, u, mask=ok2)
        gl.thread_barrier()  # every thread's partial stored before the release below
        if gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == nsplit - 1:
            # float32 whatever PART is: without a split the caller passes H, and this branch (a
            # runtime nsplit) still compiles (gl.exp of bf16 failed on the H100, 2026-12-07)
            g = gl.load(part, mask=ok2, other=0.0, cache_modifier=".cg").to(gl.float32)
            u = gl.load(part + INTER, mask=ok2, other=0.0, cache_modifier=".cg").to(gl.float32)
            for s in range(1, nsplit):
                g += gl.load(part + s * s_ps, mask=ok2, other=0.0, cache_modifier=".cg")
                u += gl.load(part + s * s_ps + INTER, mask=ok2, other=0.0, cache_modifier=".cg")
            gl.store(out, _round(_silu_mul(g, u), HOUT.dtype.element_ty, EMULATE), mask=ok2)
            gl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call
    else:
        gl.store(out, _round(_silu_mul(g, u), HOUT.dtype.element_ty, EMULATE), mask=ok2)


@jit
def _gate_up_kernel(X, WG, WU, SG, SU, WSG, WSU, HOUT, IDS, ORDER, BLK_E, BLK_R0, BLK_R1, PART, CNT,
                    T, E, OFFSET, NSH, INTER, HW, S_CH, KW_R, SPLIT_R, KW_S, SPLIT_S,
                    s_xt, s_we, s_wn, s_se, s_sn, s_swn, s_ht, s_ps, s_pr, MAGIC,
                    TOPK: tl.constexpr, KP: tl.constexpr, A_PAD: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                    NJ: tl.constexpr, GW: tl.constexpr, W: tl.constexpr, DEPTH: tl.constexpr, SLOTS: tl.constexpr,
                    EVEN_R: tl.constexpr, EVEN_S: tl.constexpr, ASM: tl.constexpr, EMULATE: tl.constexpr):
    """H [T TOPK + T S_CH, INTER] = silu(x Wg^T) * (x Wu^T) in x's dtype, H row = the pair index
    (t TOPK + j) for routed pairs, T TOPK + t S_CH + c for chunk c of the shared experts. Grid
    (programs, INTER / BN): first the shared blocks' NSH x SPLIT_S (16-bit WSG / WSU, splits of
    KW_S words of 8 values), then the routed blocks' x SPLIT_R (INT4, splits of KW_R words)."""
    pid = gl.program_id(0)
    pid_n = gl.program_id(1)
    n0 = pid_n * BN
    acc = gl.zeros([2 * BN, BM], gl.float32, _mma(W))
    if pid < NSH * SPLIT_S:
        sb = pid // SPLIT_S
        sp = pid % SPLIT_S
        c, tok, ok = _shared_block(sb, T, S_CH, BM, W)
        hrow = T * TOPK + tok * S_CH + c
        bid = sb
        nsplit = SPLIT_S
        kw_lo = sp * KW_S
        chunk = c.to(gl.int64) * INTER * s_swn
        acc = _w16_acc(acc, X, gl.where(ok, tok, 0), s_xt, WSG + chunk, WSU + chunk, n0, INTER, s_swn, kw_lo,
                       gl.minimum(kw_lo + KW_S, HW), True, 2 * BN, BM, NJ, W, EVEN_S, ASM)
    else:
        q = pid - NSH * SPLIT_S
        blk = q // SPLIT_R
        sp = q % SPLIT_R
        e, pair, ok = _routed_block(IDS, ORDER, BLK_E, BLK_R0, BLK_R1, blk, T, E, OFFSET, TOPK, KP, A_PAD, BM, SLOTS, W)
        if e < 0:
            return
        hrow = pair
        bid = NSH + blk
        nsplit = SPLIT_R
        kw_lo = sp * KW_R
        e64 = e.to(gl.int64)
        acc = _w4_acc(acc, X, gl.where(ok, pair // TOPK, 0), s_xt, WG + e64 * s_we, WU + e64 * s_we, SG + e64 * s_se,
                      SU + e64 * s_se, n0, INTER, s_wn, s_sn, kw_lo, gl.minimum(kw_lo + KW_R, HW), MAGIC, True, 2 * BN,
                      BM, NJ, GW, W, DEPTH, EVEN_R, ASM, EMULATE)
    _gate_up_out(acc, hrow, ok, n0, INTER, HOUT, s_ht, PART, s_ps, s_pr, CNT + bid * gl.num_programs(1) + pid_n, sp,
                 nsplit, BN, BM, W, EMULATE)


# ---------------------------------------------------------------- down and the top-k sum
@jit
def _down_sum(Y, OUT, IDS, CNT, tok, ok, n0, HID, T, E, OFFSET, S_CH, s_yt, s_ot, TOPK: tl.constexpr, KP: tl.constexpr,
              BN: tl.constexpr, BM: tl.constexpr, W: tl.constexpr, EMULATE: tl.constexpr):
    """Count this program's columns (tokens tok [BM], ok) in on their (token, column tile)
    counters; for each token whose contributions are now all stored (its owned pairs + S_CH),
    sum its Y rows in fixed order (pairs j = 0 .. TOPK - 1, then the shared chunks), store out
    [t, n0 .. n0 + BN) in OUT's dtype and reset the counter."""
    L2: gl.constexpr = _grid2(W)
    L_M: gl.constexpr = gl.SliceLayout(1, L2)
    gl.thread_barrier()  # every thread's Y rows stored before the release below
    t = gl.convert_layout(tok, L_M)
    live = gl.convert_layout(ok, L_M)
    cnt = CNT + t * gl.num_programs(1) + gl.program_id(1)
    before = gl.atomic_add(cnt, gl.full([BM], 1, gl.int32, L_M), mask=live, sem="acq_rel", scope="gpu")
    j = gl.arange(0, KP, layout=gl.SliceLayout(0, L2))
    ids = gl.load(IDS + gl.expand_dims(t, 1) * TOPK + gl.expand_dims(j, 0),
                  mask=gl.expand_dims(live, 1) & gl.expand_dims(j < TOPK, 0), other=-1)
    owned = (ids - OFFSET >= 0) & (ids - OFFSET < E)
    last = live & (before == gl.sum(owned.to(gl.int32), 1) + S_CH - 1)
    if gl.max(last.to(gl.int32), 0) > 0:
        n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, L2))
        rows = Y + gl.expand_dims(t * (TOPK + S_CH), 1) * s_yt + gl.expand_dims(n, 0)
        ok2 = gl.expand_dims(last, 1) & gl.expand_dims(n < HID, 0)
        total = gl.zeros([BM, BN], gl.float32, L2)
        for r in gl.static_range(TOPK):
            own_r = gl.sum(gl.where(gl.expand_dims(j == r, 0) & owned, 1, 0), 1) > 0
            total += gl.load(rows + r * s_yt, mask=ok2 & gl.expand_dims(own_r, 1), other=0.0, cache_modifier=".cg")
        for c in range(S_CH):
            total += gl.load(rows + (TOPK + c) * s_yt, mask=ok2, other=0.0, cache_modifier=".cg")
        out = OUT + gl.expand_dims(t, 1) * s_ot + gl.expand_dims(n, 0)
        gl.store(out, _round(total, OUT.dtype.element_ty, EMULATE), mask=ok2)
        gl.atomic_xchg(cnt, gl.full([BM], 0, gl.int32, L_M), mask=last, sem="relaxed", scope="gpu")


@jit
def _down_kernel(HIN, WD, SD, WSD, Y, OUT, IDS, WEIGHT, ORDER, BLK_E, BLK_R0, BLK_R1, CNT,
                 T, E, OFFSET, NSH, HID, IW, INTER, S_CH, s_ht, s_we, s_wn, s_se, s_sn, s_swn, s_yt, s_ot, MAGIC,
                 TOPK: tl.constexpr, KP: tl.constexpr, A_PAD: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                 NJ: tl.constexpr, GW: tl.constexpr, W: tl.constexpr, DEPTH: tl.constexpr, SLOTS: tl.constexpr,
                 EVEN: tl.constexpr, ASM: tl.constexpr, EMULATE: tl.constexpr):
    """Y [T (TOPK + S_CH), HID] float32: row t (TOPK + S_CH) + j = weight x (H[pair] @ Wd[e]^T)
    for pair t TOPK + j (INT4, IW = INTER / 8 words), row t (TOPK + S_CH) + TOPK + c = H[shared
    row] @ WSD[:, c INTER ..]^T (16-bit, row stride s_swn); then out (`_down_sum`). Grid
    (NSH shared blocks + routed blocks, HID / BN)."""
    pid = gl.program_id(0)
    n0 = gl.program_id(1) * BN
    EPI: gl.constexpr = _mma(W)
    acc = gl.zeros([BN, BM], gl.float32, EPI)
    if pid < NSH:
        c, tok, ok = _shared_block(pid, T, S_CH, BM, W)
        hrow = gl.where(ok, T * TOPK + tok * S_CH + c, 0)
        acc = _w16_acc(acc, HIN, hrow, s_ht, WSD + c.to(gl.int64) * INTER, WSD, n0, HID, s_swn, 0, IW, False, BN, BM,
                       NJ, W, EVEN, ASM)
        scale = gl.where(ok, 1.0, 0.0)
        yrow = tok * (TOPK + S_CH) + TOPK + c
    else:
        e, pair, ok = _routed_block(IDS, ORDER, BLK_E, BLK_R0, BLK_R1, pid - NSH, T, E, OFFSET, TOPK, KP, A_PAD, BM,
                                    SLOTS, W)
        if e < 0:
            return
        e64 = e.to(gl.int64)
        acc = _w4_acc(acc, HIN, gl.where(ok, pair, 0), s_ht, WD + e64 * s_we, WD, SD + e64 * s_se, SD, n0, HID, s_wn,
                      s_sn, 0, IW, MAGIC, False, BN, BM, NJ, GW, W, DEPTH, EVEN, ASM, EMULATE)
        scale = gl.load(WEIGHT + pair, mask=ok, other=0.0)
        tok = pair // TOPK
        yrow = tok * (TOPK + S_CH) + pair % TOPK
    n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, EPI))
    col: gl.constexpr = gl.SliceLayout(0, EPI)
    y = Y + gl.expand_dims(gl.convert_layout(yrow, col), 0) * s_yt + gl.expand_dims(n, 1)
    ok2 = gl.expand_dims(n < HID, 1) & gl.expand_dims(gl.convert_layout(ok, col), 0)
    gl.store(y, acc * gl.expand_dims(gl.convert_layout(scale, col), 0), mask=ok2)
    _down_sum(Y, OUT, IDS, CNT, tok, ok, n0, HID, T, E, OFFSET, S_CH, s_yt, s_ot, TOPK, KP, BN, BM, W, EMULATE)


# ---------------------------------------------------------------- host
INTERPRETER_TILES = MmaTiles(8, 16, 16, 1, 1, 2)
PROGRAMS_PER_SM = 4  # gate_up's split aims at this many programs an SM (4 warps each: 16 warps an SM)
WIDE16 = 4  # a 16-bit word of 8 values is ~4x an INT4 word's bytes (with its scales): shared splits x this


@dataclasses.dataclass(frozen=True)
class MmaPlan:
    """A call's launch plan (host-known shapes only: graph-capturable)."""

    tiles: MmaTiles
    slots: bool  # no routing launch: T <= block_m (`_routed_block`)
    split_r: int  # gate_up's K splits of a routed block and their words
    kw_r: int
    split_s: int  # ... of a shared block (16-bit words of 8 values)
    kw_s: int


def supported(x: torch.Tensor, w_gate: Int4Weight, w_down: Int4Weight, shared) -> str | None:
    """None if the MMA kernels take this call, else why not (the dispatch falls back)."""
    if x.dtype not in UNPACK8_PTX:
        return f"x is {x.dtype} (bf16 / fp16 only)"
    if x.device.type != "cuda" and not gluon_interp.interpreting():
        return "not a CUDA tensor"
    for w in (w_gate, w_down):
        g = w.group_size // PACK
        if g & (g - 1) or w.scale.dtype != x.dtype:
            return f"group {w.group_size} / scale {w.scale.dtype} (a power of two x 8, scales in x's dtype)"
    if x.stride(0) % 2 or x.data_ptr() % 4 or x.shape[1] % PACK or w_gate.shape[1] % PACK:
        return "x rows not 4-byte aligned or sizes not multiples of 8"
    if shared is not None and any(s.stride(0) % 2 or s.data_ptr() % 4 for s in shared):
        return "shared expert rows not 4-byte aligned"
    return None


def plan(tokens: int, top_k: int, experts: int, inter: int, hid: int, shared_chunks: int, device: torch.device,
         tiles: MmaTiles | None = None, split: int | None = None) -> MmaPlan:
    """Tiles (given, or INTERPRETER_TILES in the interpreter, else `default_tiles`) and gate_up's
    splits: the routed blocks' count (given, or the smallest that makes PROGRAMS_PER_SM x SMs
    programs), the shared blocks' WIDE16 x that (their words are 4x the bytes); each split at
    least one trip (2 steps)."""
    interp = gluon_interp.interpreting()
    if tiles is None and split is None and not interp:
        split = dispatch.mma_split(tokens)
    tiles = tiles or (INTERPRETER_TILES if interp else dispatch.mma_tiles(tokens, top_k, experts))
    hw, trip = hid // PACK, 8 * tiles.nj
    n_tiles = triton.cdiv(inter, tiles.gu_n)
    pairs = tokens * top_k
    blocks = max(1, min(pairs, experts), triton.cdiv(pairs, tiles.block_m))
    sh_blocks = triton.cdiv(tokens, tiles.block_m) * shared_chunks
    if split is None:
        target = 1 if interp or device.type != "cuda" else PROGRAMS_PER_SM * _num_sms(device.index or 0)
        split = 1
        while (blocks * split + sh_blocks * WIDE16 * split) * n_tiles < target and hw >= 2 * split * trip:
            split *= 2
    kw_r = triton.cdiv(triton.cdiv(hw, max(1, split)), trip) * trip
    kw_s = triton.cdiv(triton.cdiv(hw, max(1, split * WIDE16)), trip) * trip
    return MmaPlan(tiles, tokens <= tiles.block_m, triton.cdiv(hw, kw_r), kw_r, triton.cdiv(hw, kw_s), kw_s)


def moe_experts_mma(x, topk_weights, topk_ids, w_gate, w_up, w_down, expert_offset=0, num_experts=None,
                    shared=None, stats=None, shared_chunks=0, call_plan: MmaPlan | None = None):
    """`moe_w4a16.moe_experts_w4a16` on the MMA kernels (checked by its caller; `supported`)."""
    t, hid = x.shape
    e, inter, _ = w_gate.shape
    k = topk_ids.shape[1]
    a = t * k
    p = call_plan or plan(t, k, e, inter, hid, shared_chunks, x.device)
    tl_, bm = p.tiles, p.tiles.block_m
    if p.slots:
        order = blk_e = blk_r0 = blk_r1 = topk_ids  # unused
        n_blk = a
        if stats is not None:
            _count_stats(topk_ids, stats)
    else:
        order, blk_e, blk_r0, blk_r1, _, counted = route_blocks(topk_ids, e, expert_offset, bm, stats=stats)
        n_blk = blk_e.shape[0]
        if stats is not None and not counted:
            _count_stats(topk_ids, stats)
    s_ch = shared_chunks
    n_sh = triton.cdiv(t, bm) * s_ch
    sg, su, sd = shared if s_ch else (x, x, x)  # unused pointers without shared experts
    gu_tiles, dn_tiles = triton.cdiv(inter, tl_.gu_n), triton.cdiv(hid, tl_.down_n)
    cnt = _tile_counters(x.device, (n_sh + n_blk) * gu_tiles + t * dn_tiles)
    h = torch.empty(a + t * s_ch, inter, device=x.device, dtype=x.dtype)
    n_split = max(p.split_r, p.split_s)
    part = torch.empty(n_split, h.shape[0], 2 * inter, device=x.device, dtype=torch.float32) if n_split > 1 else h
    interp = gluon_interp.interpreting()
    meta = dict(TOPK=k, KP=triton.next_power_of_2(k), A_PAD=triton.next_power_of_2(bm * k), BM=bm, NJ=tl_.nj,
                W=tl_.warps, DEPTH=tl_.depth, SLOTS=p.slots, ASM=not interp, EMULATE=interp, num_warps=tl_.warps)
    magic = UNPACK8_PTX[x.dtype][1]
    hw, iw, trip = hid // PACK, inter // PACK, 8 * tl_.nj
    pg, ps = w_gate.packed, w_gate.scale
    _gate_up_kernel[(n_sh * p.split_s + n_blk * p.split_r, gu_tiles)](
        x, pg, w_up.packed, ps, w_up.scale, sg, su, h, topk_ids, order, blk_e, blk_r0, blk_r1, part, cnt,
        t, e, expert_offset, n_sh, inter, hw, max(s_ch, 1), p.kw_r, p.split_r, p.kw_s, p.split_s,
        x.stride(0), pg.stride(0), pg.stride(1), ps.stride(0), ps.stride(1), sg.stride(0), h.stride(0),
        part.stride(0) if n_split > 1 else 0, part.stride(1) if n_split > 1 else 0, magic,
        BN=tl_.gu_n, GW=w_gate.group_size // PACK, EVEN_R=hw % trip == 0, EVEN_S=hw % trip == 0, **meta)
    y = torch.empty(t * (k + s_ch), hid, device=x.device, dtype=torch.float32)
    owned_all = expert_offset == 0 and (num_experts is None or num_experts == e)
    out = (torch.empty if owned_all or s_ch else torch.zeros)(t, hid, device=x.device, dtype=x.dtype)
    pd, sdn = w_down.packed, w_down.scale
    weight = topk_weights.reshape(-1).float().contiguous()
    _down_kernel[(n_sh + n_blk, dn_tiles)](
        h, pd, sdn, sd, y, out, topk_ids, weight, order, blk_e, blk_r0, blk_r1, cnt[(n_sh + n_blk) * gu_tiles:],
        t, e, expert_offset, n_sh, hid, iw, inter, s_ch, h.stride(0), pd.stride(0), pd.stride(1), sdn.stride(0),
        sdn.stride(1), sd.stride(0), y.stride(0), out.stride(0), magic,
        BN=tl_.down_n, GW=w_down.group_size // PACK, EVEN=iw % trip == 0, **meta)
    return out


def _count_stats(topk_ids, stats) -> None:
    from treeflash.kernels.moe_gemm import _count_stats as count

    count(topk_ids, stats)
