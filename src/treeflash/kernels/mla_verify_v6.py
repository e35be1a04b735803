"""v6 of the MLA verify split kernel: v5b's Gluon kernel with a "seesaw" schedule (FlashMLA's
SM90 dense decode idea, reasoned out here; KERNEL_NOTES.md "v6: seesaw"). Opt-in:
`KernelConfig(version=6)`, bench variants `v6` / `v6direct`, TREEFLASH_VERIFY_KERNEL=v6.

Why: in v5b the tensor pipe sits idle while WG0 runs the softmax of every tile (~500-700 clk
of a ~2600 clk tile), because WG0 owns every tile's QK and softmax and WG1 only does PV.
Here both consumer warpgroups own tiles, alternately: the split's tiles go in pairs, tile
2k (ring slot 0) belongs to WG0, tile 2k + 1 (slot 1) to WG1. Each warpgroup computes its
tile's S = Q K^T (9 x wgmma 64x64x64) and softmax; while one runs its softmax the other's QK
(or PV) keeps the tensor cores busy. Each warpgroup still owns one half of O (WG0 value columns
0..255 = O_L, WG1 256..511 = O_R, 64 x 256 fp32 = 128 registers a thread), so every tile's P
is used by both warpgroups: by its owner from registers (as v5b's PV_lo), by the other one from
shared memory, where it sits in the tile's own rope chunk (free once the tile's QK is done; the
other warpgroup, P's last reader there, frees it with its value half). Reading P from shared
memory in the owner too would save registers but make the rope chunk a two-reader part.

The pair recurrence (log2 domain; m, l the running row max / sum before the pair, both halves
of O scaled to m):
    WG0: m0 = max(m, rowmax S0)   a0 = 2^(m - m0)    P0 = 2^(S0 - m0)
    WG1: m1 = max(m0, rowmax S1)  a1 = 2^(m0 - m1)   P1 = 2^(S1 - m1)
    O_L = (O_L a0 + P0 V0_L) a1 + P1 V1_L       (WG0)
    O_R = (O_R a0 + P0 V0_R) a1 + P1 V1_R       (WG1)
    l   = (l a0 + rowsum P0) a1 + rowsum P1     (WG0 only; WG1 hands it rowsum P1)
    m   = m1
(-inf maxima use 0 as the exponent base, as v5's `_online_softmax`.) Both halves see the same
a0, a1, P0, P1 (the same fp32 / bf16 values through shared memory), and the final l goes from
WG0 to WG1 once, so both halves are normalised by the same l. An odd last tile: WG1 hands over
m1 = m0, a1 = 1, rowsum 0 and only does PV0_R. tests/kernels/test_mla_verify_v6.py checks the
recurrence against a softmax in torch.

Per pair (k; barrier phase k & 1):
  WG0: wait slot 0's part L [masked: + part R, zero value rows past t_hi]; QK0 over chunks 0..3;
       wait part R; QK0 over chunks 4..7 + rope; wait; arrive `go` (WG1 may issue QK1 now:
       WG0's softmax runs beside it); softmax0; P0 into slot 0's rope chunk, m0, a0 into `x`;
       arrive p0_full; O_L *= a0; PV0_L (P0 from registers) async; wait it -> free slot 0 part L;
       wait p1_full; m1, a1, rowsum P1 from `x`; [tile 1: O_L *= a1; PV1_L (P1 from slot 1's
       rope chunk); free slot 1 part L].
  WG1: wait go; [tile 1: wait slot 1 part L (+R if masked: zero); QK1 over rope + chunks 0..3;
       wait part R; QK1 over chunks 4..7, async]; wait p0_full; m0, a0 from `x`; O_R *= a0;
       PV0_R (P0 from slot 0's rope chunk) async; [tile 1: wait QK1 (PV0_R still in flight);
       softmax1 from m0; P1 into slot 1's rope chunk]; m1, a1, rowsum P1 into `x`; arrive
       p1_full; wait PV0_R -> free slot 0 part R; [tile 1: O_R *= a1; PV1_R (P1 from registers);
       free slot 1 part R].
  loader (1 warp): both page ids first, then slot 0 part L (4 boxes), part R (4 + rope), slot 1
       part L (4 + rope), part R (4), each as soon as it is free.
Ring parts: a slot is two parts, "L" = value columns 0..255 (freed by WG0 after its PV_L) and
"R" = columns 256..511 (freed by WG1 after its PV_R); the rope chunk, which holds the tile's P
after its QK, rides with the part that the *other* warpgroup frees (slot 0: R, slot 1: L), since
the other warpgroup is P's last reader. No separate P buffer: shared memory is Q 72 KB + 2 x
72 KB + 2 KB of row vectors + barriers = 223.4 KB (v5b 230 KB).

No wgmma is in flight across the pair loop's back edge (C7515); every barrier is single-producer
count 1. Phases: kv barriers flip once per pair; go / p0_full / p1_full flip once per pair in
every pair (WG1 takes part in an odd last pair), and neither side can run two phases ahead
(each producer's next arrive depends on the consumer's previous wait, through p1_full or the
ring); l_full and q_full are used once.

Reused from mla_verify_v5: supported(), the split bounds, masks, zeroing of masked rows, the
[64, 256] value views, Q by TMA or registers, the epilogue (`_store_half`, v5c's staged store),
PDL. Same partials / split plan / combine as v5.

Measured (H200): = v5b within +-2% in session 7 (the old softmax); = v5cw within +-0.02 of the floor
in session 12 with v5's new softmax (`_softmax_step`) and v5cw's staged store and combine (bench
variant v6cw; results/h200-20261203-s12/5-v6-softmax; 23 GPU checks ok). Opt-in either way.
"""

