"""The Hopper MLA verify kernel: Gluon (Triton 3.6's explicit-layout dialect) with warp
specialisation, for sm_90. The same partials, split plan and combine as the portable kernels
(`plan.py`, `combine.py`); the dispatch table (`__init__.py`) runs it wherever it applies.

Why: in one Triton `tl` program both warpgroups wait for QK, then do the softmax, then PV, with
nothing overlapping (the portable tree kernel reached 0.39-0.51 of the floor on the H200).
Triton's `tl` cannot give two warpgroups different work; Gluon's `gl.warp_specialize` can
(FlashMLA's sm_90 layout, simplified):

- one CTA = one 64-row M tile x one split, 9 warps in three partitions:
  * WG0 (the default partition, 4 warps): S = Q K^T of a whole 64-key tile as 9 async
    wgmma 64x64x64 (Q and K from shared memory, N = 64: no Q re-read per 32 keys), the
    online softmax (row max and sum inside the warpgroup: quad shuffles, no CTA barrier),
    P (bf16) and alpha to shared memory for WG1, and PV for value columns 0..255 from P in
    registers (wgmma 64x256), issued right after the tile's P and waited in the same tile;
  * WG1 (worker, 4 warps): rescales its half of O by the alpha WG0 hands over and runs PV
    for value columns 256..511 from the shared P, beside WG0's next QK;
  * the loader (worker, 1 warp; Triton pads the CTA to 12 warps): Q by TMA beside the first
    tile (when q is one [B x N x H, D] row block; else the default partition loads Q before
    the partitions start), then each tile's page id and 9 TMA copies of 64 x 64 into a
    2-stage ring (2 x 72 KB).
- each ring slot is three parts with their own full / empty mbarriers: the rope chunk (freed
  by WG0 once QK is done), value columns 256..511 (freed by WG1 after PV_hi), value columns
  0..255 (freed by WG0 after PV_lo). QK reads them in that order (the order they free, hence
  land), so no part waits for the next tile to land before it is freed and the next tile's
  loads overlap this one's (c5e6117; `h200-20261203-kernel-v5b`).
- each half of O is 64 x 256 fp32 = 128 registers a thread in its own warpgroup (setmaxnreg:
  WG0 256, WG1 232, loader 24). No CTA-wide barrier in the loop: the warpgroups meet only
  through mbarriers (kv full/empty per part, P full/empty).
- Shared memory: Q 72 KB + ring 144 KB + P 8 KB + alpha 256 B + barriers, within the 232448
  bytes a block may have.
- each warpgroup's [64, 256] output / partial half leaves through shared memory it no longer
  needs (WG0: slot 0's columns 0..255; WG1: Q's chunks 0..3) as 16-byte stores of whole
  512-byte row halves (`_store_staged`).

Variants measured on the H200 without a gain worth a default were removed (git keeps them:
4efd675 for the first barrier layout, the lazy rescale, PDL, the fused combine, L2 prefetch,
stream-K, the seesaw; a67af9e for the polynomial exp2; the output stored from the wgmma layout,
the clock-stamp (TRACE) and CTA-edge (EDGES) builds at 5144cea); `benchmarks/DESIGN_NOTES.md`
section 1 has their figures.

Tiles, masks: a split's keys lo .. t_hi are cut into 64-key tiles from lo; the full prefix
tiles come first, then the masked ones (the prefix's last partial tile and the tree part),
all 64-aligned, so every tile is one page-contiguous run (page_size % 64 == 0) and comes by
TMA the same way. For a masked tile WG0 zeroes the value columns of rows past t_hi in shared
memory (unused slots may hold NaN, and 0 x NaN = NaN in PV) and masks S with -inf where a key
is not visible (position >= t_hi, or a tree node that is not an ancestor: tree_mask[b, n, j],
causal j <= n), as the portable tree kernel's `_attend_masked_halves`.

Supported (`supported`): CUDA sm_90 with Gluon importable and the interpreter off, bf16/fp16
q and cache of the same dtype, D = 576 and v_dim = 512, page_size % 64 == 0, the [pages x
page_size, D] row view TMA-addressable (16-byte aligned base and row stride), sm_scale > 0.
"""

from __future__ import annotations

import torch
import triton

from treeflash.kernels.mla_verify.plan import Call, interpreting

try:  # Gluon ships with Triton >= 3.5; the API used here is Triton 3.6's
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except Exception:  # noqa: BLE001 - no Gluon (CPU CI, old Triton): never picked
    gluon = None

