"""Probe: how fast can TMA fill a CTA's shared-memory ring from L2 when M tiles share key tiles?

A measurement kernel, not used by the verify path (benchmarks/lab/probe_fill.py sweeps it). It keeps
exactly the loader machinery of `mla_verify_v5.py` (1-warp loader partition, 9 TMA boxes of
TILE_KEYS x 64 with 128-byte swizzle a tile, mbarriers full / empty, `expect` of the tile's bytes)
and replaces the compute by something whose cost is controlled:

- grid (m_tiles, splits): the CTAs (pid_m, s) for every pid_m read the same keys
  [s * chunk, (s + 1) * chunk) of a bf16 [rows, 576] tensor (the KV cache viewed flat), so
  m_tiles = how many CTAs read each tile (the first from HBM, the others hit in L2), as the
  verify kernel's M tiles of one split. pid_m is the fastest grid axis, as in the real launch,
  so the readers of a split are resident at the same time.
- ring: NUM_SLOTS slots of TILE_KEYS x 576 bf16 (a slot's 9 boxes: 8 "value" chunks at
  kv_smem[slot * 8 + c] and the rope chunk at kr_smem[slot], the v5 layout).
- Q_RES (constexpr): a resident 64 x 576 bf16 buffer (72 KB, v5's Q: 8 chunks + 1), brought by
  TMA by the loader before the first tile (v5b's Q by TMA through `q_desc`, a [64, 64] box over
  the same tensor; 9 boxes of rows 0..63, L2 hits after
  the first CTA; not counted as streamed bytes) so it also keeps one CTA a SM.
- consumer (the default partition, 4 warps = 1 warpgroup) per tile: wait full, then
  * MMA = False: spin `spin` SM clocks: an inline-PTX loop on %clock64 (read, then re-read until
    the difference reaches `spin`; scoped labels inside `{}`), executed by every thread, issued
    only when spin > 0. It issues no memory traffic: the pure fill rate with a fixed
    "compute" time a tile.
  * MMA = True (needs Q_RES): the real tensor work of one tile as v5 does it, in one warpgroup:
    QK = 9 wgmma 64 x TILE_KEYS x 64 with Q and K both from shared memory, then PV as two
    wgmma 64 x 256 x TILE_KEYS with P (bf16, registers; the previous tile's, ~0) x V halves from
    shared memory, all async, one wait a tile (2176 tensor clk a 64-key tile at peak). This adds
    the wgmma operand reads of shared memory (QK: 4 KB / 32 clk at N = 64 = 128 B/clk, the SM's
    whole shared-memory bandwidth) on top of the TMA writes, which the spin mode does not have.
    Then `spin` more clocks if spin > 0 (the sweep runs MMA with spin 0).
  then arrive empty (count 1).
- the loader waits empty (fresh barrier: passes at once), expects the tile's bytes, issues the 9
  boxes. Out-of-range splits (chunk rounding) do nothing.
SINK gets one int32 a CTA (the tiles it consumed), so nothing is dead code.
"""

from __future__ import annotations

try:
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
except Exception:  # noqa: BLE001 - no Gluon: only --dry-run works
    gluon = None

D = 576
D_CHUNK = 64
NUM_D = 9
Q_ROWS = 64
V_HALF = 256
NUM_WARPS = 4
SMEM_LIMIT = 232448  # bytes a block may have on sm_90


def smem_estimate(tile_keys: int, num_slots: int, q_res: bool) -> int:
    """Bytes of shared memory the kernel asks for (ring + Q + barriers, before alignment)."""
    return num_slots * tile_keys * D * 2 + (Q_ROWS * D * 2 if q_res else 0) + 16 * num_slots + 8


