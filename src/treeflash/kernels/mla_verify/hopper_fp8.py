"""The Hopper MLA verify kernel over fp8_e4m3 rows (`kvcache.format`): the 16-bit kernel of
`hopper.py` (its WG0 unchanged) with the value tiles decoded in shared memory by WG1.

A 64-key tile of fp8 rows is 64 x 656 bytes: the e4m3 codes of c_kv (512 B a row), four fp32
scales (16 B) and k_pe in bf16 (128 B), 0.57 of the bf16 tile. The tensor cores multiply bf16,
so the codes are decoded into the same ring the 16-bit kernel streams, and everything after
the ring (QK, the softmax, PV, the staged stores, the combine) is `hopper.py`'s:

- the loader warp brings Q by TMA (as there) and each tile's k_pe by TMA straight into the
  slot's rope chunk (a bf16 box over the rows' bytes 528..655: 16-byte aligned, stride 656);
- WG1 (4 warps) loads each tile's codes and scales with 16-byte loads, one tile ahead of its
  decode (registers: 64 a thread for the codes of the tile in flight, 16 for its scales, beside
  its 128 of O_hi), decodes code x scale to bf16 and stores the value chunks into the slot
  (columns 256..511 first, then 0..255: the order WG0's QK waits for them), each half released
  to WG0 with a fence and one arrive on the slot's full barrier of that part; rows past the
  split's last key are decoded as zeros (masked loads), so no NaN of an unused slot reaches PV;
- WG1 decodes tile i + 1 before its PV of tile i: the decode runs beside WG0's QK and softmax
  of tile i, off WG0's chain (QK -> softmax -> PV_lo -> next QK), on issue slots WG1 leaves
  idle in the 16-bit kernel (there it only runs PV_hi).

The ring, Q, P and their barriers are the 16-bit kernel's (230 KB of shared memory); the codes
never pass through shared memory undecoded (no room beside two 72 KB slots and Q). Bytes read a
64-key tile: 41984 (the fp8 floor) against 73728.

Supported (`supported`): CUDA sm_90 with Gluon and the interpreter off, bf16 q, fp8_e4m3 rows of
D 576 / v_dim 512 (656 bytes) in a [pages, page_size, 656] uint8 cache with page_size % 64 ==
0 and 16-byte aligned rows, sm_scale > 0.
"""

from __future__ import annotations

import torch
import triton

from treeflash.kernels.mla_verify import hopper
from treeflash.kernels.mla_verify.plan import Call
from treeflash.kvcache.format import fp8_rope_offset, fp8_row_bytes

V_DIM, D = 512, 576
ROW_BYTES = fp8_row_bytes(D, V_DIM)  # 656
ROPE_OFF = fp8_rope_offset(V_DIM)  # 528
GROUP = 128  # codes a scale covers: two 64-column chunks of the ring


def supported(q: torch.Tensor, kv_cache: torch.Tensor, v_dim: int, sm_scale: float) -> bool:
    """Whether this kernel can run this call (module docstring)."""
    if not hopper.available(q.device) or not sm_scale > 0:
        return False
    return (q.dtype == torch.bfloat16 and kv_cache.dtype == torch.uint8 and q.shape[-1] == D
            and v_dim == V_DIM and kv_cache.dim() == 3 and kv_cache.shape[2] == ROW_BYTES
            and kv_cache.shape[1] % hopper.BLOCK_N == 0 and kv_cache.stride(2) == 1
            and kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.stride(1)
            and kv_cache.stride(1) % 16 == 0 and kv_cache.data_ptr() % 16 == 0)