BLOCK_M = 64  # query rows per CTA (one wgmma M)
BLOCK_N = 64  # keys per tile (one TMA box height; wgmma N of QK)
D_CHUNK = 64  # columns per TMA box / per QK wgmma K step (128-byte swizzle)
NUM_D = 9  # 576 = 9 x 64: QK chunks (8 value + 1 rope)
V_HALF = 256  # value columns per consumer warpgroup
NUM_BUF = 2  # tile ring depth
NUM_WARPS = 4  # the default partition (WG0); + 4 (WG1) + 1 (loader)
# each ring slot is three parts with their own full / empty barriers, in the order
# the loader fills them and QK reads them: the rope chunk (freed when QK is done), value
# columns 256..511 (freed by WG1 after PV_hi), value columns 0..255 (freed by WG0 after PV_lo);
# a slot's barriers sit at slot * PARTS + part (the 4th is unused: shared shapes are powers of 2)
PARTS = 4


def available(device: torch.device) -> bool:
    """Whether this kernel can run on `device`: a CUDA sm_90 GPU with Gluon, the interpreter off."""
    return (gluon is not None and not interpreting() and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0))


def supported(q: torch.Tensor, kv_cache: torch.Tensor, v_dim: int, sm_scale: float) -> bool:
    """Whether this kernel can run this call (module docstring); else the caller runs the
    dispatch table without it."""
    if not available(q.device) or not sm_scale > 0:  # the row max is taken on the unscaled S
        return False
    es = kv_cache.element_size()
    return (q.dtype in (torch.bfloat16, torch.float16) and kv_cache.dtype == q.dtype
            and q.shape[-1] == NUM_D * D_CHUNK and v_dim == 2 * V_HALF
            and kv_cache.shape[1] % BLOCK_N == 0
            and kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.stride(1)
            and (kv_cache.stride(1) * es) % 16 == 0 and kv_cache.data_ptr() % 16 == 0)