from __future__ import annotations

from treeflash.kernels.mla_verify_v5 import (  # noqa: F401 - re-exported for the caller
    BLOCK_M,
    BLOCK_N,
    D_CHUNK,
    NUM_D,
    NUM_WARPS,
    V_HALF,
    _q_rows_tma_ok,
    _row_view,
    gluon,
    supported,
    tma_descriptors,
)

# setmaxnreg of the worker partitions (the default partition, WG0, gets what is left of the 64K
# registers: 512 - WG1_REGS - LOADER_REGS a thread); both consumer warpgroups hold an O half, S, P
WG1_REGS = 232
LOADER_REGS = 24

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from treeflash.kernels.mla_verify_v5 import (
        _BLOCK_M,
        _BLOCK_N,
        _D_CHUNK,
        _HALF_CHUNKS,
        _NUM_D,
        _O_LAYOUT,
        _P_LAYOUT,
        _ROW_LAYOUT,
        _S_LAYOUT,
        _V_HALF,
        _gdc_launch_dependents,
        _gdc_wait,
        _load_q,
        _mask_s,
        _pack_half,
        _split_bounds,
        _store_half,
        _value_half,
        _wg0_start,
        _zero_tail_rows,
    )

    # ring barriers: slot * 2 + part; part L = value columns 0..255 (+ rope on slot 1), freed by
    # WG0; part R = columns 256..511 (+ rope on slot 0), freed by WG1
    _PL = gl.constexpr(0)
    _PR = gl.constexpr(1)
    _SLOT1 = gl.constexpr(NUM_D - 1)  # slot 1's first value chunk in kv_smem
    # `sy` barriers
    _GO = gl.constexpr(0)  # WG0 -> WG1: QK0 done, QK1 may start
    _P0_FULL = gl.constexpr(1)  # WG0 -> WG1: P0 (slot 0 rope chunk), m0, a0
    _P1_FULL = gl.constexpr(2)  # WG1 -> WG0: P1 (slot 1 rope chunk), m1, a1, rowsum P1
    _L_FULL = gl.constexpr(3)  # WG0 -> WG1: the final row sums (once)
    _Q_FULL = gl.constexpr(4)  # loader -> both: Q by TMA (once)
    # `x` rows (fp32 [64] each)
    _XM0 = gl.constexpr(0)
    _XA0 = gl.constexpr(1)
    _XM1 = gl.constexpr(2)
    _XA1 = gl.constexpr(3)
    _XR1 = gl.constexpr(4)
    _XL = gl.constexpr(5)
    _WG1_REGS = gl.constexpr(WG1_REGS)
    _LOADER_REGS = gl.constexpr(LOADER_REGS)

    @gluon.jit
    def _opaque_zero():
        """0 that the compiler cannot see through (a non-pure inline asm), added to the static
        shared-memory indices of each pair: without it LLVM hoists the ~40 loop-invariant wgmma
        descriptors (64-bit each) out of the pair loop, and ptxas spills them (v5b's dynamic
        slot index made them per-iteration values)."""
        return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _softmax_step(s, m_prev, qk_scale, masked, TM, b, rows, row_ok, H, prefix, start, t_hi,
                      s_tb, s_tn, p_dtype: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """One tile's softmax against the running max m_prev (log2 domain): (P in p_dtype,
        alpha = 2^(m_prev - m_new), m_new, rowsum of the fp32 P). Masked tiles: `_mask_s`.
        v5's arithmetic since session 12 (`_online_softmax`, KERNEL_NOTES.md "Session 11"): the
        row max on the unscaled S (qk_scale > 0, which the launcher requires), the exponent as
        one FFMA a value, P packed two values an instruction, the sum from the fp32 P."""
        if masked:
            s = _mask_s(s, TM, b, rows, row_ok, H, prefix, start, t_hi, s_tb, s_tn, _S_LAYOUT,
                        IS_CAUSAL)
        m_new = gl.maximum(m_prev, gl.max(s, 1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = gl.exp2(m_prev - m_use)
        p32 = gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(m_use, 1)))
        return _pack_half(p32, p_dtype), alpha, m_new, gl.sum(p32, 1)

    @gluon.jit
    def _rescale(o, a):
        """o [64, 256] (wgmma layout) times a per row (a in the row layout of S)."""
        return o * gl.expand_dims(gl.convert_layout(a, gl.SliceLayout(1, _O_LAYOUT)), 1)

    @gluon.jit
    def _wg0_seesaw(q_smem, qr_smem, kv_smem, kr_smem, x_smem, kv_full, kv_empty, sy,
                    TM, PL, O, LSE, PO, PLSE, qk_scale, H, N, M, num_splits,
                    s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln,
                    IS_CAUSAL: gl.constexpr, DIRECT: gl.constexpr, Q_TMA: gl.constexpr,
                    STAGE: gl.constexpr):
        """WG0 (default partition): tiles 2k (slot 0): QK0, softmax0, P0 / m0 / a0 to WG1;
        O_L += P0 V0_L; O_L += P1 V1_L with WG1's P1; the running l; LSE and O_L at the end."""
        pid_m, pid_s, b, prefix, lo, t_hi, n_full, n_tiles, rows, row_ok, m_i, l_i, s_zero, o_l = \
            _wg0_start(PL, N, H, M, num_splits, IS_CAUSAL)
        if Q_TMA:
            mbarrier.wait(sy.index(_Q_FULL), 0)
        for k in range((n_tiles + 1) // 2):
            ph = k & 1
            z = _opaque_zero()
            t0 = 2 * k
            start = lo + t0 * _BLOCK_N
            masked = t0 >= n_full
            mbarrier.wait(kv_full.index(_PL), ph)
            if masked:  # the zeroing touches both value halves
                mbarrier.wait(kv_full.index(_PR), ph)
                _zero_tail_rows(kv_smem, 0, start, t_hi)
            s = warpgroup_mma(q_smem.index(z), kv_smem.index(z).permute((1, 0)),
                              gl.zeros([_BLOCK_M, _BLOCK_N], gl.float32, _S_LAYOUT),
                              use_acc=False, is_async=True)
            for c in gl.static_range(1, _HALF_CHUNKS):
                s = warpgroup_mma(q_smem.index(z + c), kv_smem.index(z + c).permute((1, 0)), s,
                                  is_async=True)
            mbarrier.wait(kv_full.index(_PR), ph)
            for c in gl.static_range(_HALF_CHUNKS, _NUM_D - 1):
                s = warpgroup_mma(q_smem.index(z + c), kv_smem.index(z + c).permute((1, 0)), s,
                                  is_async=True)
            s = warpgroup_mma(qr_smem, kr_smem.index(z + 0).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            mbarrier.arrive(sy.index(_GO))  # QK1 on the tensor cores beside this softmax
            p, a0, m0, rs0 = _softmax_step(s, m_i, qk_scale, masked, TM, b, rows, row_ok, H,
                                           prefix, start, t_hi, s_tb, s_tn, q_smem.dtype,
                                           IS_CAUSAL)
            kr_smem.index(z + 0).store(p)  # QK0 was the rope chunk's only reader
            x_smem.slice(_XM0 * _BLOCK_M, _BLOCK_M).store(m0)
            x_smem.slice(_XA0 * _BLOCK_M, _BLOCK_M).store(a0)
            fence_async_shared()
            mbarrier.arrive(sy.index(_P0_FULL))
            o_l = _rescale(o_l, a0)
            l_i = l_i * a0 + rs0
            # P0 from registers: rope(0) (P0's copy in shared) is freed by WG1, its other reader
            o_l = warpgroup_mma(gl.convert_layout(p, _P_LAYOUT), _value_half(kv_smem, z), o_l,
                                is_async=True)
            # PV0_L done -> slot 0 columns 0..255 free (before waiting for WG1's softmax: the
            # next pair's first part can start loading while softmax1 runs)
            o_l = warpgroup_mma_wait(0, deps=[o_l])
            mbarrier.arrive(kv_empty.index(_PL))
            mbarrier.wait(sy.index(_P1_FULL), ph)
            m_i = x_smem.slice(_XM1 * _BLOCK_M, _BLOCK_M).load(_ROW_LAYOUT)
            a1 = x_smem.slice(_XA1 * _BLOCK_M, _BLOCK_M).load(_ROW_LAYOUT)
            rs1 = x_smem.slice(_XR1 * _BLOCK_M, _BLOCK_M).load(_ROW_LAYOUT)
            l_i = l_i * a1 + rs1  # a1 = 1, rs1 = 0 without a tile 1
            if t0 + 1 < n_tiles:
                o_l = _rescale(o_l, a1)
                o_l = warpgroup_mma(kr_smem.index(z + 1), _value_half(kv_smem, z + _SLOT1), o_l)
                mbarrier.arrive(kv_empty.index(2 + _PL))  # slot 1 columns 0..255 + rope (P1)
        # the final row sums to WG1 (for its normalisation)
        x_smem.slice(_XL * _BLOCK_M, _BLOCK_M).store(l_i)
        mbarrier.arrive(sy.index(_L_FULL))
        # STAGE (v5c): slot 0's columns 0..255 as the staging buffer: WG0 was their last reader
        _store_half(o_l, m_i, l_i, O, LSE, PO, PLSE, b, pid_m, pid_s, H, M, num_splits, 0,
                    s_ob, s_on, s_oh, s_lb, s_ln, _O_LAYOUT, DIRECT, True, _value_half(kv_smem, 0),
                    STAGE)

    @gluon.jit
    def _wg1_seesaw(q_smem, qr_smem, kv_smem, kr_smem, x_smem, kv_full, kv_empty, sy,
                    TM, PL, O, LSE, PO, PLSE, qk_scale, H, N, M, num_splits,
                    s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln,
                    IS_CAUSAL: gl.constexpr, DIRECT: gl.constexpr, Q_TMA: gl.constexpr,
                    STAGE: gl.constexpr):
        """WG1 (worker): tiles 2k + 1 (slot 1): QK1 (after WG0's QK0), softmax1 from WG0's m0,
        P1 / m1 / a1 / rowsum to WG0; O_R += P0 V0_R with WG0's P0, O_R += P1 V1_R."""
        pid_m, pid_s, b, prefix, lo, t_hi, n_full, n_tiles, rows, row_ok, m_unused, l_unused, \
            s_zero, o_r = _wg0_start(PL, N, H, M, num_splits, IS_CAUSAL)
        if Q_TMA:
            mbarrier.wait(sy.index(_Q_FULL), 0)
        for k in range((n_tiles + 1) // 2):
            ph = k & 1
            z = _opaque_zero()
            t1 = 2 * k + 1
            mbarrier.wait(sy.index(_GO), ph)
            if t1 < n_tiles:
                start = lo + t1 * _BLOCK_N
                masked = t1 >= n_full
                mbarrier.wait(kv_full.index(2 + _PL), ph)
                if masked:
                    mbarrier.wait(kv_full.index(2 + _PR), ph)
                    _zero_tail_rows(kv_smem, _SLOT1, start, t_hi)
                s = warpgroup_mma(qr_smem, kr_smem.index(z + 1).permute((1, 0)),
                                  gl.zeros([_BLOCK_M, _BLOCK_N], gl.float32, _S_LAYOUT),
                                  use_acc=False, is_async=True)
                for c in gl.static_range(_HALF_CHUNKS):
                    s = warpgroup_mma(q_smem.index(z + c), kv_smem.index(z + _SLOT1 + c).permute((1, 0)), s,
                                      is_async=True)
                mbarrier.wait(kv_full.index(2 + _PR), ph)
                for c in gl.static_range(_HALF_CHUNKS, _NUM_D - 1):
                    s = warpgroup_mma(q_smem.index(z + c), kv_smem.index(z + _SLOT1 + c).permute((1, 0)), s,
                                      is_async=True)
                mbarrier.wait(sy.index(_P0_FULL), ph)
                m0 = x_smem.slice(_XM0 * _BLOCK_M, _BLOCK_M).load(_ROW_LAYOUT)
                a0 = x_smem.slice(_XA0 * _BLOCK_M, _BLOCK_M).load(_ROW_LAYOUT)
                o_r = _rescale(o_r, a0)
                o_r = warpgroup_mma(kr_smem.index(z + 0), _value_half(kv_smem, z + _HALF_CHUNKS), o_r,
                                    is_async=True)  # PV0_R behind QK1
                s = warpgroup_mma_wait(1, deps=[s])  # QK1 done, PV0_R may still run
                p, a1, m1, rs1 = _softmax_step(s, m0, qk_scale, masked, TM, b, rows, row_ok, H,
                                               prefix, start, t_hi, s_tb, s_tn, q_smem.dtype,
                                               IS_CAUSAL)
                kr_smem.index(z + 1).store(p)  # QK1 was the rope chunk's only reader
                x_smem.slice(_XM1 * _BLOCK_M, _BLOCK_M).store(m1)
                x_smem.slice(_XA1 * _BLOCK_M, _BLOCK_M).store(a1)
                x_smem.slice(_XR1 * _BLOCK_M, _BLOCK_M).store(rs1)
                fence_async_shared()
                mbarrier.arrive(sy.index(_P1_FULL))
                o_r = warpgroup_mma_wait(0, deps=[o_r])
                mbarrier.arrive(kv_empty.index(_PR))  # slot 0 columns 256..511 + rope (P0)
                o_r = _rescale(o_r, a1)
                # P1 from registers: rope(1) (P1's copy in shared) is freed by WG0, its other reader
                o_r = warpgroup_mma(gl.convert_layout(p, _P_LAYOUT),
                                    _value_half(kv_smem, z + _SLOT1 + _HALF_CHUNKS), o_r)
                mbarrier.arrive(kv_empty.index(2 + _PR))  # slot 1 columns 256..511
            else:  # an odd last tile: PV0_R only; m1 = m0, a1 = 1, rowsum 0 to WG0
                mbarrier.wait(sy.index(_P0_FULL), ph)
                m0 = x_smem.slice(_XM0 * _BLOCK_M, _BLOCK_M).load(_ROW_LAYOUT)
                a0 = x_smem.slice(_XA0 * _BLOCK_M, _BLOCK_M).load(_ROW_LAYOUT)
                o_r = _rescale(o_r, a0)
                o_r = warpgroup_mma(kr_smem.index(z + 0), _value_half(kv_smem, z + _HALF_CHUNKS), o_r,
                                    is_async=True)
                x_smem.slice(_XM1 * _BLOCK_M, _BLOCK_M).store(m0)
                x_smem.slice(_XA1 * _BLOCK_M, _BLOCK_M).store(gl.full([_BLOCK_M], 1.0, gl.float32, _ROW_LAYOUT))
                x_smem.slice(_XR1 * _BLOCK_M, _BLOCK_M).store(gl.zeros([_BLOCK_M], gl.float32, _ROW_LAYOUT))
                fence_async_shared()
                mbarrier.arrive(sy.index(_P1_FULL))
                o_r = warpgroup_mma_wait(0, deps=[o_r])
                mbarrier.arrive(kv_empty.index(_PR))
        mbarrier.wait(sy.index(_L_FULL), 0)
        l_i = x_smem.slice(_XL * _BLOCK_M, _BLOCK_M).load(_ROW_LAYOUT)
        m_i = gl.zeros([_BLOCK_M], gl.float32, _ROW_LAYOUT)  # unused: WG0 stores the LSE
        # STAGE (v5c): Q's chunks 0..3 as the staging buffer: WG0 hands over l after its last QK
        _store_half(o_r, m_i, l_i, O, LSE, PO, PLSE, b, pid_m, pid_s, H, M, num_splits, _V_HALF,
                    s_ob, s_on, s_oh, s_lb, s_ln, _O_LAYOUT, DIRECT, False, _value_half(q_smem, 0),
                    STAGE)

    @gluon.jit
    def _load_part(kv_desc, kv_smem, kr_smem, bar, row0, first: gl.constexpr, dst: gl.constexpr,
                   rope_slot: gl.constexpr, WITH_ROPE: gl.constexpr):
        """4 value chunks (from column `first` x 64) into kv_smem dst.., [+ the rope chunk into
        kr_smem[rope_slot]] on one full barrier."""
        box_bytes: gl.constexpr = _BLOCK_N * _D_CHUNK * kv_desc.dtype.primitive_bitwidth // 8
        if WITH_ROPE:
            mbarrier.expect(bar, (_HALF_CHUNKS + 1) * box_bytes)
        else:
            mbarrier.expect(bar, _HALF_CHUNKS * box_bytes)
        for c in gl.static_range(_HALF_CHUNKS):
            tma.async_copy_global_to_shared(kv_desc, [row0, (first + c) * _D_CHUNK], bar,
                                            kv_smem.index(dst + c))
        if WITH_ROPE:
            tma.async_copy_global_to_shared(kv_desc, [row0, (_NUM_D - 1) * _D_CHUNK], bar,
                                            kr_smem.index(rope_slot))

    @gluon.jit
    def _loader_seesaw(kv_desc, q_desc, q_smem, qr_smem, kv_smem, kr_smem, kv_full, kv_empty, sy,
                       PT, PL, N, H, M, num_splits, s_ptb, PAGE_SIZE: gl.constexpr,
                       IS_CAUSAL: gl.constexpr, Q_TMA: gl.constexpr):
        """1 warp: [Q by TMA first], then per pair both page ids, then slot 0 part L, part R +
        rope, slot 1 part L + rope, part R, each as soon as its empty barrier lets it."""
        pid_m = gl.program_id(0)
        pid_s = gl.program_id(1)
        b = gl.program_id(2)
        box_bytes: gl.constexpr = _BLOCK_N * _D_CHUNK * kv_desc.dtype.primitive_bitwidth // 8
        if Q_TMA:  # rows past M: the next request's (finite, never stored) or zero-filled
            q_row = b * M + pid_m * _BLOCK_M
            q_full = sy.index(_Q_FULL)
            mbarrier.expect(q_full, _NUM_D * box_bytes)
            for c in gl.static_range(_NUM_D - 1):
                tma.async_copy_global_to_shared(q_desc, [q_row, c * _D_CHUNK], q_full, q_smem.index(c))
            tma.async_copy_global_to_shared(q_desc, [q_row, (_NUM_D - 1) * _D_CHUNK], q_full, qr_smem)
        prefix, lo, t_hi, n_full, n_tiles = _split_bounds(PL, N, H, num_splits, pid_m, pid_s, b,
                                                          IS_CAUSAL)
        pt_row = b.to(gl.int64) * s_ptb
        for k in range((n_tiles + 1) // 2):
            ph = k & 1
            start0 = lo + 2 * k * _BLOCK_N
            start1 = start0 + _BLOCK_N
            has1 = 2 * k + 1 < n_tiles
            page0 = gl.load(PT + pt_row + start0 // PAGE_SIZE)
            page1 = gl.load(PT + pt_row + start1 // PAGE_SIZE, mask=has1, other=0)
            row0 = page0 * PAGE_SIZE + start0 % PAGE_SIZE
            row1 = page1 * PAGE_SIZE + start1 % PAGE_SIZE
            mbarrier.wait(kv_empty.index(_PL), ph ^ 1)  # fresh barrier: passes at once
            _load_part(kv_desc, kv_smem, kr_smem, kv_full.index(_PL), row0, 0, 0, 0, False)
            mbarrier.wait(kv_empty.index(_PR), ph ^ 1)
            _load_part(kv_desc, kv_smem, kr_smem, kv_full.index(_PR), row0, _HALF_CHUNKS,
                       _HALF_CHUNKS, 0, True)
            if has1:
                mbarrier.wait(kv_empty.index(2 + _PL), ph ^ 1)
                _load_part(kv_desc, kv_smem, kr_smem, kv_full.index(2 + _PL), row1, 0, _SLOT1, 1,
                           True)
                mbarrier.wait(kv_empty.index(2 + _PR), ph ^ 1)
                _load_part(kv_desc, kv_smem, kr_smem, kv_full.index(2 + _PR), row1, _HALF_CHUNKS,
                           _SLOT1 + _HALF_CHUNKS, 1, False)

    @gluon.jit
    def _mla_split_kernel_v6(
        Q, kv_desc, q_desc, PT, PL, TM, O, LSE, PO, PLSE,
        qk_scale, H, N, M, num_splits,
        s_qb, s_qn, s_qh, s_ptb, s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln,
        PAGE_SIZE: gl.constexpr, IS_CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
        Q_TMA: gl.constexpr, STAGE: gl.constexpr, PDL: gl.constexpr = False,
    ):
        """v6 split kernel: grid (M tiles, splits, B), outputs as v5 (module docstring)."""
        dtype: gl.constexpr = kv_desc.dtype
        tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_smem = gl.allocate_shared_memory(dtype, [_NUM_D - 1, _BLOCK_M, _D_CHUNK], tile_layout)
        qr_smem = gl.allocate_shared_memory(dtype, [_BLOCK_M, _D_CHUNK], tile_layout)
        kv_smem = gl.allocate_shared_memory(dtype, [2 * (_NUM_D - 1), _BLOCK_N, _D_CHUNK],
                                            tile_layout)  # slot k's chunk c at k * 8 + c
        kr_smem = gl.allocate_shared_memory(dtype, [2, _BLOCK_N, _D_CHUNK], tile_layout)
        x_smem = gl.allocate_shared_memory(gl.float32, [8 * _BLOCK_M], vec_layout)  # row vectors _X*
        kv_full = gl.allocate_shared_memory(gl.int64, [4, 1], bar_layout)
        kv_empty = gl.allocate_shared_memory(gl.int64, [4, 1], bar_layout)
        sy = gl.allocate_shared_memory(gl.int64, [8, 1], bar_layout)
        pid_m = gl.program_id(0)
        b = gl.program_id(2)
        for j in gl.static_range(4):
            mbarrier.init(kv_full.index(j), count=1)
            mbarrier.init(kv_empty.index(j), count=1)  # one releaser a part
        for j in gl.static_range(_Q_FULL + 1):
            mbarrier.init(sy.index(j), count=1)
        if PDL:  # nothing global is read above this line
            _gdc_wait()
            _gdc_launch_dependents()
        if not Q_TMA:
            _load_q(Q, q_smem, qr_smem, b, pid_m, H, M, s_qb, s_qn, s_qh)
        fence_async_shared()
        gl.thread_barrier()
        gl.warp_specialize([
            (_wg0_seesaw, (q_smem, qr_smem, kv_smem, kr_smem, x_smem, kv_full, kv_empty, sy,
                           TM, PL, O, LSE, PO, PLSE, qk_scale, H, N, M, num_splits,
                           s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln, IS_CAUSAL, DIRECT, Q_TMA,
                           STAGE)),
            (_wg1_seesaw, (q_smem, qr_smem, kv_smem, kr_smem, x_smem, kv_full, kv_empty, sy,
                           TM, PL, O, LSE, PO, PLSE, qk_scale, H, N, M, num_splits,
                           s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln, IS_CAUSAL, DIRECT, Q_TMA,
                           STAGE)),
            (_loader_seesaw, (kv_desc, q_desc, q_smem, qr_smem, kv_smem, kr_smem, kv_full, kv_empty,
                              sy, PT, PL, N, H, M, num_splits, s_ptb, PAGE_SIZE, IS_CAUSAL, Q_TMA)),
        ], [4, 1], [_WG1_REGS, _LOADER_REGS])


def launch_v6(grid, q, kv_cache, page_table, prefix_lens, tm, out, lse, po, plse, sm_scale,
              h, n, m_rows, splits, tree_mask, direct, fine: bool = True,
              staged_store: bool = False, pdl: bool = False) -> None:
    """Launch `_mla_split_kernel_v6`: arguments and semantics as `launch_v5` (the caller has
    checked `supported` and planned the splits for 64 x 64 tiles). `fine` is accepted for the
    same signature (v6 always releases per part); `staged_store`: v5c's epilogue; `pdl`:
    programmatic dependent launch, as v5."""
    from treeflash.kernels.mla_verify import LOG2E

    page_size = kv_cache.shape[1]
    q_tma = _q_rows_tma_ok(q)
    desc, q_desc = tma_descriptors(q, kv_cache, n, h, q_tma)
    _mla_split_kernel_v6[grid](
        q, desc, q_desc, page_table, prefix_lens, tm, out, lse, po, plse,
        float(sm_scale) * LOG2E, h, n, m_rows, splits,
        q.stride(0), q.stride(1), q.stride(2), page_table.stride(0),
        0 if tree_mask is None else n * n, 0 if tree_mask is None else n,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        PAGE_SIZE=page_size, IS_CAUSAL=tree_mask is None, DIRECT=direct, Q_TMA=q_tma,
        STAGE=staged_store, num_warps=NUM_WARPS,
        **({"PDL": True, "launch_pdl": True} if pdl else {}),
    )


__all__ = ["launch_v6", "supported"]