if gluon is not None:
    _D_CHUNK = gl.constexpr(D_CHUNK)
    _NUM_D = gl.constexpr(NUM_D)
    _Q_ROWS = gl.constexpr(Q_ROWS)
    _V_HALF = gl.constexpr(V_HALF)
    _NUM_WARPS = gl.constexpr(NUM_WARPS)

    @gluon.jit
    def _spin(cycles):
        """Busy-wait `cycles` SM clocks (%clock64) in every thread; returns 0."""
        return gl.inline_asm_elementwise(
            """{
            .reg .u64 t0, t1, lim;
            .reg .pred p;
            cvt.u64.u32 lim, $1;
            mov.u64 t0, %clock64;
            SPIN_LOOP:
            mov.u64 t1, %clock64;
            sub.u64 t1, t1, t0;
            setp.lt.u64 p, t1, lim;
            @p bra SPIN_LOOP;
            mov.u32 $0, 0;
            }""",
            "=r,r", [cycles], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _bounds(total_keys, chunk, TILE_KEYS: gl.constexpr):
        pid_s = gl.program_id(1)
        lo = pid_s * chunk
        hi = gl.minimum(lo + chunk, total_keys)
        n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), TILE_KEYS)
        return lo, n_tiles

    @gluon.jit
    def _probe_loader(kv_desc, q_desc, kv_smem, kr_smem, q_smem, qr_smem, q_full, kv_full, kv_empty,
                      total_keys, chunk, TILE_KEYS: gl.constexpr, NUM_SLOTS: gl.constexpr,
                      Q_RES: gl.constexpr):
        """1 warp: [Q's 9 boxes into the resident buffer], then per tile 9 TMA boxes into slot
        i % NUM_SLOTS after its empty barrier (v5's `_loader` with a flat row index)."""
        lo, n_tiles = _bounds(total_keys, chunk, TILE_KEYS)
        if Q_RES:
            mbarrier.expect(q_full, _NUM_D * _Q_ROWS * _D_CHUNK * 2)
            for c in gl.static_range(_NUM_D - 1):
                tma.async_copy_global_to_shared(q_desc, [0, c * _D_CHUNK], q_full, q_smem.index(c))
            tma.async_copy_global_to_shared(q_desc, [0, (_NUM_D - 1) * _D_CHUNK], q_full, qr_smem)
        tile_bytes: gl.constexpr = _NUM_D * TILE_KEYS * _D_CHUNK * 2
        for i in range(n_tiles):
            slot = i % NUM_SLOTS
            phase = (i // NUM_SLOTS) & 1
            mbarrier.wait(kv_empty.index(slot), phase ^ 1)  # fresh barrier: passes at once
            row0 = lo + i * TILE_KEYS
            mbarrier.expect(kv_full.index(slot), tile_bytes)
            for c in gl.static_range(_NUM_D - 1):
                tma.async_copy_global_to_shared(kv_desc, [row0, c * _D_CHUNK], kv_full.index(slot),
                                                kv_smem.index(slot * (_NUM_D - 1) + c))
            tma.async_copy_global_to_shared(kv_desc, [row0, (_NUM_D - 1) * _D_CHUNK],
                                            kv_full.index(slot), kr_smem.index(slot))

    @gluon.jit
    def _probe_consumer(kv_smem, kr_smem, q_smem, qr_smem, q_full, kv_full, kv_empty, SINK,
                        total_keys, chunk, spin, TILE_KEYS: gl.constexpr, NUM_SLOTS: gl.constexpr,
                        Q_RES: gl.constexpr, MMA: gl.constexpr):
        """1 warpgroup: per tile wait full, [the tile's QK + PV wgmma], [spin], arrive empty."""
        lo, n_tiles = _bounds(total_keys, chunk, TILE_KEYS)
        acc = gl.zeros([1], gl.int32, gl.BlockedLayout([1], [32], [_NUM_WARPS], [0]))
        if Q_RES:
            mbarrier.wait(q_full, 0)
        if MMA:
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[_NUM_WARPS, 1], instr_shape=[16, TILE_KEYS, 16])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[_NUM_WARPS, 1], instr_shape=[16, _V_HALF, 16])
            p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
            s_zero = gl.zeros([_Q_ROWS, TILE_KEYS], gl.float32, s_layout)
            o = gl.zeros([_Q_ROWS, _V_HALF], gl.float32, o_layout)
            p = gl.zeros([_Q_ROWS, TILE_KEYS], kv_smem.dtype, p_layout)
        for i in range(n_tiles):
            slot = i % NUM_SLOTS
            mbarrier.wait(kv_full.index(slot), (i // NUM_SLOTS) & 1)
            if MMA:
                base = slot * (_NUM_D - 1)
                s = warpgroup_mma(q_smem.index(0), kv_smem.index(base).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
                for c in gl.static_range(1, _NUM_D - 1):
                    s = warpgroup_mma(q_smem.index(c), kv_smem.index(base + c).permute((1, 0)), s,
                                      is_async=True)
                s = warpgroup_mma(qr_smem, kr_smem.index(slot).permute((1, 0)), s, is_async=True)
                # PV with the previous tile's P (as v5 issues PV(i - 1) beside QK(i)): the tensor
                # pipe gets QK and PV back to back, one drain a tile
                for h in gl.static_range(2):  # V columns 0..255, 256..511: 4 chunks each
                    part = kv_smem.index(base + h * 4)
                    v = part._reinterpret(kv_smem.dtype, [TILE_KEYS, _V_HALF], part.layout)
                    o = warpgroup_mma(p, v, o, is_async=True)
                s, o = warpgroup_mma_wait(0, deps=[s, o])
                # fold S into P so the QK result is live (P stays ~0: S * 0)
                p = (gl.convert_layout(s, p_layout) * 0.0).to(kv_smem.dtype)
            if spin > 0:
                acc += _spin(spin)
            mbarrier.arrive(kv_empty.index(slot))
        if MMA:
            acc += gl.max(gl.max(o, 1), 0).to(gl.int32)
        pid = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        offs = gl.arange(0, 1, layout=gl.BlockedLayout([1], [32], [_NUM_WARPS], [0]))
        gl.store(SINK + pid + offs, acc + n_tiles)

    @gluon.jit
    def probe_fill_kernel(kv_desc, q_desc, SINK, total_keys, chunk, spin,
                          TILE_KEYS: gl.constexpr, NUM_SLOTS: gl.constexpr, Q_RES: gl.constexpr,
                          MMA: gl.constexpr):
        """grid (m_tiles, splits): split s streams keys [s * chunk, min((s + 1) * chunk,
        total_keys)) through the ring; module docstring."""
        dtype: gl.constexpr = kv_desc.dtype
        tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                          rank=2)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        kv_smem = gl.allocate_shared_memory(dtype, [NUM_SLOTS * (_NUM_D - 1), TILE_KEYS, _D_CHUNK],
                                            tile_layout)
        kr_smem = gl.allocate_shared_memory(dtype, [NUM_SLOTS, TILE_KEYS, _D_CHUNK], tile_layout)
        if Q_RES:
            q_smem = gl.allocate_shared_memory(dtype, [_NUM_D - 1, _Q_ROWS, _D_CHUNK], tile_layout)
            qr_smem = gl.allocate_shared_memory(dtype, [_Q_ROWS, _D_CHUNK], tile_layout)
        else:  # unused stand-ins (the loader / consumer never touch them without Q_RES)
            q_smem = kv_smem
            qr_smem = kr_smem
        kv_full = gl.allocate_shared_memory(gl.int64, [NUM_SLOTS, 1], bar_layout)
        kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_SLOTS, 1], bar_layout)
        q_full = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        for k in gl.static_range(NUM_SLOTS):
            mbarrier.init(kv_full.index(k), count=1)
            mbarrier.init(kv_empty.index(k), count=1)
        mbarrier.init(q_full, count=1)
        fence_async_shared()
        gl.thread_barrier()
        gl.warp_specialize([
            (_probe_consumer, (kv_smem, kr_smem, q_smem, qr_smem, q_full, kv_full, kv_empty, SINK,
                               total_keys, chunk, spin, TILE_KEYS, NUM_SLOTS, Q_RES, MMA)),
            (_probe_loader, (kv_desc, q_desc, kv_smem, kr_smem, q_smem, qr_smem, q_full, kv_full, kv_empty,
                             total_keys, chunk, TILE_KEYS, NUM_SLOTS, Q_RES)),
        ], [1], [24])


def make_desc(flat, tile_keys: int):
    """TMA descriptor over a bf16 [rows, 576] tensor with a [tile_keys, 64] box (128B swizzle)."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return GluonTensorDescriptor(flat, list(flat.shape), [flat.stride(0), 1], [tile_keys, D_CHUNK],
                                 layout)


def launch(flat, sink, m_tiles: int, splits: int, chunk: int, spin: int, tile_keys: int,
           num_slots: int, q_res: bool, mma: bool = False) -> None:
    """One probe launch over all rows of `flat` (bf16 [rows, 576], rows >= 64)."""
    assert not mma or q_res, "MMA mode reads Q from the resident buffer"
    desc = make_desc(flat, tile_keys)
    q_desc = desc if tile_keys == Q_ROWS else make_desc(flat, Q_ROWS)  # Q: [64, 64] boxes
    probe_fill_kernel[(m_tiles, splits)](desc, q_desc, sink, flat.shape[0], chunk, spin,
                                         TILE_KEYS=tile_keys, NUM_SLOTS=num_slots, Q_RES=q_res,
                                         MMA=mma, num_warps=NUM_WARPS)


__all__ = ["launch", "probe_fill_kernel", "smem_estimate", "SMEM_LIMIT"]