if gluon is not None:
    # the same numbers as constexprs (a @gluon.jit function reads only constexpr globals)
    _BLOCK_M = gl.constexpr(BLOCK_M)
    _BLOCK_N = gl.constexpr(BLOCK_N)
    _D_CHUNK = gl.constexpr(D_CHUNK)
    _NUM_D = gl.constexpr(NUM_D)
    _V_HALF = gl.constexpr(V_HALF)
    _NUM_BUF = gl.constexpr(NUM_BUF)
    _NUM_WARPS = gl.constexpr(NUM_WARPS)
    _PARTS = gl.constexpr(PARTS)
    _ROPE = gl.constexpr(0)  # part index of a slot's barriers (slot * 3 + part)
    _HI = gl.constexpr(1)
    _LO = gl.constexpr(2)
    _HALF_CHUNKS = gl.constexpr(V_HALF // D_CHUNK)  # 4 value chunks a half
    # WG0's register layouts: S [64, 64] and O_lo [64, 256] as wgmma accumulators, P as PV's
    # register A operand, and one value a row
    _S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16]))
    _O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, V_HALF, 16]))
    _P_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_O_LAYOUT.value, k_width=2))
    _ROW_LAYOUT = gl.constexpr(gl.SliceLayout(1, _S_LAYOUT.value))

    @gluon.jit
    def _split_bounds(PL, N, H, num_splits, pid_m, pid_s, b, IS_CAUSAL: gl.constexpr):
        """(prefix, lo, t_hi, n_full, n_tiles) of this program: the portable kernels' bounds
        (`plan.fit_chunk`'s chunk; full tiles lo .. hi_full, masked tiles hi_full .. t_hi, both
        from lo in 64-key steps)."""
        prefix = gl.load(PL + b)
        total = prefix + N
        chunk = gl.cdiv(gl.cdiv(total, num_splits), _BLOCK_N) * _BLOCK_N
        lo = pid_s * chunk
        hi = gl.minimum(lo + chunk, prefix)
        n_full = gl.maximum(hi - lo, 0) // _BLOCK_N
        n_end = N
        if IS_CAUSAL:  # a causal tile never looks past its last row's node
            n_end = gl.minimum(N, (pid_m * _BLOCK_M + _BLOCK_M - 1) // H + 1)
        t_hi = gl.maximum(hi, gl.minimum(lo + chunk, prefix + n_end))
        n_tiles = gl.cdiv(gl.maximum(t_hi - lo, 0), _BLOCK_N)
        return prefix, lo, t_hi, n_full, n_tiles

    @gluon.jit
    def _loader(kv_desc, q_desc, q_smem, qr_smem, q_full, kv_smem, kr_smem, kv_full, kv_empty,
                PT, PL, N, H, M, num_splits, s_ptb, PAGE_SIZE: gl.constexpr,
                IS_CAUSAL: gl.constexpr, Q_TMA: gl.constexpr):
        """The loader partition, 1 warp: [Q by TMA first, on q_full], then per tile the page id
        (before any wait: its latency is off the ring's path) and the slot's three parts as soon
        as each is free: rope (1 box), value columns 256..511 (4 boxes), value columns 0..255
        (4 boxes)."""
        pid_m = gl.program_id(0)
        pid_s = gl.program_id(1)
        b = gl.program_id(2)
        box_bytes: gl.constexpr = _BLOCK_N * _D_CHUNK * kv_desc.dtype.primitive_bitwidth // 8
        if Q_TMA:  # rows b * M + pid_m * 64 ..: past M they are the next request's
            _issue_q(q_desc, q_smem, qr_smem, q_full, b, pid_m, M)  # (finite, never stored)
        prefix, lo, t_hi, n_full, n_tiles = _split_bounds(PL, N, H, num_splits, pid_m, pid_s, b,
                                                          IS_CAUSAL)
        pt_row = b.to(gl.int64) * s_ptb
        for i in range(n_tiles):
            slot = i % _NUM_BUF
            phase = (i // _NUM_BUF) & 1
            start = lo + i * _BLOCK_N
            page = gl.load(PT + pt_row + start // PAGE_SIZE)
            row0 = page * PAGE_SIZE + start % PAGE_SIZE
            bar = slot * _PARTS
            mbarrier.wait(kv_empty.index(bar + _ROPE), phase ^ 1)  # fresh barrier: passes at once
            mbarrier.expect(kv_full.index(bar + _ROPE), box_bytes)
            tma.async_copy_global_to_shared(kv_desc, [row0, (_NUM_D - 1) * _D_CHUNK],
                                            kv_full.index(bar + _ROPE), kr_smem.index(slot))
            for part in gl.static_range(_HI, _LO + 1):  # columns 256..511, then 0..255
                first = (_LO - part) * _HALF_CHUNKS
                mbarrier.wait(kv_empty.index(bar + part), phase ^ 1)
                mbarrier.expect(kv_full.index(bar + part), _HALF_CHUNKS * box_bytes)
                for c in gl.static_range(_HALF_CHUNKS):
                    tma.async_copy_global_to_shared(kv_desc, [row0, (first + c) * _D_CHUNK],
                                                    kv_full.index(bar + part),
                                                    kv_smem.index(slot * (_NUM_D - 1) + first + c))

    @gluon.jit
    def _issue_q(q_desc, q_smem, qr_smem, q_full, b, pid_m, M):
        """Q's 64 rows b * M + pid_m * 64 .. by TMA onto q_full (past M they are the next
        request's rows, finite and never stored, or past the tensor: zero-filled)."""
        box_bytes: gl.constexpr = _BLOCK_M * _D_CHUNK * q_desc.dtype.primitive_bitwidth // 8
        q_row = b * M + pid_m * _BLOCK_M
        mbarrier.expect(q_full, _NUM_D * box_bytes)
        for c in gl.static_range(_NUM_D - 1):
            tma.async_copy_global_to_shared(q_desc, [q_row, c * _D_CHUNK], q_full, q_smem.index(c))
        tma.async_copy_global_to_shared(q_desc, [q_row, (_NUM_D - 1) * _D_CHUNK], q_full, qr_smem)

    @gluon.jit
    def _zero_tail_rows(kv_smem, base, start, t_hi):
        """Value columns of the rows at positions >= t_hi to 0 (NaN-safe PV; module docstring)."""
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_NUM_WARPS, 1], [1, 0])
        pos = start + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, blk))
        keep = gl.expand_dims(pos < t_hi, 1)
        for c in gl.static_range(2 * _V_HALF // _D_CHUNK):
            part = kv_smem.index(base + c)
            x = part.load(blk)
            part.store(gl.where(keep, x, gl.zeros_like(x)))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _value_half(kv_smem, first):
        """Chunks first .. first + 3 of kv_smem as one [64 keys, 256 columns] wgmma B operand.
        A 128-byte-swizzled NVMMA tile wider than 64 columns is stored as 64-column blocks one
        after the other (what a TMA box split into 64-column copies writes), i.e. exactly 4
        consecutive [64, 64] chunks."""
        part = kv_smem.index(first)
        return part._reinterpret(kv_smem.dtype, [_BLOCK_N, _V_HALF], part.layout)

    @gluon.jit
    def _mask_s(s, TM, b, rows, row_ok, H, prefix, start, t_hi, s_tb, s_tn,
                s_layout: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """S where key `start + c` is visible to row r, else -inf (as the portable tree kernel's
        `_attend_masked_halves`)."""
        pos = start + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        valid = gl.expand_dims(pos < t_hi, 0)
        j = gl.expand_dims(pos - prefix, 0)  # tree node of a key; < 0 in the prefix
        n_of = gl.expand_dims(rows // H, 1)
        if IS_CAUSAL:
            tree_ok = j <= n_of
        else:
            tm = gl.load(TM + b.to(gl.int64) * s_tb + n_of * s_tn + j,
                         mask=gl.expand_dims(row_ok, 1) & valid & (j >= 0), other=0)
            tree_ok = tm != 0
        allowed = valid & ((j < 0) | tree_ok)
        return gl.where(allowed, s, float("-inf"))

    @gluon.jit
    def _pack_half(x, dtype: gl.constexpr):
        """fp32 -> bf16 / fp16, two values an instruction (`cvt.rn.bf16x2.f32`: SASS F2FP).
        `x.to(bf16)` lowers to one scalar cvt a value (SASS F2F + PRMT: 48 instructions a tile
        where this takes 16; with the FFMA exponent, WG0's softmax went 1014 -> 710 clk on the
        H200, `h200-20261203-softmax-conversions`). Round-to-nearest-even, as `.to`."""
        if dtype == gl.bfloat16:
            return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                             dtype=gl.bfloat16, is_pure=True, pack=2)
        else:
            return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                             dtype=gl.float16, is_pure=True, pack=2)

    @gluon.jit
    def _online_softmax(s, m_i, l_i, o_lo, qk_scale, masked, TM, b, rows, row_ok, H, prefix, start,
                        t_hi, s_tb, s_tn, p_dtype: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """One tile's online-softmax step in WG0 (log2 domain): (P in p_dtype, alpha, m, l, O_lo
        rescaled). Masked tiles get -inf where a key is not visible (`_mask_s`).
        The row max is taken on the unscaled S (qk_scale > 0: max(s) x scale is exactly the max
        of the rounded products), so the exponent is one FFMA a value, s x scale - m; P goes to
        16 bits two values an instruction (`_pack_half`); l sums the fp32 P before rounding (as
        FlashAttention does; the bf16-rounded sum cost 32 more conversions a tile)."""
        if masked:
            s = _mask_s(s, TM, b, rows, row_ok, H, prefix, start, t_hi, s_tb, s_tn, _S_LAYOUT,
                        IS_CAUSAL)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = gl.exp2(m_i - m_use)
        p32 = gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(m_use, 1)))
        p = _pack_half(p32, p_dtype)  # one P for both halves
        l_i = l_i * alpha + gl.sum(p32, 1)
        o_lo = o_lo * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, _O_LAYOUT)), 1)
        return p, alpha, m_new, l_i, o_lo

    @gluon.jit
    def _wg0_start(PL, N, H, M, num_splits, IS_CAUSAL: gl.constexpr):
        """WG0's program, bounds and fresh softmax state: (pid_m, pid_s, b, prefix, lo, t_hi,
        n_full, n_tiles, rows, row_ok, m_i, l_i, S of zeros, O_lo of zeros)."""
        pid_m = gl.program_id(0)
        pid_s = gl.program_id(1)
        b = gl.program_id(2)
        prefix, lo, t_hi, n_full, n_tiles = _split_bounds(PL, N, H, num_splits, pid_m, pid_s, b,
                                                          IS_CAUSAL)
        rows = pid_m * _BLOCK_M + gl.arange(0, _BLOCK_M, layout=_ROW_LAYOUT)
        m_i = gl.full([_BLOCK_M], float("-inf"), gl.float32, _ROW_LAYOUT)
        l_i = gl.zeros([_BLOCK_M], gl.float32, _ROW_LAYOUT)
        s_zero = gl.zeros([_BLOCK_M, _BLOCK_N], gl.float32, _S_LAYOUT)
        o_lo = gl.zeros([_BLOCK_M, _V_HALF], gl.float32, _O_LAYOUT)
        return pid_m, pid_s, b, prefix, lo, t_hi, n_full, n_tiles, rows, rows < M, m_i, l_i, s_zero, o_lo

    @gluon.jit
    def _qk_rope_hi(q_smem, qr_smem, kv_smem, kr_smem, kv_full, s_zero, slot, base, bar, phase,
                    masked, start, t_hi):
        """WG0: the first 5 QK wgmma of a tile (the rope chunk, value columns 256..511), issued
        async once those parts landed (their full barriers waited by the caller); a masked tile
        first waits for columns 0..255 too and zeroes the rows past t_hi (`_zero_tail_rows`)."""
        if masked:  # the zeroing touches both value halves
            mbarrier.wait(kv_full.index(bar + _LO), phase)
            _zero_tail_rows(kv_smem, base, start, t_hi)
        s = warpgroup_mma(qr_smem, kr_smem.index(slot).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        for c in gl.static_range(_HALF_CHUNKS, _NUM_D - 1):
            s = warpgroup_mma(q_smem.index(c), kv_smem.index(base + c).permute((1, 0)), s,
                              is_async=True)
        return s

    @gluon.jit
    def _softmax_wg(q_smem, qr_smem, q_full, kv_smem, kr_smem, p_smem, a_smem, kv_full, kv_empty,
                    p_full, p_empty, TM, PL, O, LSE, PO, PLSE, qk_scale, H, N, M, num_splits,
                    s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln,
                    IS_CAUSAL: gl.constexpr, DIRECT: gl.constexpr, Q_TMA: gl.constexpr):
        """WG0: QK over the slot's parts in the order they land (rope, columns 256..511,
        columns 0..255), the rope part freed after QK; softmax; PV_lo of the same tile issued
        right after its P (A from registers) and waited in the same iteration, then columns
        0..255 freed. A slot part lives QK + softmax + PV, not "until the next tile has landed +
        PV_lo" (one barrier pair a slot, 6fdba99), so the next-but-one tile's loads overlap
        this tile's."""
        o_layout: gl.constexpr = _O_LAYOUT
        p_layout: gl.constexpr = _P_LAYOUT
        pid_m, pid_s, b, prefix, lo, t_hi, n_full, n_tiles, rows, row_ok, m_i, l_i, s_zero, o_lo = \
            _wg0_start(PL, N, H, M, num_splits, IS_CAUSAL)
        if Q_TMA:
            mbarrier.wait(q_full, 0)
        for i in range(n_tiles):
            slot = i % _NUM_BUF
            phase = (i // _NUM_BUF) & 1
            base = slot * (_NUM_D - 1)  # the slot's first value chunk in kv_smem
            bar = slot * _PARTS
            start = lo + i * _BLOCK_N
            masked = i >= n_full
            mbarrier.wait(kv_full.index(bar + _ROPE), phase)
            mbarrier.wait(kv_full.index(bar + _HI), phase)
            s = _qk_rope_hi(q_smem, qr_smem, kv_smem, kr_smem, kv_full, s_zero, slot, base, bar,
                            phase, masked, start, t_hi)
            mbarrier.wait(kv_full.index(bar + _LO), phase)  # lands last: freed last (PV_lo)
            for c in gl.static_range(_HALF_CHUNKS):
                s = warpgroup_mma(q_smem.index(c), kv_smem.index(base + c).permute((1, 0)), s,
                                  is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            mbarrier.arrive(kv_empty.index(bar + _ROPE))  # QK was the rope's only reader
            p, alpha, m_i, l_i, o_lo = _online_softmax(s, m_i, l_i, o_lo, qk_scale, masked, TM, b, rows,
                                                       row_ok, H, prefix, start, t_hi, s_tb, s_tn,
                                                       q_smem.dtype, IS_CAUSAL)
            # PV_lo on the tensor cores while P goes to WG1 (WG1's PV_hi queues behind it)
            o_lo = warpgroup_mma(gl.convert_layout(p, p_layout), _value_half(kv_smem, base), o_lo,
                                 is_async=True)
            mbarrier.wait(p_empty, (i & 1) ^ 1)  # WG1 is done with P(i - 1)
            p_smem.store(p)
            a_smem.store(alpha)
            fence_async_shared()
            mbarrier.arrive(p_full)
            o_lo = warpgroup_mma_wait(0, deps=[o_lo])
            mbarrier.arrive(kv_empty.index(bar + _LO))
        # the final row sums to WG1 (for its normalisation), through the alpha buffer
        mbarrier.wait(p_empty, (n_tiles & 1) ^ 1)
        a_smem.store(l_i)
        mbarrier.arrive(p_full)
        # slot 0's columns 0..255 as the staging buffer: every load into them has
        # landed and been read by this warpgroup's own PV_lo (waited), and WG1 never reads them
        _store_half(o_lo, m_i, l_i, O, LSE, PO, PLSE, b, pid_m, pid_s, H, M, num_splits, 0,
                    s_ob, s_on, s_oh, s_lb, s_ln, o_layout, DIRECT, True, _value_half(kv_smem, 0))

    @gluon.jit
    def _pv_hi_wg(kv_smem, q_smem, p_smem, a_smem, kv_empty, p_full, p_empty, PL, O, LSE, PO, PLSE,
                  H, N, M, num_splits, s_ob, s_on, s_oh, s_lb, s_ln,
                  IS_CAUSAL: gl.constexpr, DIRECT: gl.constexpr):
        """WG1: O_hi = alpha O_hi + P V[:, 256:512] per tile; the normalised half at the end.
        Releases the slot's columns 256..511 after its PV."""
        o_layout: gl.constexpr = _O_LAYOUT  # the same as WG0's O_lo (its own 4 warps)
        a_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        pid_m = gl.program_id(0)
        pid_s = gl.program_id(1)
        b = gl.program_id(2)
        prefix, lo, t_hi, n_full, n_tiles = _split_bounds(PL, N, H, num_splits, pid_m, pid_s, b,
                                                          IS_CAUSAL)
        o_hi = gl.zeros([_BLOCK_M, _V_HALF], gl.float32, o_layout)
        for i in range(n_tiles):
            slot = i % _NUM_BUF
            mbarrier.wait(p_full, i & 1)
            alpha = a_smem.load(a_layout)
            o_hi = o_hi * gl.expand_dims(alpha, 1)
            v_hi = _value_half(kv_smem, slot * (_NUM_D - 1) + _V_HALF // _D_CHUNK)
            o_hi = warpgroup_mma(p_smem, v_hi, o_hi)
            mbarrier.arrive(p_empty)
            mbarrier.arrive(kv_empty.index(slot * _PARTS + _HI))
        mbarrier.wait(p_full, n_tiles & 1)
        l_i = a_smem.load(a_layout)
        m_i = gl.zeros([_BLOCK_M], gl.float32, a_layout)  # unused: WG0 stores the LSE
        # Q's chunks 0..3 as the staging buffer: WG0 hands over the final row sums
        # after its last QK (and after Q landed), so nothing reads Q any more
        _store_half(o_hi, m_i, l_i, O, LSE, PO, PLSE, b, pid_m, pid_s, H, M, num_splits, _V_HALF,
                    s_ob, s_on, s_oh, s_lb, s_ln, o_layout, DIRECT, False, _value_half(q_smem, 0))

    @gluon.jit
    def _store_half(acc, m_i, l_i, O, LSE, PO, PLSE, b, pid_m, pid_s, H, M, num_splits, col0,
                    s_ob, s_on, s_oh, s_lb, s_ln, o_layout: gl.constexpr, DIRECT: gl.constexpr,
                    WITH_LSE: gl.constexpr, stage):
        """`gathered._store_rows` for value columns col0 .. col0 + 255: the output and
        natural-log LSE directly, or this split's normalised partial and log2 LSE. The half goes
        through `stage` ([64, 256] of free shared memory) and leaves as 16-byte stores of whole
        512-byte row halves (`_store_staged`), not the wgmma layout's 4-byte stores (two columns
        of 8 rows a warp instruction: 5-6 us more a call at 32k-64k, `h200-20261203-kernel-v5c`)."""
        row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        rows = pid_m * _BLOCK_M + gl.arange(0, _BLOCK_M, layout=row_layout)
        row_ok = rows < M
        l_i = gl.convert_layout(l_i, row_layout)
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        out = acc / gl.expand_dims(l_safe, 1)
        if DIRECT:
            _store_staged(out.to(O.dtype.element_ty), stage, O, b, pid_m, pid_s, H, M,
                          num_splits, col0, s_ob, s_on, s_oh, DIRECT)
        else:
            _store_staged(out.to(PO.dtype.element_ty), stage, PO, b, pid_m, pid_s, H, M,
                          num_splits, col0, s_ob, s_on, s_oh, DIRECT)
        if WITH_LSE:
            m_i = gl.convert_layout(m_i, row_layout)
            lse2 = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_safe))
            if DIRECT:
                gl.store(LSE + b.to(gl.int64) * s_lb + (rows // H) * s_ln + rows % H,
                         lse2 * 0.6931471805599453, mask=row_ok)
            else:
                gl.store(PLSE + (b.to(gl.int64) * M + rows) * num_splits + pid_s, lse2, mask=row_ok)

    @gluon.jit
    def _store_staged(out, stage, Dst, b, pid_m, pid_s, H, M, num_splits, col0, s_ob, s_on, s_oh,
                      DIRECT: gl.constexpr):
        """`out` ([64, 256], the stored dtype, wgmma layout) into `stage` (shared, free: the
        caller's own consumed ring chunks or Q), one warpgroup barrier, then read back 8 columns
        (16 bytes) a thread, a warp per 256-column row half, and stored masked to rows < M: a warp
        instruction writes 512 contiguous bytes (from the wgmma layout: 8 rows x 16 bytes)."""
        stage.store(out)
        gl.thread_barrier()  # the warpgroup's stores before its reads (one partition)
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [_NUM_WARPS, 1], [1, 0])
        rows = pid_m * _BLOCK_M + gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(1, blk))
        cols = col0 + gl.arange(0, _V_HALF, layout=gl.SliceLayout(0, blk))
        ok2 = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < 2 * _V_HALF, 0)
        x = stage.load(blk)
        if DIRECT:
            row = b.to(gl.int64) * s_ob + (rows // H) * s_on + (rows % H) * s_oh
            gl.store(Dst + gl.expand_dims(row, 1) + gl.expand_dims(cols, 0), x, mask=ok2)
        else:
            row = (b.to(gl.int64) * M + rows) * num_splits + pid_s  # partials [B, M, S, v_dim]
            gl.store(Dst + gl.expand_dims(row, 1) * (2 * _V_HALF) + gl.expand_dims(cols, 0), x,
                     mask=ok2)

    @gluon.jit
    def _load_q(Q, q_smem, qr_smem, b, pid_m, H, M, s_qb, s_qn, s_qh):
        """Q rows (n, h) of this M tile, 9 chunks of 64 columns, rows past M as 0."""
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_NUM_WARPS, 1], [1, 0])
        rows = pid_m * _BLOCK_M + gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(1, blk))
        cols = gl.arange(0, _D_CHUNK, layout=gl.SliceLayout(0, blk))
        row_ok = gl.expand_dims(rows < M, 1)
        q_row = gl.expand_dims(b.to(gl.int64) * s_qb + (rows // H) * s_qn + (rows % H) * s_qh, 1)
        for c in gl.static_range(_NUM_D - 1):
            x = gl.load(Q + q_row + c * _D_CHUNK + gl.expand_dims(cols, 0), mask=row_ok, other=0.0)
            q_smem.index(c).store(x.to(q_smem.dtype))
        x = gl.load(Q + q_row + (_NUM_D - 1) * _D_CHUNK + gl.expand_dims(cols, 0), mask=row_ok,
                    other=0.0)
        qr_smem.store(x.to(qr_smem.dtype))

    @gluon.jit
    def _hopper_kernel(
        Q, kv_desc, q_desc, PT, PL, TM, O, LSE, PO, PLSE,
        qk_scale, H, N, M, num_splits,
        s_qb, s_qn, s_qh, s_ptb, s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln,
        PAGE_SIZE: gl.constexpr, IS_CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
        Q_TMA: gl.constexpr,
    ):
        """Grid (M tiles, splits, B), outputs as the portable kernels' (module docstring).
        Per-part ring barriers (`_loader`, `_softmax_wg`, `_pv_hi_wg`). Q_TMA: Q comes by TMA
        through `q_desc` from the loader instead of the default partition's loads before the
        partitions start (else `q_desc` is unused); the output halves leave through shared
        memory (`_store_staged`)."""
        dtype: gl.constexpr = kv_desc.dtype
        tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        # shared-memory shapes must be powers of 2: 576 columns = 8 value chunks + 1 rope chunk
        q_smem = gl.allocate_shared_memory(dtype, [_NUM_D - 1, _BLOCK_M, _D_CHUNK], tile_layout)
        qr_smem = gl.allocate_shared_memory(dtype, [_BLOCK_M, _D_CHUNK], tile_layout)
        kv_smem = gl.allocate_shared_memory(dtype, [_NUM_BUF * (_NUM_D - 1), _BLOCK_N, _D_CHUNK],
                                            tile_layout)  # slot k's chunk c at k * 8 + c
        kr_smem = gl.allocate_shared_memory(dtype, [_NUM_BUF, _BLOCK_N, _D_CHUNK], tile_layout)
        p_smem = gl.allocate_shared_memory(dtype, [_BLOCK_M, _BLOCK_N], tile_layout)
        a_smem = gl.allocate_shared_memory(gl.float32, [_BLOCK_M], vec_layout)
        pid_m = gl.program_id(0)
        b = gl.program_id(2)
        # barrier arrays of 2 x 4 (shared shapes are powers of 2), 3 used a slot
        kv_full = gl.allocate_shared_memory(gl.int64, [_NUM_BUF * _PARTS, 1], bar_layout)
        kv_empty = gl.allocate_shared_memory(gl.int64, [_NUM_BUF * _PARTS, 1], bar_layout)
        p_full = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        p_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        q_full = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        for k in gl.static_range(_NUM_BUF):
            for part in gl.static_range(_LO + 1):
                mbarrier.init(kv_full.index(k * _PARTS + part), count=1)
                mbarrier.init(kv_empty.index(k * _PARTS + part), count=1)  # one releaser a part
        mbarrier.init(p_full, count=1)
        mbarrier.init(p_empty, count=1)
        mbarrier.init(q_full, count=1)
        if not Q_TMA:
            _load_q(Q, q_smem, qr_smem, b, pid_m, H, M, s_qb, s_qn, s_qh)
        fence_async_shared()
        gl.thread_barrier()
        gl.warp_specialize([
            (_softmax_wg, (q_smem, qr_smem, q_full, kv_smem, kr_smem, p_smem, a_smem, kv_full,
                           kv_empty, p_full, p_empty, TM, PL, O, LSE, PO, PLSE, qk_scale, H, N,
                           M, num_splits, s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln,
                           IS_CAUSAL, DIRECT, Q_TMA)),
            (_pv_hi_wg, (kv_smem, q_smem, p_smem, a_smem, kv_empty, p_full, p_empty, PL, O, LSE, PO, PLSE,
                         H, N, M, num_splits, s_ob, s_on, s_oh, s_lb, s_ln, IS_CAUSAL, DIRECT)),
            (_loader, (kv_desc, q_desc, q_smem, qr_smem, q_full, kv_smem, kr_smem, kv_full,
                       kv_empty, PT, PL, N, H, M, num_splits, s_ptb, PAGE_SIZE, IS_CAUSAL,
                       Q_TMA)),
        ], [4, 1], [232, 24])


def _row_view(t: torch.Tensor, rows: int, row_stride: int) -> torch.Tensor:
    """[rows, D] view of a tensor whose rows are `row_stride` elements apart."""
    return t.as_strided((rows, t.shape[-1]), (row_stride, 1))


def _q_rows_tma_ok(q: torch.Tensor) -> bool:
    """Whether q [B, N, H, D] is one [B x N x H, D] TMA-addressable row block (rows in (b, n, h)
    order, 16-byte aligned base and row stride): then the loader brings Q by TMA."""
    b, n, h, _ = q.shape
    return (q.stride(3) == 1 and q.stride(1) == h * q.stride(2) and q.stride(0) == n * q.stride(1)
            and (q.stride(2) * q.element_size()) % 16 == 0 and q.data_ptr() % 16 == 0)


def tma_descriptors(q: torch.Tensor, kv_cache: torch.Tensor, n: int, h: int, q_tma: bool):
    """(KV descriptor, Q descriptor) of a call: 64 x 64 boxes (128-byte swizzle) over the cache's
    rows (a row a slot) and, when q_tma, over q's [B x N x H, D] rows; otherwise the Q argument
    is the KV descriptor again (unused: the kernel's argument has the same type either way)."""
    page_size = kv_cache.shape[1]
    flat = _row_view(kv_cache, kv_cache.shape[0] * page_size, kv_cache.stride(1))
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    desc = GluonTensorDescriptor(flat, list(flat.shape), [flat.stride(0), 1], [BLOCK_N, D_CHUNK],
                                 layout)
    q_desc = desc
    if q_tma:
        q_flat = _row_view(q, q.shape[0] * n * h, q.stride(2))
        q_desc = GluonTensorDescriptor(q_flat, list(q_flat.shape), [q_flat.stride(0), 1],
                                       [BLOCK_M, D_CHUNK], layout)
    return desc, q_desc


def launch(call: Call) -> None:
    """Launch `_hopper_kernel` for `call` (the caller has checked `supported` and planned the
    splits for 64 x 64 tiles): one TMA descriptor over the [num_pages x page_size, D] row view
    with a [64, 64] box (128-byte swizzle); Q by TMA when `_q_rows_tma_ok`."""
    c, q = call, call.q
    q_tma = _q_rows_tma_ok(q)
    desc, q_desc = tma_descriptors(q, c.kv_cache, c.n, c.h, q_tma)
    grid = (triton.cdiv(c.m_rows, BLOCK_M), c.splits, q.shape[0])
    _hopper_kernel[grid](
        q, desc, q_desc, c.page_table, c.prefix_lens, c.tm, c.out, c.lse, c.po, c.plse,
        c.qk_scale, c.h, c.n, c.m_rows, c.splits,
        q.stride(0), q.stride(1), q.stride(2), c.page_table.stride(0), *c.mask_strides(),
        *c.out_strides(), PAGE_SIZE=c.kv_cache.shape[1], IS_CAUSAL=c.tree_mask is None,
        DIRECT=c.direct, Q_TMA=q_tma, num_warps=NUM_WARPS,
    )
