"""The operands of the W4A16 MMA kernels (`mma.py`), built in registers: the mma.sync fragments'
layouts, the INT4 word's unpack into 16-bit pairs (inline PTX on the GPU, Triton ops of the same
rounding under the interpreter), the K loops that load and multiply a step's words (INT4 routed
experts, 16-bit shared experts), and the rows' addressing.

The product is swapped, acc^T [rows, BM] = W_tile @ x_cols^T: the weight rows are the MMA's M,
a block's BM routed pairs (8: one n8 tile) its N. Operand layout (mma.sync m16n8k16 with
k_width 8): lane (g, c) = (lane / 4, lane % 4) of warp w holds rows 16 w + g (+ 8, + 16 W r)
and, in each 32-long K block j of a step, K = 32 j + 8 c + t (t = 0..7): one packed word a row
and block. The dot's K order is free so long as x follows it: the kernel's slot s = 4 j + c
reads memory word c * NJ + j of the step (NJ blocks a step), so a thread's NJ words of a row
are one 16-byte load, and x's 8 NJ values for that thread one contiguous run (64 bytes at NJ 4).
With a group of 32 (GW 4 words) a thread's words of a step share one scale a row.
"""

from __future__ import annotations

import torch
import triton.language as tl

from treeflash.kernels import gluon_interp

gl, jit, mma_v2, constexpr_function = gluon_interp.language()

# One word -> 8 values (q - 8) * scale in the 16-bit type, natural order, as `portable._UNPACK_ASM`
# but for pack=8: $4..$11 the word 8 times (join copies), $12..$15 the scale pair 4 times, $16..
# the magic 8 times; outputs $0..$3 = values (0, 1), (2, 3), (4, 5), (6, 7).
_ASM = """{
.reg .b32 v, u, one, nbias, nzero;
mov.b32 one, ONE;
mov.b32 nbias, NBIAS;
mov.b32 nzero, 0x80008000;
shr.b32 v, $4, 4;
"""
for _m in range(4):
    _ASM += (f"prmt.b32 u, $4, v, {_m | (4 + _m) << 8:#x};\nlop3.b32 u, u, 0x000F000F, $16, 0xEA;\n"
             f"fma.rn.T u, u, one, nbias;\nfma.rn.T ${_m}, u, $12, nzero;\n")
_ASM += "}"
UNPACK8_PTX = {  # dtype: (asm, magic pair)
    torch.bfloat16: (_ASM.replace("T ", "bf16x2 ").replace("ONE", "0x3F803F80").replace("NBIAS", "0xC308C308"),
                     0x43004300),
    torch.float16: (_ASM.replace("T ", "f16x2 ").replace("ONE", "0x3C003C00").replace("NBIAS", "0xE408E408"),
                    0x64006400),
}
_ASM_BF16 = gl.constexpr(UNPACK8_PTX[torch.bfloat16][0])
_ASM_F16 = gl.constexpr(UNPACK8_PTX[torch.float16][0])
_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 20))
_MOV = gl.constexpr("mov.b32 $0, $1;")


# ---------------------------------------------------------------- layouts (compile time)
@constexpr_function
def _mma(warps):
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])


@constexpr_function
def _dot(warps, index):
    """The mma.sync operand (0: the weights, 1: x) with 8 consecutive K a thread."""
    return gl.DotOperandLayout(operand_index=index, parent=gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8]), k_width=8)


