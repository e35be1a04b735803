"""The portable W4A16 grouped MoE kernel (Triton `tl`, any x dtype and group size; the dispatch in
`__init__.py` takes it where the MMA kernel (`mma.py`) does not apply): INT4 routed experts
(compressed-tensors pack-quantized, `kernels.int4.Int4Weight`), every routed pair in four launches.

The call has the shape of `kernels/moe_gemm.py` and reuses its pieces: the pairs sorted by expert
on the device into blocks of BLOCK_M rows that never straddle experts (`route_blocks`), host-known
grids (graph-capturable, no host sync), split K with an arrival counter for gate_up at small row
counts, the shared experts (bf16 tensors) as extra blocks of the same launches (16-token blocks),
and the fixed-order top-k sum:

    gate_up: H[r, :] = silu(x[t] @ Wg[e]^T) * (x[t] @ Wu[e]^T)     (row r = sorted pair)
    down:    Y[a, :] = weight[a] * (H[r] @ Wd[e]^T)                 (a = t * top_k + j)
    out[t]  = sum_j Y[t * top_k + j]                                (fixed order: deterministic)

Weights stay packed in memory: each program loads int32 words, unpacks them in registers and
multiplies by the group scale; a dequantized copy is never stored. Memory layout of one
projection W [N, K] of expert e (the checkpoint's, `kernels/int4.py`):

    packed [E, N, K / 8] int32, row stride s_wn words: W[n, 8w + j] = (nibble j of word w - 8) x
    scale  [E, N, K / G] float (bf16 as published):        scale[n, (8w + j) // G]

The product runs "swapped" (acc^T [BLOCK_N, BLOCK_M] = W_tile @ x^T): the big unpacked weight
tile is the MMA's A operand and the few rows of x the small B operand, one dot a K step of BKW
words. On a GPU with 16-bit x the unpack is inline PTX (`_UNPACK_ASM`, Marlin's trick): two
nibbles a LOP3 into a bf16x2 / f16x2 pair as 128 + q, an exact subtract of 136 and the scale
multiply, both on pairs: ~2 instructions a weight. Elsewhere (the CPU interpreter, fp32 x) Triton
ops with the same rounding: OR-ing nibble j, left in place, into the mantissa of 2^23 gives the
float 2^23 + q * 16^v (v = j mod 4; nibbles 4-7 from the word >> 16) and subtracting 2^23 + 8 *
16^v gives (q - 8) * 16^v exactly, without an int-to-float conversion; x carries 16^-v (exact in
bf16 / fp32; fp16 shifts each nibble down instead).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from treeflash.kernels.device import num_sms as _num_sms
from treeflash.kernels.device import tile_counters as _tile_counters
from treeflash.kernels.int4 import PACK, Int4Weight
from treeflash.kernels.moe_gemm import (
    _block_head,
    _shared_rows,
    _sum_rows_kernel,
    route_blocks,
    shared_chunks,
)

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One grouped call's tile sizes. block_m: routed rows a block (the routing's block size, 16 or
    more: the MMA's N); gate_up / down: BLOCK_N output columns and BKW packed words (8 x BKW input
    columns) a K step; shared_k: the shared experts' K step in elements; stages: num_stages; warps
    of each launch."""

    block_m: int = 16
    gu_n: int = 64
    gu_kw: int = 16
    down_n: int = 64
    down_kw: int = 16
    shared_k: int = 64
    stages: int = 2
    gu_warps: int = 4
    down_warps: int = 4

    def spec(self) -> str:
        """The `RuntimeOptions.w4a16_tiles` form of these tiles."""
        return ":".join(str(v) for v in dataclasses.astuple(self))

    @staticmethod
    def parse(values) -> Tiles:
        """From `RuntimeOptions.w4a16_tiles`' 7 or 9 integers (warps default to 4)."""
        t = Tiles(*values)
        for name in ("block_m", "gu_n", "gu_kw", "down_n", "down_kw", "shared_k"):
            v = getattr(t, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"W4A16 tiles {t.spec()}: {name} must be a power of two >= 16 (a dot dimension)")
        return t