if hopper.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
    )

    from treeflash.kernels.mla_verify.hopper import (
        _BLOCK_M,
        _BLOCK_N,
        _D_CHUNK,
        _HI,
        _LO,
        _NUM_BUF,
        _NUM_D,
        _NUM_WARPS,
        _O_LAYOUT,
        _PARTS,
        _ROPE,
        _V_HALF,
        _issue_q,
        _load_q,
        _softmax_wg,
        _split_bounds,
        _store_half,
        _value_half,
    )

    _ROW_WORDS = gl.constexpr(ROW_BYTES // 4)  # 164 int32 a row
    _V_DIM = gl.constexpr(V_DIM)
    _GROUP = gl.constexpr(GROUP)
    # WG1's layout of a group's codes as words, [64 rows, 32 int32] = [64, 128] codes: 16 bytes a
    # thread (one 16-byte load), 8 threads a row's 128 bytes, 16 rows a step of the 4 warps. Words,
    # not bytes: a uint8 tensor holds a register a byte, so a tile of codes in flight took 256
    # registers a thread (ptxas spilled 1.9 KB a thread); as words it is 64.
    _WORD_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [_NUM_WARPS.value, 1], [1, 0]))

    @gluon.jit
    def _fetch(KV8, PT, pt_row, start, t_hi, PAGE_SIZE: gl.constexpr):
        """The tile at `start`: its four groups' codes ([64, 32] int32 each: 4 codes a word, the
        first in the low byte) and scales ([64] fp32 each), rows at positions >= t_hi as zeros
        (nothing read for them; a tile wholly past t_hi reads nothing, not even its page id)."""
        live = start < t_hi
        page = gl.load(PT + pt_row + start // PAGE_SIZE, mask=live, other=0)
        row0 = page.to(gl.int64) * PAGE_SIZE + start % PAGE_SIZE
        r = gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, _WORD_LAYOUT))
        w = gl.arange(0, _GROUP // 4, layout=gl.SliceLayout(0, _WORD_LAYOUT))
        ok = start + r < t_hi
        row = (row0 + r) * _ROW_WORDS  # [64] the rows' first words
        ptrs = KV8.to(gl.pointer_type(gl.int32)) + gl.expand_dims(row, 1) + gl.expand_dims(w, 0)
        ok2 = gl.expand_dims(ok, 1)
        c0 = gl.load(ptrs, mask=ok2, other=0)
        c1 = gl.load(ptrs + _GROUP // 4, mask=ok2, other=0)
        c2 = gl.load(ptrs + 2 * _GROUP // 4, mask=ok2, other=0)
        c3 = gl.load(ptrs + 3 * _GROUP // 4, mask=ok2, other=0)
        sc = KV8.to(gl.pointer_type(gl.float32)) + row + _V_DIM // 4
        s0 = gl.load(sc, mask=ok, other=0.0)
        s1 = gl.load(sc + 1, mask=ok, other=0.0)
        s2 = gl.load(sc + 2, mask=ok, other=0.0)
        s3 = gl.load(sc + 3, mask=ok, other=0.0)
        return c0, c1, c2, c3, s0, s1, s2, s3

    @gluon.jit
    def _decode_words(words, scale):
        """Four e4m3 codes a word (the first in the low byte) times scale, each as bf16: the
        hardware's e4m3x2 -> f16x2 conversion (exact), f32 products rounded to nearest even."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b16 lo, hi, f0, f1, f2, f3;
            .reg .b32 h01, h23, p01, p23;
            .reg .f32 x0, x1, x2, x3;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 h01, lo;
            cvt.rn.f16x2.e4m3x2 h23, hi;
            mov.b32 {f0, f1}, h01;
            mov.b32 {f2, f3}, h23;
            cvt.f32.f16 x0, f0;
            cvt.f32.f16 x1, f1;
            cvt.f32.f16 x2, f2;
            cvt.f32.f16 x3, f3;
            mul.rn.f32 x0, x0, $5;
            mul.rn.f32 x1, x1, $5;
            mul.rn.f32 x2, x2, $5;
            mul.rn.f32 x3, x3, $5;
            cvt.rn.bf16x2.f32 p01, x1, x0;
            cvt.rn.bf16x2.f32 p23, x3, x2;
            mov.b32 {$0, $1}, p01;
            mov.b32 {$2, $3}, p23;
            }""",
            "=h,=h,=h,=h,r,r", [words, scale], dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
            is_pure=True, pack=1)

    @gluon.jit
    def _decode_group(kv_smem, chunk, words, scales):
        """A group's codes [64, 32 words] x their rows' scale -> bf16 [64, 128] into ring chunks
        chunk, chunk + 1 (one [64, 128] view of two consecutive 128-byte-swizzled [64, 64]
        chunks, as `_value_half`). Code k of word w is column 4 w + k."""
        b0, b1, b2, b3 = _decode_words(words, gl.expand_dims(scales, 1))
        x = gl.reshape(gl.join(gl.join(b0, b2), gl.join(b1, b3)), [_BLOCK_N, _GROUP])
        part = kv_smem.index(chunk)
        dst = part._reinterpret(kv_smem.dtype, [_BLOCK_N, _GROUP], part.layout)
        dst.store(x)

    @gluon.jit
    def _produce(kv_smem, kv_full, kv_empty, c0, c1, c2, c3, s0, s1, s2, s3, j):
        """Tile j's value chunks into ring slot j % 2: columns 256..511 once PV_hi(j - 2) freed
        them, then 0..255 once PV_lo(j - 2) did, each half released by one arrive after every
        thread's stores are fenced for the tensor cores' (async) reads."""
        slot = j % _NUM_BUF
        phase = (j // _NUM_BUF) & 1
        bar = slot * _PARTS
        base = slot * (_NUM_D - 1)
        mbarrier.wait(kv_empty.index(bar + _HI), phase ^ 1)
        _decode_group(kv_smem, base + 4, c2, s2)
        _decode_group(kv_smem, base + 6, c3, s3)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(kv_full.index(bar + _HI))
        mbarrier.wait(kv_empty.index(bar + _LO), phase ^ 1)
        _decode_group(kv_smem, base, c0, s0)
        _decode_group(kv_smem, base + 2, c1, s1)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(kv_full.index(bar + _LO))

    @gluon.jit
    def _fp8_loader(rope_desc, q_desc, q_smem, qr_smem, q_full, kr_smem, kv_full, kv_empty,
                    PT, PL, N, H, M, num_splits, s_ptb, PAGE_SIZE: gl.constexpr,
                    IS_CAUSAL: gl.constexpr, Q_TMA: gl.constexpr):
        """The loader warp: [Q by TMA on q_full], then each tile's k_pe (one bf16 TMA box over the
        rows' rope bytes) into its slot's rope chunk as soon as QK freed it."""
        pid_m = gl.program_id(0)
        pid_s = gl.program_id(1)
        b = gl.program_id(2)
        box_bytes: gl.constexpr = _BLOCK_N * _D_CHUNK * rope_desc.dtype.primitive_bitwidth // 8
        if Q_TMA:
            _issue_q(q_desc, q_smem, qr_smem, q_full, b, pid_m, M)
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
            mbarrier.wait(kv_empty.index(bar + _ROPE), phase ^ 1)
            mbarrier.expect(kv_full.index(bar + _ROPE), box_bytes)
            tma.async_copy_global_to_shared(rope_desc, [row0, 0], kv_full.index(bar + _ROPE),
                                            kr_smem.index(slot))

    @gluon.jit
    def _fp8_pv_hi_wg(KV8, kv_smem, q_smem, p_smem, a_smem, kv_full, kv_empty, p_full, p_empty,
                      PT, PL, O, LSE, PO, PLSE, H, N, M, num_splits, s_ptb, s_ob, s_on, s_oh,
                      s_lb, s_ln, PAGE_SIZE: gl.constexpr, IS_CAUSAL: gl.constexpr,
                      DIRECT: gl.constexpr):
        """WG1: decodes tile i + 1 into the ring (`_produce`, its codes loaded one iteration
        ahead), then O_hi = alpha O_hi + P V[:, 256:512] of tile i, as `hopper._pv_hi_wg`."""
        o_layout: gl.constexpr = _O_LAYOUT
        a_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        pid_m = gl.program_id(0)
        pid_s = gl.program_id(1)
        b = gl.program_id(2)
        prefix, lo, t_hi, n_full, n_tiles = _split_bounds(PL, N, H, num_splits, pid_m, pid_s, b,
                                                          IS_CAUSAL)
        pt_row = b.to(gl.int64) * s_ptb
        c0, c1, c2, c3, s0, s1, s2, s3 = _fetch(KV8, PT, pt_row, lo, t_hi, PAGE_SIZE)
        if n_tiles > 0:
            _produce(kv_smem, kv_full, kv_empty, c0, c1, c2, c3, s0, s1, s2, s3, 0)
        c0, c1, c2, c3, s0, s1, s2, s3 = _fetch(KV8, PT, pt_row, lo + _BLOCK_N, t_hi, PAGE_SIZE)
        o_hi = gl.zeros([_BLOCK_M, _V_HALF], gl.float32, o_layout)
        for i in range(n_tiles):
            if i + 1 < n_tiles:
                _produce(kv_smem, kv_full, kv_empty, c0, c1, c2, c3, s0, s1, s2, s3, i + 1)
                c0, c1, c2, c3, s0, s1, s2, s3 = _fetch(KV8, PT, pt_row, lo + (i + 2) * _BLOCK_N,
                                                        t_hi, PAGE_SIZE)
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
        _store_half(o_hi, m_i, l_i, O, LSE, PO, PLSE, b, pid_m, pid_s, H, M, num_splits, _V_HALF,
                    s_ob, s_on, s_oh, s_lb, s_ln, o_layout, DIRECT, False, _value_half(q_smem, 0))

    @gluon.jit
    def _hopper_fp8_kernel(
        Q, KV8, rope_desc, q_desc, PT, PL, TM, O, LSE, PO, PLSE,
        qk_scale, H, N, M, num_splits,
        s_qb, s_qn, s_qh, s_ptb, s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln,
        PAGE_SIZE: gl.constexpr, IS_CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
        Q_TMA: gl.constexpr,
    ):
        """Grid (M tiles, splits, B), outputs as `hopper._hopper_kernel`'s; the shared memory and
        barriers are its own, WG0 is its `_softmax_wg`, the loader and WG1 are the fp8 ones
        above. KV8: the cache's bytes; rope_desc: bf16 [64, 64] boxes over its k_pe bytes
        (also q_desc where Q is not one TMA row block: unused then)."""
        dtype: gl.constexpr = rope_desc.dtype
        tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_smem = gl.allocate_shared_memory(dtype, [_NUM_D - 1, _BLOCK_M, _D_CHUNK], tile_layout)
        qr_smem = gl.allocate_shared_memory(dtype, [_BLOCK_M, _D_CHUNK], tile_layout)
        kv_smem = gl.allocate_shared_memory(dtype, [_NUM_BUF * (_NUM_D - 1), _BLOCK_N, _D_CHUNK],
                                            tile_layout)
        kr_smem = gl.allocate_shared_memory(dtype, [_NUM_BUF, _BLOCK_N, _D_CHUNK], tile_layout)
        p_smem = gl.allocate_shared_memory(dtype, [_BLOCK_M, _BLOCK_N], tile_layout)
        a_smem = gl.allocate_shared_memory(gl.float32, [_BLOCK_M], vec_layout)
        pid_m = gl.program_id(0)
        b = gl.program_id(2)
        kv_full = gl.allocate_shared_memory(gl.int64, [_NUM_BUF * _PARTS, 1], bar_layout)
        kv_empty = gl.allocate_shared_memory(gl.int64, [_NUM_BUF * _PARTS, 1], bar_layout)
        p_full = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        p_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        q_full = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        for k in gl.static_range(_NUM_BUF):
            for part in gl.static_range(_LO + 1):
                mbarrier.init(kv_full.index(k * _PARTS + part), count=1)
                mbarrier.init(kv_empty.index(k * _PARTS + part), count=1)
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
            (_fp8_pv_hi_wg, (KV8, kv_smem, q_smem, p_smem, a_smem, kv_full, kv_empty, p_full,
                             p_empty, PT, PL, O, LSE, PO, PLSE, H, N, M, num_splits, s_ptb,
                             s_ob, s_on, s_oh, s_lb, s_ln, PAGE_SIZE, IS_CAUSAL, DIRECT)),
            (_fp8_loader, (rope_desc, q_desc, q_smem, qr_smem, q_full, kr_smem, kv_full, kv_empty,
                           PT, PL, N, H, M, num_splits, s_ptb, PAGE_SIZE, IS_CAUSAL, Q_TMA)),
        ], [4, 1], [232, 24])  # setmaxnreg: WG1 232, the loader 24 (WG0 256: 512 in all)


def descriptors(q: torch.Tensor, kv_cache: torch.Tensor, n: int, h: int, q_tma: bool):
    """(rope descriptor, Q descriptor): bf16 [64, 64] boxes (128-byte swizzle) over the k_pe bytes
    528..655 of every row of the [pages x page_size, 656] view, and over q's rows as
    `hopper.tma_descriptors` makes them (else the rope descriptor again, unused)."""
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    flat = kv_cache.view(rows, ROW_BYTES)
    rope = flat[:, ROPE_OFF:ROPE_OFF + 2 * (D - V_DIM)].view(torch.bfloat16)  # [rows, 64], stride 328
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    desc = hopper.GluonTensorDescriptor(rope, list(rope.shape), [rope.stride(0), 1],
                                        [hopper.BLOCK_N, hopper.D_CHUNK], layout)
    q_desc = desc
    if q_tma:
        q_flat = hopper._row_view(q, q.shape[0] * n * h, q.stride(2))
        q_desc = hopper.GluonTensorDescriptor(q_flat, list(q_flat.shape), [q_flat.stride(0), 1],
                                              [hopper.BLOCK_M, hopper.D_CHUNK], layout)
    return desc, q_desc


def launch(call: Call) -> None:
    """Launch `_hopper_fp8_kernel` for `call` (the caller checked `supported` and planned the
    splits for 64 x 64 tiles)."""
    c, q = call, call.q
    q_tma = hopper._q_rows_tma_ok(q)
    rope_desc, q_desc = descriptors(q, c.kv_cache, c.n, c.h, q_tma)
    grid = (triton.cdiv(c.m_rows, hopper.BLOCK_M), c.splits, q.shape[0])
    _hopper_fp8_kernel[grid](
        q, c.kv_cache, rope_desc, q_desc, c.page_table, c.prefix_lens, c.tm, c.out, c.lse, c.po,
        c.plse, c.qk_scale, c.h, c.n, c.m_rows, c.splits,
        q.stride(0), q.stride(1), q.stride(2), c.page_table.stride(0), *c.mask_strides(),
        *c.out_strides(), PAGE_SIZE=c.kv_cache.shape[1], IS_CAUSAL=c.tree_mask is None,
        DIRECT=c.direct, Q_TMA=q_tma, num_warps=hopper.NUM_WARPS,
    )