@constexpr_function
def _words(warps, rows, nj, pairs):
    """Weight words [rows, 4 (c), nj (j)] (pairs: [.., 4 (u)] int32 pairs of 16-bit weights, 8
    values a word-slot): a thread's registers are its nj (x 4) words of a row, then row + 8, then
    row + 16 warps x r; lanes (c, g); warps 16-row groups. `_dot(warps, 0)` after the unpack."""
    z = [0] if pairs else []
    reg = ([[0, 0, 0, 1], [0, 0, 0, 2]] if pairs else []) + [[0, 0, 1 << i] + z for i in range(nj.bit_length() - 1)]
    reg += [[8, 0, 0] + z] + [[16 * warps << i, 0, 0] + z for i in range((rows // (16 * warps)).bit_length() - 1)]
    lane = [[0, 1, 0] + z, [0, 2, 0] + z, [1, 0, 0] + z, [2, 0, 0] + z, [4, 0, 0] + z]
    warp = [[16 << i, 0, 0] + z for i in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [rows, 4, nj] + ([4] if pairs else []))


@constexpr_function
def _xwords(warps, nj, bm):
    """x as int32 pairs [4 (c), nj (j), 4 (u), bm]: thread (g, c) holds column g (+ 8 i) and its
    8 nj values of slot lane c, contiguous in memory. `_dot(warps, 1)` after the pair split."""
    reg = [[0, 0, 1, 0], [0, 0, 2, 0]] + [[0, 1 << i, 0, 0] for i in range(nj.bit_length() - 1)]
    reg += [[0, 0, 0, 8 << i] for i in range((bm // 8).bit_length() - 1)]
    lane = [[1, 0, 0, 0], [2, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]]
    warp = [[0, 0, 0, 0] for _ in range(warps.bit_length() - 1)]  # every warp holds all of x's tile
    return gl.DistributedLinearLayout(reg, lane, warp, [], [4, nj, 4, bm])


@constexpr_function
def _flat(warps):
    return gl.BlockedLayout([1], [32], [warps], [0])


@constexpr_function
def _grid2(warps):
    return gl.BlockedLayout([1, 1], [4, 8], [warps, 1], [1, 0])


# ---------------------------------------------------------------- values
@jit
def _unpack(p, s, magic, ASM: tl.constexpr, EMULATE: tl.constexpr):
    """Words p [R, S] int32 and their scales s [R, S] (16-bit) -> [R, 8 S] (q - 8) x scale in s's
    dtype, value t of word s at column 8 s + t (t = nibble t), each rounded once."""
    R: gl.constexpr = p.shape[0]
    S: gl.constexpr = p.shape[1]
    if ASM:
        p8 = gl.join(p, p)
        p8 = gl.join(p8, p8)
        p8 = gl.join(p8, p8)  # [R, S, 2, 2, 2]: the word in each of 8 consecutive registers
        s8 = gl.join(s, s)
        s8 = gl.join(s8, s8)
        s8 = gl.join(s8, s8)
        m8 = p8 * 0 + magic
        if s.dtype == gl.bfloat16:
            o = gl.inline_asm_elementwise(_ASM_BF16, _CONSTRAINTS, [p8, s8, m8], dtype=gl.bfloat16, is_pure=True,
                                          pack=8)
        else:
            o = gl.inline_asm_elementwise(_ASM_F16, _CONSTRAINTS, [p8, s8.to(gl.bfloat16, bitcast=True), m8],
                                          dtype=gl.bfloat16, is_pure=True, pack=8)
        o = o.to(s.dtype, bitcast=True)
    else:
        t = gl.arange(0, 8)
        q = (gl.expand_dims(p, 2) >> (4 * gl.expand_dims(gl.expand_dims(t, 0), 1))) & 15
        o = _round((q - 8).to(gl.float32) * gl.expand_dims(s, 2).to(gl.float32), s.dtype, EMULATE)  # exact product
    return gl.reshape(o, (R, 8 * S))


@jit
def _round(v, OUT: tl.constexpr, EMULATE: tl.constexpr):
    """float32 v in OUT, rounded to nearest (the interpreter's bf16 cast truncates: Veltkamp's
    split rounds to 8 significant bits first, as `portable._cast`)."""
    if EMULATE and OUT == gl.bfloat16:
        c = v * 65537.0
        v = c - (c - v)
    return v.to(OUT)


@jit
def _pair_split(w, OUT: tl.constexpr, ASM: tl.constexpr):
    """int32 words w holding two 16-bit values each -> [..., 2] OUT, low half first."""
    if ASM:  # the register itself: Triton keeps the two halves where they are (pack=2)
        h = gl.inline_asm_elementwise(_MOV, "=r,r,r", [gl.join(w, w)], dtype=gl.bfloat16, is_pure=True, pack=2)
        h = h.to(OUT, bitcast=True)
    else:
        lo = (w & 0xFFFF).to(gl.int16).to(OUT, bitcast=True)
        hi = ((w >> 16) & 0xFFFF).to(gl.int16).to(OUT, bitcast=True)
        h = gl.join(lo, hi)
    return h


@jit
def _x_operand(xw, OUT: tl.constexpr, ASM: tl.constexpr):
    """x words [4 (c), NJ (j), 4 (u), BM] -> [32 NJ, BM] in the kernel's K order 32 j + 8 c + 2 u + e."""
    NJ: gl.constexpr = xw.shape[1]
    BM: gl.constexpr = xw.shape[3]
    h = gl.permute(_pair_split(xw, OUT, ASM), (1, 0, 2, 4, 3))  # [NJ, 4, 4, 2, BM]
    return gl.reshape(h, (32 * NJ, BM))


@jit
def _w16_operand(ww, OUT: tl.constexpr, ASM: tl.constexpr):
    """16-bit weight words [R, 4 (c), NJ (j), 4 (u)] -> [R, 32 NJ] in the kernel's K order."""
    R: gl.constexpr = ww.shape[0]
    NJ: gl.constexpr = ww.shape[2]
    h = gl.permute(_pair_split(ww, OUT, ASM), (0, 2, 1, 3, 4))  # [R, NJ, 4, 4, 2]
    return gl.reshape(h, (R, 32 * NJ))


@jit
def _w4_operand(p, s, magic, ASM: tl.constexpr, EMULATE: tl.constexpr):
    """INT4 words p [R, 4 (c), NJ (j)] and their scales ([R, 4, NJ] or one a lane, [R, 4, 1]) ->
    [R, 32 NJ] in the kernel's K order."""
    R: gl.constexpr = p.shape[0]
    NJ: gl.constexpr = p.shape[2]
    s = gl.broadcast(s, p)[0]
    p = gl.reshape(gl.permute(p, (0, 2, 1)), (R, 4 * NJ))  # slot 4 j + c
    s = gl.reshape(gl.permute(s, (0, 2, 1)), (R, 4 * NJ))
    return _unpack(p, s, magic, ASM, EMULATE)


# ---------------------------------------------------------------- the K loops
@jit
def _w4_loads(wptr, sptr, cj, cs, kw, kw_hi, GW: tl.constexpr, EVEN: tl.constexpr):
    """Step kw's INT4 words [R, 4, NJ] and their scales ([R, 4, 1] when a lane's words share one:
    cs = c NJ; else [R, 4, NJ], cs = cj). EVEN: every step is whole (no masks); else zeros past
    kw_hi. (Rows and columns without work point at valid memory: their results are never stored.)"""
    if EVEN:
        p = gl.load(wptr + kw)
        s = gl.load(sptr + (kw + cs) // GW)
    else:
        p = gl.load(wptr + kw, mask=(kw + cj) < kw_hi, other=0)
        s = gl.load(sptr + (kw + cs) // GW, mask=(kw + cs) < kw_hi, other=0.0)
    return p, s


@jit
def _x_loads(xptr, cjx, kw, kw_hi, EVEN: tl.constexpr):
    """Step kw's x words [4, NJ, 4, BM] (and 16-bit weights' [R, 4, NJ, 4]: the same int32 pairs
    of 8-value words), as `_w4_loads`."""
    if EVEN:
        x = gl.load(xptr + 4 * kw)
    else:
        x = gl.load(xptr + 4 * kw, mask=(kw + cjx) < kw_hi, other=0)
    return x


@jit
def _w4_step(acc, p, s, x, magic, LA: tl.constexpr, LB: tl.constexpr, ASM: tl.constexpr, EMULATE: tl.constexpr):
    a = gl.convert_layout(_w4_operand(p, s, magic, ASM, EMULATE), LA, assert_trivial=True)
    b = gl.convert_layout(_x_operand(x, s.dtype, ASM), LB, assert_trivial=True)
    return mma_v2(a, b, acc)


@jit
def _last_trip(kw_lo, kw_hi, BKW: tl.constexpr):
    """The first word of the last two-step trip over kw_lo .. kw_hi."""
    return kw_lo + (kw_hi - kw_lo - 1) // (2 * BKW) * (2 * BKW)


@jit
def _w4_loop(acc, wptr, sptr, xptr, cj, cs, cjx, kw_lo, kw_hi, magic, LA: tl.constexpr, LB: tl.constexpr,
             NJ: tl.constexpr, GW: tl.constexpr, DEPTH: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr,
             EMULATE: tl.constexpr):
    """acc [R, BM] += W[rows, words kw_lo .. kw_hi) @ x[columns, same]^T for INT4 W, two steps a
    trip; the weights' loads are issued DEPTH (1 or 2) steps ahead, x's one (registers: no
    shared memory, no barrier); the last trip loads nothing ahead."""
    BKW: gl.constexpr = 4 * NJ
    last = _last_trip(kw_lo, kw_hi, BKW)
    p0, s0 = _w4_loads(wptr, sptr, cj, cs, kw_lo, kw_hi, GW, EVEN)
    x0 = _x_loads(xptr, cjx, kw_lo, kw_hi, EVEN)
    p1, s1 = _w4_loads(wptr, sptr, cj, cs, kw_lo + BKW, kw_hi, GW, EVEN)
    for kw in range(kw_lo, last, 2 * BKW):
        if DEPTH == 2:
            p2, s2 = _w4_loads(wptr, sptr, cj, cs, kw + 2 * BKW, kw_hi, GW, EVEN)
        x1 = _x_loads(xptr, cjx, kw + BKW, kw_hi, EVEN)
        acc = _w4_step(acc, p0, s0, x0, magic, LA, LB, ASM, EMULATE)
        if DEPTH == 2:
            p3, s3 = _w4_loads(wptr, sptr, cj, cs, kw + 3 * BKW, kw_hi, GW, EVEN)
        else:
            p2, s2 = _w4_loads(wptr, sptr, cj, cs, kw + 2 * BKW, kw_hi, GW, EVEN)
        x0 = _x_loads(xptr, cjx, kw + 2 * BKW, kw_hi, EVEN)
        acc = _w4_step(acc, p1, s1, x1, magic, LA, LB, ASM, EMULATE)
        if DEPTH == 2:
            p0, s0, p1, s1 = p2, s2, p3, s3
        else:
            p0, s0 = p2, s2
            p1, s1 = _w4_loads(wptr, sptr, cj, cs, kw + 3 * BKW, kw_hi, GW, EVEN)
    x1 = _x_loads(xptr, cjx, last + BKW, kw_hi, EVEN)
    acc = _w4_step(acc, p0, s0, x0, magic, LA, LB, ASM, EMULATE)
    return _w4_step(acc, p1, s1, x1, magic, LA, LB, ASM, EMULATE)


@jit
def _w16_step(acc, w, x, LA: tl.constexpr, LB: tl.constexpr, OUT: tl.constexpr, ASM: tl.constexpr):
    a = gl.convert_layout(_w16_operand(w, OUT, ASM), LA, assert_trivial=True)
    b = gl.convert_layout(_x_operand(x, OUT, ASM), LB, assert_trivial=True)
    return mma_v2(a, b, acc)


@jit
def _w16_loop(acc, wptr, xptr, cj4, cjx, kw_lo, kw_hi, LA: tl.constexpr, LB: tl.constexpr, NJ: tl.constexpr,
              OUT: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """`_w4_loop` for 16-bit weights (the shared experts; K in words of 8 values), one step ahead:
    a 16-bit step is 4x an INT4 one's bytes."""
    BKW: gl.constexpr = 4 * NJ
    last = _last_trip(kw_lo, kw_hi, BKW)
    w0 = _x_loads(wptr, cj4, kw_lo, kw_hi, EVEN)
    x0 = _x_loads(xptr, cjx, kw_lo, kw_hi, EVEN)
    for kw in range(kw_lo, last, 2 * BKW):
        w1 = _x_loads(wptr, cj4, kw + BKW, kw_hi, EVEN)
        x1 = _x_loads(xptr, cjx, kw + BKW, kw_hi, EVEN)
        acc = _w16_step(acc, w0, x0, LA, LB, OUT, ASM)
        w0 = _x_loads(wptr, cj4, kw + 2 * BKW, kw_hi, EVEN)
        x0 = _x_loads(xptr, cjx, kw + 2 * BKW, kw_hi, EVEN)
        acc = _w16_step(acc, w1, x1, LA, LB, OUT, ASM)
    w1 = _x_loads(wptr, cj4, last + BKW, kw_hi, EVEN)
    x1 = _x_loads(xptr, cjx, last + BKW, kw_hi, EVEN)
    acc = _w16_step(acc, w0, x0, LA, LB, OUT, ASM)
    return _w16_step(acc, w1, x1, LA, LB, OUT, ASM)


# ---------------------------------------------------------------- operand addressing
@jit
def _x_ptrs(X, rows, s_x, NJ: tl.constexpr, BM: tl.constexpr, LX: tl.constexpr):
    """x's int32 pair pointers [4 (c), NJ (j), 4 (u), BM] at step 0 for x rows rows [BM] (int64,
    valid rows: a column without work reads a real row), and each slot's step-relative word c NJ
    + j as [4, NJ, 1, 1]."""
    L_CJ: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LX))
    c = gl.arange(0, 4, layout=gl.SliceLayout(1, L_CJ))
    j = gl.arange(0, NJ, layout=gl.SliceLayout(0, L_CJ))
    u = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LX))))
    cj = gl.expand_dims(gl.expand_dims(gl.expand_dims(c, 1) * NJ + gl.expand_dims(j, 0), 2), 3)  # [4, NJ, 1, 1]
    uu = gl.expand_dims(gl.expand_dims(gl.expand_dims(u, 0), 1), 3)  # [1, 1, 4, 1]
    r = gl.convert_layout(rows, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LX))))
    m = gl.expand_dims(gl.expand_dims(gl.expand_dims(r * (s_x // 2), 0), 1), 2)  # [1, 1, 1, BM]
    return X.to(gl.pointer_type(gl.int32), bitcast=True) + (m + cj * 4 + uu), cj


@jit
def _row_of(r, n0, N, PAIRED: tl.constexpr):
    """Tile row r -> (whether it is in the second matrix, its row there clamped to N - 1). PAIRED:
    rows 16 i + 0..7 of the tile are rows n0 + 8 i + 0..7 of the first matrix, rows 16 i + 8..15
    the same rows of the second (gate and up of one output in one thread's registers)."""
    if PAIRED:
        second = (r // 8) % 2 == 1
        n = n0 + (r // 16) * 8 + r % 8
    else:
        second = r < 0
        n = n0 + r
    return second, gl.minimum(n, N - 1).to(gl.int64)


@jit
def _w4_rows(wa, wb, sa, sb, n0, N, s_wn, s_sn, PAIRED: tl.constexpr, R: tl.constexpr, NJ: tl.constexpr,
             GW: tl.constexpr, LW: tl.constexpr):
    """INT4 word pointers [R, 4, NJ] at step 0 of tile rows n0 .. of W (PAIRED: two matrices, the
    second's words at wb / sb, `_row_of`), each slot's step-relative word cj [1, 4, NJ], and the
    scale row pointers with their step-relative word: [R, 4, 1] / c NJ where a lane's NJ words
    share a scale (GW % NJ == 0), else [R, 1, 1] / cj."""
    L_R: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LW))
    second, n = _row_of(gl.arange(0, R, layout=L_R), n0, N, PAIRED)
    w_row = gl.expand_dims(gl.expand_dims(gl.where(second, wb, wa) + n * s_wn, 1), 2)
    s_row = gl.expand_dims(gl.expand_dims(gl.where(second, sb, sa) + n * s_sn, 1), 2)
    c = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW))) * NJ, 0), 2)
    j = gl.expand_dims(gl.expand_dims(gl.arange(0, NJ, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW))), 0), 1)
    cj = c + j
    if GW % NJ == 0:
        cs = c
    else:
        cs = cj
    return w_row + cj, cj, s_row + cs * 0, cs