# From the sm_90 SASS of Triton 3.6 (the H100 / H200 image's; benchmarks/compile_w4a16.py,
# benchmarks/notes/moe-w4a16.md), not yet timed: 16 words a K step without software pipelining
# (num_stages 1) give gate_up 3.2 instructions a weight (group 32, bf16) at 128 registers and 36 KB
# of shared memory (4 programs an SM); num_stages 2 costs 4.5 (the cp.async ring re-shapes the
# loop), 32 words 3.4 at 168 registers, 32 columns (MMAv2) 6.6. Decode / verify blocks hold 1-3
# rows: 16-row blocks, 64 gate_up columns (4 tiles an expert at Kimi K2 TP8) with split K. Prefill
# blocks hold ~20 rows an expert: 32-row blocks (an expert unpacked once) and 128 columns (x's share
# of the shared-memory traffic is BLOCK_M / BLOCK_N).
SMALL_TILES = Tiles(16, 64, 16, 64, 16, 64, 1, 4, 4)
LARGE_TILES = Tiles(32, 128, 16, 128, 16, 32, 1, 8, 8)
INTERPRETER_TILES = Tiles(16, 16, 16, 16, 16, 32, 1, 4, 4)
LARGE_ROWS_PER_EXPERT = 8  # pairs / local experts from which LARGE_TILES apply
MAGIC = 0x4B000000  # the bits of the float 2^23 (`_nibble`)
SHARED_M = 16  # tokens a shared-expert block (tensor cores, whatever the routed blocks use)

MAX_SPLIT_K = 8
MIN_SPLIT_STEPS = 2  # BKW steps a split keeps at least
PROGRAMS_PER_SM = 2  # what split K aims gate_up's busy programs at (an INT4 program streams 1/3.6 of a bf16 one)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _cast(v, OUT: tl.constexpr, EMULATE: tl.constexpr):
    """float32 v in OUT, rounded to nearest. EMULATE (the interpreter, whose float32 -> bf16 cast
    truncates): rounded in float32 first, so that CPU tests see the GPU's numerics."""
    if EMULATE and OUT == tl.bfloat16:  # Veltkamp's split: v rounded to 24 - 16 = 8 significant bits
        c = v * 65537.0
        v = c - (c - v)
    return v.to(OUT)


@triton.jit
def _nibble(p, p_hi, magic, J: tl.constexpr, PRESCALE: tl.constexpr):
    """Nibble J of the packed words p [BN, BKW] (p_hi = p >> 16) as float32 q - 8, times
    16^(J % 4) with PRESCALE (the caller's x carries 16^-(J % 4)). magic = 0x4B000000 (2^23's
    bits), a kernel argument: as an immediate beside the nibble mask it cost a register move a
    weight (LOP3 takes one immediate; Triton 3.9 sm_90 SASS, benchmarks/compile_w4a16.py)."""
    if J < 4:
        src = p
    else:
        src = p_hi
    if PRESCALE:
        bits = (src & (15 << (4 * (J % 4)))) | magic  # the float 2^23 + q * 16^v
        f = bits.to(tl.float32, bitcast=True) - (8388608.0 + 8.0 * (1 << (4 * (J % 4))))
    else:
        bits = ((src >> (4 * (J % 4))) & 15) | magic  # the float 2^23 + q
        f = bits.to(tl.float32, bitcast=True) - 8388616.0
    return f


@triton.jit
def _scaled(f, s, OUT: tl.constexpr, EMULATE: tl.constexpr):
    """float32 f = (q - 8) * 16^v (exact in bf16: 4 significant bits) times the scale s, rounded
    once to OUT: in OUT itself where s is of that dtype (bf16: a packed bf16x2 multiply), else in
    float32 and cast."""
    if s.dtype == OUT and not EMULATE:
        return f.to(OUT) * s
    return _cast(f * s.to(tl.float32), OUT, EMULATE)


# Two nibbles a LOP3 into a pair of 16-bit floats (the Marlin trick), adjacent in K: for word w =
# $4, u = PRMT(w, w >> 4) holds nibble 2m (byte m's low nibble) in bits 0-3 and nibble 2m + 1 in
# bits 16-19; u & 0x000F000F | magic (0x43004300: bf16 128.0 twice; fp16 0x64006400, 1024.0) is
# 128 + q in each half; minus 136 (fma by 1: exact) is q - 8; times the scale pair $6 (the word's
# scale twice), rounded once. Output $m = nibbles (2m, 2m + 1). Triton packs two elements a
# register (pack=2): the caller duplicates each word and scale on a trailing axis of 2, so that a
# pair is (w, w) in, (nibble 2m, nibble 2m + 1) out ($5 is the copy). magic ($7, $8) is a kernel
# argument so that ptxas keeps it in a register (LOP3 takes one immediate).
_UNPACK_ASM = """{
.reg .b32 v, u, one, nbias, nzero;
mov.b32 one, ONE;
mov.b32 nbias, NBIAS;
mov.b32 nzero, 0x80008000;
shr.b32 v, $4, 4;
"""
for _m in range(4):
    _UNPACK_ASM += (f"prmt.b32 u, $4, v, {_m | (4 + _m) << 8:#x};\nlop3.b32 u, u, 0x000F000F, $7, 0xEA;\n"
                    f"fma.rn.T u, u, one, nbias;\nfma.rn.T ${_m}, u, $6, nzero;\n")