@jit
def _w16_rows(wa, wb, n0, N, s_wn, PAIRED: tl.constexpr, R: tl.constexpr, NJ: tl.constexpr, LW: tl.constexpr):
    """16-bit weight pair pointers [R, 4, NJ, 4] (int32) at step 0 and each slot's step-relative
    word [1, 4, NJ, 1], as `_w4_rows` (row stride s_wn values)."""
    L3: gl.constexpr = gl.SliceLayout(3, LW)
    second, n = _row_of(gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3))), n0, N, PAIRED)
    row = gl.where(second, wb, wa).to(gl.pointer_type(gl.int32), bitcast=True) + n * (s_wn // 2)
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    j = gl.arange(0, NJ, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    cj = gl.expand_dims(gl.expand_dims(gl.expand_dims(c * NJ, 0), 2) + gl.expand_dims(gl.expand_dims(j, 0), 1), 3)
    u = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LW))))
    uu = gl.expand_dims(gl.expand_dims(gl.expand_dims(u, 0), 1), 2)  # [1, 1, 1, 4]
    return gl.expand_dims(gl.expand_dims(gl.expand_dims(row, 1), 2), 3) + (cj * 4 + uu), cj


@jit
def _w4_acc(acc, X, xrows, s_x, wa, wb, sa, sb, n0, N, s_wn, s_sn, kw_lo, kw_hi, magic, PAIRED: tl.constexpr,
            R: tl.constexpr, BM: tl.constexpr, NJ: tl.constexpr, GW: tl.constexpr, W: tl.constexpr,
            DEPTH: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr, EMULATE: tl.constexpr):
    """acc [R, BM] += rows n0 .. of INT4 W (PAIRED: two matrices, `_row_of`) @ X[xrows]^T over
    words kw_lo .. kw_hi."""
    wptr, cj, sptr, cs = _w4_rows(wa, wb, sa, sb, n0, N, s_wn, s_sn, PAIRED, R, NJ, GW, _words(W, R, NJ, False))
    xptr, cjx = _x_ptrs(X, xrows, s_x, NJ, BM, _xwords(W, NJ, BM))
    return _w4_loop(acc, wptr, sptr, xptr, cj, cs, cjx, kw_lo, kw_hi, magic, _dot(W, 0), _dot(W, 1), NJ, GW, DEPTH,
                    EVEN, ASM, EMULATE)


@jit
def _w16_acc(acc, X, xrows, s_x, wa, wb, n0, N, s_wn, kw_lo, kw_hi, PAIRED: tl.constexpr, R: tl.constexpr,
             BM: tl.constexpr, NJ: tl.constexpr, W: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """`_w4_acc` for 16-bit W (row stride s_wn values; K in words of 8 values)."""
    wptr, cj4 = _w16_rows(wa, wb, n0, N, s_wn, PAIRED, R, NJ, _words(W, R, NJ, True))
    xptr, cjx = _x_ptrs(X, xrows, s_x, NJ, BM, _xwords(W, NJ, BM))
    return _w16_loop(acc, wptr, xptr, cj4, cjx, kw_lo, kw_hi, _dot(W, 0), _dot(W, 1), NJ, X.dtype.element_ty, EVEN,
                     ASM)