_UNPACK_ASM += "}"
UNPACK_PTX = {  # dtype: (the asm, its magic pair); constants: 1.0 and -136 (bf16) / -1032 (fp16) twice
    torch.bfloat16: (_UNPACK_ASM.replace("T ", "bf16x2 ").replace("ONE", "0x3F803F80").replace("NBIAS", "0xC308C308"),
                     0x43004300),
    torch.float16: (_UNPACK_ASM.replace("T ", "f16x2 ").replace("ONE", "0x3C003C00").replace("NBIAS", "0xE408E408"),
                    0x64006400),
}
_ASM_BF16 = tl.constexpr(UNPACK_PTX[torch.bfloat16][0])
_ASM_F16 = tl.constexpr(UNPACK_PTX[torch.float16][0])


@triton.jit
def _unpack(p, s, magic, magic2, PRESCALE: tl.constexpr, ASM: tl.constexpr, OUT: tl.constexpr,
            EMULATE: tl.constexpr):
    """Words p [BN, BKW] and their scales s -> weights [BN, 8 BKW] in OUT, natural K order (column
    8w + j = nibble j of word w). ASM: `_UNPACK_ASM` (a GPU; (q - 8) * s); else Triton ops with the
    same rounding ((q - 8) * s * 16^(j % 4) with PRESCALE, `_nibble`). Both build the nibble pairs
    o_m [BN, BKW, 2] = (nibble 2m, 2m + 1) and put them in order the same way."""
    if ASM:
        p2 = tl.join(p, p)  # [BN, BKW, 2]: a register pair holds one word twice
        s2 = tl.join(s, s).to(OUT)
        m2 = p2 * 0 + magic2  # magic2 in a register (p * 0 folds)
        if OUT == tl.bfloat16:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(_ASM_BF16, "=r,=r,=r,=r,r,r,r,r,r", [p2, s2, m2],
                                                       dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
        else:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(_ASM_F16, "=r,=r,=r,=r,r,r,r,r,r", [p2, s2, m2],
                                                       dtype=(tl.float16,) * 4, is_pure=True, pack=2)
    else:
        p_hi = p >> 16
        o0 = tl.join(_scaled(_nibble(p, p_hi, magic, 0, PRESCALE), s, OUT, EMULATE),
                     _scaled(_nibble(p, p_hi, magic, 1, PRESCALE), s, OUT, EMULATE))
        o1 = tl.join(_scaled(_nibble(p, p_hi, magic, 2, PRESCALE), s, OUT, EMULATE),
                     _scaled(_nibble(p, p_hi, magic, 3, PRESCALE), s, OUT, EMULATE))
        o2 = tl.join(_scaled(_nibble(p, p_hi, magic, 4, PRESCALE), s, OUT, EMULATE),
                     _scaled(_nibble(p, p_hi, magic, 5, PRESCALE), s, OUT, EMULATE))
        o3 = tl.join(_scaled(_nibble(p, p_hi, magic, 6, PRESCALE), s, OUT, EMULATE),
                     _scaled(_nibble(p, p_hi, magic, 7, PRESCALE), s, OUT, EMULATE))
    # r[n, w, e, i, l] = o[2i + l][n, w, e]; in (w, i, l, e) order the flat index is 8w + 2m + e
    r = tl.join(tl.join(o0, o2), tl.join(o1, o3))
    return tl.reshape(tl.permute(r, (0, 1, 3, 4, 2)), (p.shape[0], 8 * p.shape[1]))


@triton.jit
def _scales(sa, s_row, col_ok, kw0, kw_hi, BKW: tl.constexpr, GW: tl.constexpr):
    """The group scales of words kw0 .. kw0 + BKW - 1 as [BN, BKW]: one load a group (not a gather
    a word: at 4 words a group that cost ~1 instruction a weight in the Triton 3.6 SASS), repeated
    in registers (joins) or broadcast (a group longer than the step). Masked words: scale 0."""
    if GW >= BKW:
        s = tl.load(sa + s_row + kw0 // GW, mask=col_ok[:, None], other=0.0)  # [BN, 1]
        kw = kw0 + tl.arange(0, BKW)
        return tl.where((kw < kw_hi)[None, :], tl.broadcast_to(s, (s.shape[0], BKW)), 0.0).to(s.dtype)
    g = kw0 // GW + tl.arange(0, BKW // GW)
    s = tl.load(sa + s_row + g[None, :], mask=col_ok[:, None] & (g * GW < kw_hi)[None, :], other=0.0)
    for _ in tl.static_range(GW.bit_length() - 1):  # GW a power of two
        s = tl.join(s, s)
    return tl.reshape(s, (s.shape[0], BKW))


@triton.jit
def _int4_dot2(acc_a, acc_b, X, xrow, row_ok, s_x, wa, wb, sa, sb, s_wn, s_sn, cols, col_ok, kw_lo, kw_hi, magic,
               magic2, TWO: tl.constexpr, BKW: tl.constexpr, GW: tl.constexpr, PRESCALE: tl.constexpr,
               ASM: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """acc_a [BN, BM] += Wa[cols, 8 kw_lo : 8 kw_hi] @ X[xrow, same]^T, and acc_b with Wb if TWO,
    on tensor cores: per K step the words unpacked to (q - 8) * scale in X's dtype, one dot.
    Wa INT4: words at wa + n * s_wn + w, scales at sa + n * s_sn + w // GW (GW words a group).
    Words past kw_hi or rows past the weight load as 0 and meet x columns / rows loaded as 0.
    (kw_lo and kw_hi are multiples of BKW or of the group, so that no group is cut.)"""
    OUT: tl.constexpr = X.dtype.element_ty
    w_row = cols[:, None].to(tl.int64) * s_wn
    s_row = cols[:, None].to(tl.int64) * s_sn
    x_row = xrow[None, :] * s_x
    ks = tl.arange(0, 8 * BKW)
    x_scale = tl.exp2(-4.0 * (ks % 4).to(tl.float32))[:, None]  # nibble j carries 16^(j % 4)
    for kw0 in range(kw_lo, kw_hi, BKW):
        k = 8 * kw0 + ks
        xt = tl.load(X + x_row + k[:, None], mask=(k < 8 * kw_hi)[:, None] & row_ok[None, :], other=0.0)
        if PRESCALE and not ASM:
            xt = (xt.to(tl.float32) * x_scale).to(OUT)  # exact: powers of two
        kw = kw0 + tl.arange(0, BKW)
        wmask = col_ok[:, None] & (kw < kw_hi)[None, :]
        a = _unpack(tl.load(wa + w_row + kw[None, :], mask=wmask, other=0),
                    _scales(sa, s_row, col_ok, kw0, kw_hi, BKW, GW), magic, magic2, PRESCALE, ASM, OUT, DOT_F32)
        if TWO:
            b = _unpack(tl.load(wb + w_row + kw[None, :], mask=wmask, other=0),
                        _scales(sb, s_row, col_ok, kw0, kw_hi, BKW, GW), magic, magic2, PRESCALE, ASM, OUT, DOT_F32)
        if DOT_F32:  # the interpreter's half-precision dot is not faithful
            xt = xt.to(tl.float32)
            a = a.to(tl.float32)
        acc_a = tl.dot(a, xt, acc_a, input_precision=DOT_PREC)
        if TWO:
            if DOT_F32:
                b = b.to(tl.float32)
            acc_b = tl.dot(b, xt, acc_b, input_precision=DOT_PREC)
    return acc_a, acc_b


@triton.jit
def _dense_dot2(acc_a, acc_b, X, xrow, row_ok, s_x, wa, wb, s_wn, cols, col_ok, k_lo, k_hi,
                TWO: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """`_int4_dot2` for dense weights in X's dtype (the shared experts): Wa[n, k] at wa + n * s_wn + k."""
    w_row = cols[:, None].to(tl.int64) * s_wn
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < k_hi
        wmask = col_ok[:, None] & k_ok[None, :]
        xt = tl.load(X + xrow[None, :] * s_x + ks[:, None], mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        a = tl.load(wa + w_row + ks[None, :], mask=wmask, other=0.0)
        if DOT_F32:
            xt = xt.to(tl.float32)
            a = a.to(tl.float32)
        acc_a = tl.dot(a, xt, acc_a, input_precision=DOT_PREC)
        if TWO:
            b = tl.load(wb + w_row + ks[None, :], mask=wmask, other=0.0)
            if DOT_F32:
                b = b.to(tl.float32)
            acc_b = tl.dot(b, xt, acc_b, input_precision=DOT_PREC)
    return acc_a, acc_b


@triton.jit
def _gate_up_out(acc_g, acc_u, hrows, row_ok, cols, col_ok, HOUT, s_ht, PART, s_ps, s_pr, CNT, INTER,
                 SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr):
    """H[hrows, cols] = silu(gate) * up; with SPLIT_K > 1 this program's fp32 partials go to PART
    [SPLIT_K, rows, 2 * INTER] (gate at columns 0 .., up at INTER ..), it counts itself in on its
    tile's counter, and the last to arrive sums the partials in split order, stores H and resets
    the counter (as `moe_gemm._gate_up_kernel`)."""
    ok2 = col_ok[:, None] & row_ok[None, :]
    out = HOUT + hrows[None, :] * s_ht + cols[:, None]
    if SPLIT_K > 1:
        part = PART + hrows[None, :] * s_pr + cols[:, None]
        tl.store(part + tl.program_id(2).to(tl.int64) * s_ps, acc_g, mask=ok2)
        tl.store(part + tl.program_id(2).to(tl.int64) * s_ps + INTER, acc_u, mask=ok2)
        tl.debug_barrier()  # every thread's partial stored before the release below
        cnt = CNT + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            acc_g = tl.load(part, mask=ok2, other=0.0, cache_modifier=".cg")
            acc_u = tl.load(part + INTER, mask=ok2, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                acc_g += tl.load(part + s * s_ps, mask=ok2, other=0.0, cache_modifier=".cg")
                acc_u += tl.load(part + s * s_ps + INTER, mask=ok2, other=0.0, cache_modifier=".cg")
            h = acc_g * tl.sigmoid(acc_g) * acc_u
            tl.store(out, _cast(h, HOUT.dtype.element_ty, DOT_F32), mask=ok2)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call
    else:
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(out, _cast(h, HOUT.dtype.element_ty, DOT_F32), mask=ok2)


@triton.jit
def _gate_up_kernel(X, WG, WU, SG, SU, HOUT, ORDER, BLK_E, BLK_R0, BLK_R1, INTER, TOPK, HW,
                    s_xt, s_we, s_wn, s_se, s_sn, s_ht, PART, CNT, kw_chunk, s_ps, s_pr,
                    WSG, WSU, NB, T, A, S_CH, s_swe, s_swn, MAGIC, MAGIC2,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BKW: tl.constexpr, BK_SH: tl.constexpr,
                    SH_M: tl.constexpr, GW: tl.constexpr, PRESCALE: tl.constexpr, ASM: tl.constexpr,
                    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, SPLIT_K: tl.constexpr):
    """HOUT [A + T * S_CH, INTER] = silu(gate) * up in X's dtype; HW = hidden / 8 words. Programs
    m < NB are routed blocks of BLOCK_M sorted pairs (INT4 WG / WU, scales SG / SU), m >= NB the
    shared experts' blocks of SH_M tokens x chunk c (dense WSG / WSU + c * s_swe). SPLIT_K > 1:
    program (m, n, s) covers words s * kw_chunk .. (`_gate_up_out`)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, r0, r1 = _block_head(BLK_E, BLK_R0, BLK_R1, pid_m, NB)
    if e < 0:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    kw_lo = 0
    kw_hi = HW
    if SPLIT_K > 1:
        kw_lo = tl.program_id(2) * kw_chunk
        kw_hi = tl.minimum(kw_lo + kw_chunk, HW)
    if pid_m < NB:
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < r1
        tok = (tl.load(ORDER + rows, mask=row_ok, other=0) // TOPK).to(tl.int64)
        e64 = e.to(tl.int64)
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        wg, wu, sg, su = WG + e64 * s_we, WU + e64 * s_we, SG + e64 * s_se, SU + e64 * s_se
        acc_g, acc_u = _int4_dot2(acc_g, acc_u, X, tok, row_ok, s_xt, wg, wu, sg, su, s_wn, s_sn, cols, col_ok,
                                  kw_lo, kw_hi, MAGIC, MAGIC2, True, BKW, GW, PRESCALE, ASM, DOT_PREC, DOT_F32)
        _gate_up_out(acc_g, acc_u, rows.to(tl.int64), row_ok, cols, col_ok, HOUT, s_ht, PART, s_ps, s_pr, CNT,
                     INTER, SPLIT_K, DOT_F32)
    else:  # (names of their own: a variable set in both branches must have one shape)
        c, s_tok, s_ok = _shared_rows(pid_m, NB, S_CH, T, SH_M)
        s_g = tl.zeros((BLOCK_N, SH_M), dtype=tl.float32)
        s_u = tl.zeros((BLOCK_N, SH_M), dtype=tl.float32)
        s_g, s_u = _dense_dot2(s_g, s_u, X, s_tok, s_ok, s_xt, WSG + c.to(tl.int64) * s_swe,
                               WSU + c.to(tl.int64) * s_swe, s_swn, cols, col_ok, kw_lo * 8, kw_hi * 8,
                               True, BK_SH, DOT_PREC, DOT_F32)
        _gate_up_out(s_g, s_u, A + s_tok * S_CH + c, s_ok, cols, col_ok, HOUT, s_ht, PART, s_ps, s_pr, CNT,
                     INTER, SPLIT_K, DOT_F32)


@triton.jit
def _down_kernel(HIN, WD, SD, Y, ORDER, WEIGHT, BLK_E, BLK_R0, BLK_R1, HID, INTER, IW,
                 s_ht, s_we, s_wn, s_se, s_sn, s_yt, WSD, NB, T, A, TOPK, S_CH, s_swe, s_swn, MAGIC, MAGIC2,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BKW: tl.constexpr, BK_SH: tl.constexpr,
                 SH_M: tl.constexpr, GW: tl.constexpr, PRESCALE: tl.constexpr, ASM: tl.constexpr,
                 DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """Y [T, TOPK + S_CH, HID] fp32: routed pair a = t * TOPK + j at row t * (TOPK + S_CH) + j
    (times its weight; INT4 WD / SD, IW = inter / 8 words), shared chunk c of token t at row
    t * (TOPK + S_CH) + TOPK + c (dense WSD + c * s_swe, row stride s_swn)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, r0, r1 = _block_head(BLK_E, BLK_R0, BLK_R1, pid_m, NB)
    if e < 0:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < HID
    if pid_m < NB:
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < r1
        pair = tl.load(ORDER + rows, mask=row_ok, other=0).to(tl.int64)
        wt = tl.load(WEIGHT + pair, mask=row_ok, other=0.0)
        e64 = e.to(tl.int64)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        hrows = rows.to(tl.int64)
        wd, sd = WD + e64 * s_we, SD + e64 * s_se
        acc, acc2 = _int4_dot2(acc, acc, HIN, hrows, row_ok, s_ht, wd, wd, sd, sd, s_wn, s_sn, cols, col_ok,
                               0, IW, MAGIC, MAGIC2, False, BKW, GW, PRESCALE, ASM, DOT_PREC, DOT_F32)
        yrows = (pair // TOPK) * (TOPK + S_CH) + pair % TOPK
        tl.store(Y + yrows[None, :] * s_yt + cols[:, None], acc * wt[None, :], mask=col_ok[:, None] & row_ok[None, :])
    else:  # (names of their own: a variable set in both branches must have one shape)
        c, s_tok, s_ok = _shared_rows(pid_m, NB, S_CH, T, SH_M)
        w_p = WSD + c.to(tl.int64) * s_swe
        s_acc = tl.zeros((BLOCK_N, SH_M), dtype=tl.float32)
        s_acc, s_acc2 = _dense_dot2(s_acc, s_acc, HIN, A + s_tok * S_CH + c, s_ok, s_ht, w_p, w_p, s_swn, cols,
                                    col_ok, 0, INTER, False, BK_SH, DOT_PREC, DOT_F32)
        s_rows = s_tok * (TOPK + S_CH) + TOPK + c
        tl.store(Y + s_rows[None, :] * s_yt + cols[:, None], s_acc, mask=col_ok[:, None] & s_ok[None, :])


def default_tiles(pairs: int, num_local: int, interp: bool) -> Tiles:
    """The call's tiles when none are given: the interpreter's small tiles on the CPU, else
    SMALL_TILES for decode / verify sizes and LARGE_TILES from LARGE_ROWS_PER_EXPERT pairs an
    expert on average."""
    if interp:
        return INTERPRETER_TILES
    return LARGE_TILES if pairs >= LARGE_ROWS_PER_EXPERT * max(num_local, 1) else SMALL_TILES


def plan_split(pairs: int, num_local: int, inter: int, hid_words: int, block_n: int, block_kw: int,
               num_sms: int, extra_blocks: int = 0, block_m: int = 16) -> int:
    """gate_up's split count from host-known shapes (graph-capturable): busy programs = (routed
    blocks, at least min(pairs, experts) and pairs / block_m, + extra_blocks, the shared experts'
    blocks) x inter / block_n column tiles; split K (a power of two, at most MAX_SPLIT_K, each split
    MIN_SPLIT_STEPS steps of block_kw words or more) until they reach PROGRAMS_PER_SM x SMs. Kimi
    K2 TP8, one decode token + the shared expert: 9 blocks x 4 tiles = 36 programs -> 8 splits."""
    blocks = max(1, min(pairs, num_local), triton.cdiv(pairs, block_m))
    busy = (blocks + extra_blocks) * triton.cdiv(inter, block_n)
    s = 1
    while (s < MAX_SPLIT_K and busy * s < PROGRAMS_PER_SM * num_sms
           and hid_words >= 2 * s * MIN_SPLIT_STEPS * block_kw):
        s *= 2
    return s


def _check_int4(w: Int4Weight, name: str, shape: tuple, device: torch.device) -> None:
    """STYLE rule 5: the stack's logical shape, int32 words and float scales with unit stride
    along K, on x's device."""
    if not isinstance(w, Int4Weight):
        raise TypeError(f"{name} must be an Int4Weight stack, got {type(w).__name__}")
    assert w.shape == shape, (name, w.shape, shape)
    assert w.packed.dtype == torch.int32 and w.scale.dtype.is_floating_point, (name, w.packed.dtype, w.scale.dtype)
    assert w.packed.stride(-1) == 1 and w.scale.stride(-1) == 1, (name, w.packed.stride(), w.scale.stride())
    assert w.packed.device == device and w.scale.device == device, (name, w.packed.device, device)


def _check_args(x, topk_weights, topk_ids, w_gate, w_up, w_down, shared) -> int:
    """Shapes, strides and dtypes of a call; returns the shared experts' chunk count (0: none)."""
    t, hid = x.shape
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.stride(-1) == 1, (x.dtype, x.stride())
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == t, (topk_ids.shape, topk_weights.shape)
    if not isinstance(w_gate, Int4Weight):
        raise TypeError(f"w_gate must be an Int4Weight stack, got {type(w_gate).__name__}")
    e, inter, _ = w_gate.shape
    _check_int4(w_gate, "w_gate", (e, inter, hid), x.device)
    _check_int4(w_up, "w_up", (e, inter, hid), x.device)
    _check_int4(w_down, "w_down", (e, hid, inter), x.device)
    # gate and up share one set of strides and one group size in the launch
    assert w_up.packed.stride() == w_gate.packed.stride() and w_up.scale.stride() == w_gate.scale.stride()
    assert w_up.group_size == w_gate.group_size, (w_up.group_size, w_gate.group_size)
    if shared is None:
        return 0
    s_ch = shared_chunks(shared, inter)
    if not s_ch:
        raise ValueError(f"shared experts of {shared[0].shape[0]} columns do not split into experts of {inter}")
    for w in shared:
        assert w.stride(-1) == 1 and w.dtype == x.dtype and w.device == x.device, (w.dtype, w.stride(), w.device)
    assert shared[0].stride() == shared[1].stride()
    return s_ch


def _routing(topk_ids, e: int, expert_offset: int, block_m: int, stats):
    """(order, block_expert, block_row0, block_row1, stats counted): one routing launch (which
    fills stats where it can)."""
    order, blk_e, r0, r1, _, counted = route_blocks(topk_ids, e, expert_offset, block_m, stats=stats)
    return order, blk_e, r0, r1, counted


def _prescale(dtype: torch.dtype) -> bool:
    """x may carry 16^-3 (see the module docstring): not in fp16 (x * 2^-12 underflows)."""
    return dtype != torch.float16


def moe_experts_portable(x, topk_weights, topk_ids, w_gate, w_up, w_down, expert_offset=0, num_experts=None,
                         split_k=None, shared=None, stats=None, tiles=None):
    """`moe_w4a16.moe_experts_w4a16` on the portable kernels.

    x [T, hidden] (fp32 / bf16 / fp16, last dim contiguous); topk_weights [T, K] float; topk_ids
    [T, K] int (global expert ids); w_gate, w_up `Int4Weight` of logical shape [E, inter, hidden]
    (packed [E, inter, hidden / 8] int32, scale [E, inter, hidden / G]; gate and up with the same
    strides and group size), w_down `Int4Weight` [E, hidden, inter]: this rank's experts
    expert_offset .. +E; num_experts = the router's width (None: E). Returns out [T, hidden] in
    x.dtype. shared: the shared experts' (gate [Si, hidden], up, down [hidden, Si]) in x.dtype,
    added to every token as Si / inter experts of weight 1 in the same launches. stats: as
    `moe_gemm.moe_experts_triton`.
    Scratch: H [A + T * chunks, inter] (x.dtype), Y [T * (K + chunks), hidden] fp32, and with split
    K fp32 partials [split_k, A + T * chunks, 2 inter]. tiles: a `Tiles` (default `default_tiles`);
    split_k: gate_up's split count (None: `plan_split` on
    CUDA, 1 in the interpreter). Launches: routing (unless routed), gate_up, down, the top-k sum.
    """
    s_ch = _check_args(x, topk_weights, topk_ids, w_gate, w_up, w_down, shared)
    t, hid = x.shape
    e, inter, _ = w_gate.shape
    k = topk_ids.shape[1]
    a = t * k
    if a == 0:
        if stats is not None:
            _count_stats(topk_ids, stats)
        return torch.zeros_like(x)
    interp = _interpreting()
    tiles, split_k, kw_chunk = call_plan(t, k, e, inter, hid, s_ch, x.device, tiles, split_k)
    bm = tiles.block_m
    order, blk_e, blk_r0, blk_r1, counted = _routing(topk_ids, e, expert_offset, bm, stats)
    if stats is not None and not counted:
        _count_stats(topk_ids, stats)
    weight = topk_weights.reshape(-1).float().contiguous()
    owned_all = expert_offset == 0 and (num_experts is None or num_experts == e)
    ks = k + s_ch  # Y rows a token
    # pairs of experts this rank does not own are never written: zero them (EP only)
    y = (torch.empty if owned_all else torch.zeros)(t * ks, hid, device=x.device, dtype=torch.float32)
    sg, su, sd = shared if s_ch else (x, x, x)  # unused pointers without shared experts
    nb = blk_e.shape[0]
    grid_m = nb + triton.cdiv(t, SHARED_M) * s_ch
    meta = dict(BLOCK_M=bm, SH_M=SHARED_M, GW=w_gate.group_size // PACK,
                PRESCALE=_prescale(x.dtype), ASM=x.dtype in UNPACK_PTX and not interp,
                DOT_PREC="ieee" if x.dtype == torch.float32 or interp else "tf32", DOT_F32=interp)
    h = torch.empty(a + t * s_ch, inter, device=x.device, dtype=x.dtype)
    if split_k > 1:
        part = torch.empty(split_k, a + t * s_ch, 2 * inter, device=x.device, dtype=torch.float32)
        cnt = _tile_counters(x.device, grid_m * triton.cdiv(inter, tiles.gu_n))
    else:
        part, cnt = h, blk_e  # unused
    pg, ps = w_gate.packed, w_gate.scale
    _gate_up_kernel[(grid_m, triton.cdiv(inter, tiles.gu_n), split_k)](
        x, pg, w_up.packed, ps, w_up.scale, h, order, blk_e, blk_r0, blk_r1, inter, k, hid // PACK,
        x.stride(0), pg.stride(0), pg.stride(1), ps.stride(0), ps.stride(1), h.stride(0), part, cnt, kw_chunk,
        part.stride(0) if split_k > 1 else 0, part.stride(1) if split_k > 1 else 0,
        sg, su, nb, t, a, max(s_ch, 1), inter * sg.stride(0), sg.stride(0), MAGIC, UNPACK_PTX.get(x.dtype, (0, 0))[1],
        BLOCK_N=tiles.gu_n, BKW=tiles.gu_kw, BK_SH=tiles.shared_k, SPLIT_K=split_k, **meta,
        num_stages=tiles.stages, num_warps=tiles.gu_warps)
    # the shared down weight [hidden, Si]: chunk c is columns c * inter .., row stride Si
    pd, sdn = w_down.packed, w_down.scale
    meta["GW"] = w_down.group_size // PACK
    _down_kernel[(grid_m, triton.cdiv(hid, tiles.down_n))](
        h, pd, sdn, y, order, weight, blk_e, blk_r0, blk_r1, hid, inter, inter // PACK,
        h.stride(0), pd.stride(0), pd.stride(1), sdn.stride(0), sdn.stride(1), y.stride(0),
        sd, nb, t, a, k, s_ch, inter, sd.stride(0), MAGIC, UNPACK_PTX.get(x.dtype, (0, 0))[1],
        BLOCK_N=tiles.down_n, BKW=tiles.down_kw, BK_SH=tiles.shared_k, **meta,
        num_stages=tiles.stages, num_warps=tiles.down_warps)
    out = torch.empty(t, hid, device=x.device, dtype=x.dtype)
    block = 128 if interp else 1024
    _sum_rows_kernel[(t, triton.cdiv(hid, block))](
        y, out, hid, y.stride(0), out.stride(0), KS=ks, KS_PAD=max(2, triton.next_power_of_2(ks)),
        BLOCK=block, num_warps=4)
    return out


def call_plan(tokens: int, top_k: int, e: int, inter: int, hid: int, shared_chunks: int, device: torch.device,
              tiles: Tiles | None = None, split_k: int | None = None) -> tuple[Tiles, int, int]:
    """A call's (tiles, gate_up split count, words a split) from host-known shapes: tiles as given
    or `default_tiles`; the split as given (`RuntimeOptions.w4a16_split_k`), else `plan_split` on
    CUDA (1 in the interpreter); clamped so that no split is empty."""
    pairs = tokens * top_k
    tiles = tiles or default_tiles(pairs, e, _interpreting())
    shared_blocks = triton.cdiv(tokens, SHARED_M) * shared_chunks
    hid_words = hid // PACK
    if split_k is None:
        split_k = 1 if _interpreting() or device.type != "cuda" else plan_split(
            pairs, e, inter, hid_words, tiles.gu_n, tiles.gu_kw, _num_sms(device.index or 0), shared_blocks,
            tiles.block_m)
    split_k = max(1, min(int(split_k), triton.cdiv(hid_words, tiles.gu_kw)))
    kw_chunk = triton.cdiv(triton.cdiv(hid_words, split_k), tiles.gu_kw) * tiles.gu_kw
    return tiles, triton.cdiv(hid_words, kw_chunk), kw_chunk


def _count_stats(topk_ids, stats) -> None:
    from treeflash.kernels.moe_gemm import _count_stats as count

    count(topk_ids, stats)
