"""The grouped W4A16 MoE kernels (Triton interpreter on CPU) against a float64 computation from
weights that compressed-tensors unpacked, and against the torch twin (which dequantizes): the
portable Triton kernel and the Gluon MMA kernel (`kernels/moe_w4a16/mma.py`, run on the CPU
through `kernels/gluon_interp.py`: its values, addressing, masks and atomics; its layouts and
inline PTX only compile and run on a GPU).

With TRITON_INTERPRET=0 on a CUDA machine the same cases run compiled, on the GPU
(benchmarks/gpu_w4a16.sh): the inputs are made on the CPU and moved there."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402

from treeflash import kernels  # noqa: E402
from treeflash.kernels import device, moe_w4a16, reference  # noqa: E402
from treeflash.kernels.int4 import Int4Weight  # noqa: E402
from treeflash.kernels.moe_w4a16 import Tiles, moe_experts_w4a16, plan_split  # noqa: E402
from treeflash.kernels.moe_w4a16.mma import UNPACK8_PTX, MmaTiles  # noqa: E402
from treeflash.kernels.testing import assert_close  # noqa: E402

pytestmark = pytest.mark.slow

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"


def _int4(e: int, n: int, k: int, group: int, g: torch.Generator) -> Int4Weight:
    """Random words (every nibble 0..15, so q = -8..7 and words with the sign bit set) and bf16
    group scales of about 1 / (4 sqrt(k)): W's rows have unit-scale dot products with x."""
    packed = torch.randint(-2**31, 2**31, (e, n, k // 8), generator=g, dtype=torch.int64).to(torch.int32)
    scale = ((torch.rand(e, n, k // group, generator=g) + 0.5) * 0.25 * k ** -0.5).to(torch.bfloat16)
    return Int4Weight(packed.to(DEVICE), scale.to(DEVICE), group)


def _ct_dequant(w: Int4Weight) -> torch.Tensor:
    """W in float64 from compressed-tensors' own unpacking of the words (the format's definition)."""
    q = unpack_from_int32(w.packed.cpu(), 4, torch.Size(w.shape))  # [E, N, K] int8
    return q.double() * w.scale.cpu().double().repeat_interleave(w.group_size, dim=-1)


def _case(t, k, e_total, e_local, hid, inter, group, dtype, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hid, generator=g).to(dtype)
    scores = torch.rand(t, e_total, generator=g)
    if skew:  # most pairs on two experts: long segments cut into several blocks
        scores[:, :2] += 10.0
    ids = scores.topk(k, dim=-1).indices
    w = torch.rand(t, k, generator=g) + 0.1
    wq = [_int4(e_local, inter, hid, group, g), _int4(e_local, inter, hid, group, g),
          _int4(e_local, hid, inter, group, g)]
    return x.to(DEVICE), w.to(DEVICE), ids.to(DEVICE), wq


def _shared(hid, si, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(si, hid, generator=g) * hid ** -0.5).to(DEVICE, dtype),
            (torch.randn(si, hid, generator=g) * hid ** -0.5).to(DEVICE, dtype),
            (torch.randn(hid, si, generator=g) * si ** -0.5).to(DEVICE, dtype))


def _loop64(x, w, ids, wq, offset, shared=None):
    """The per-expert loop in float64 on compressed-tensors' dequantized weights (+ the shared MLP)."""
    wg, wu, wd = (_ct_dequant(q) for q in wq)
    x, w, ids = x.cpu(), w.cpu(), ids.cpu()
    shared = None if shared is None else [s.cpu() for s in shared]
    x64 = x.double()
    out = torch.zeros_like(x64)
    for local in range(wg.shape[0]):
        token, slot = torch.where(ids == offset + local)
        if token.numel():
            h = F.silu(x64[token] @ wg[local].T) * (x64[token] @ wu[local].T)
            out.index_add_(0, token, (h @ wd[local].T) * w[token, slot, None].double())
    if shared is not None:
        sg, su, sd = (s.double() for s in shared)
        out = out + F.linear(F.silu(F.linear(x64, sg)) * F.linear(x64, su), sd)
    return out


def _check(ours, x, w, ids, wq, offset, e_total, dtype, shared=None, what="moe"):
    """float32: the float64 loop; 16-bit: the torch twin (its own error is checked against the loop)."""
    assert ours.dtype == dtype and ours.shape == x.shape
    want = _loop64(x, w, ids, wq, offset, shared)
    if dtype == torch.float32:
        assert_close(ours, want.to(dtype), dtype, what)
        return
    twin = reference.moe_experts(x, w, ids, *wq, offset, e_total, shared=shared)
    assert_close(twin, want.to(dtype), dtype, what + " (twin)")
    assert_close(ours, twin, dtype, what)


F32, BF16 = torch.float32, torch.bfloat16
CASES = [  # t, k, e_total, e_local, offset, hidden, inter, group, shared chunks, split_k, dtype
    (1, 2, 8, 8, 0, 64, 32, 32, 0, 1, BF16),  # one decode row
    (1, 4, 8, 8, 0, 256, 32, 32, 1, 4, F32),  # decode + the shared expert, hidden split 4 ways
    (1, 4, 8, 8, 0, 256, 32, 32, 1, 4, BF16),
    (3, 3, 8, 8, 0, 96, 24, 8, 2, 1, F32),  # odd sizes: 12 words (a masked K step), 3-word down rows
    (17, 2, 6, 6, 0, 160, 48, 16, 1, 3, F32),  # a 16-node tree + root, ragged last split
    (17, 2, 6, 6, 0, 160, 48, 16, 1, 1, BF16),
    (127, 2, 16, 16, 0, 64, 32, 32, 0, 1, F32),  # skewed: more pairs an expert than BLOCK_M
    (2, 2, 8, 8, 0, 256, 128, 128, 0, 2, F32),  # groups as long as a K step and longer (one scale a row)
    (9, 2, 8, 4, 4, 64, 32, 32, 1, 2, F32),  # expert parallel: this rank owns 4..7, shared still added
    (9, 2, 8, 4, 0, 64, 32, 32, 0, 1, BF16),  # ... or 0..3
]


@pytest.mark.parametrize("case", CASES, ids=[f"t{c[0]}E{c[3]}@{c[4]}h{c[5]}g{c[7]}c{c[8]}s{c[9]}-{c[10]}"
                                             for c in CASES])
def test_matches_float64_and_twin(case, monkeypatch):
    """The portable kernel on every case (pinned: 16-bit calls would take the MMA kernel)."""
    monkeypatch.setenv("TREEFLASH_W4A16_IMPL", "portable")
    t, k, e_total, e_local, offset, hid, inter, group, chunks, split, dtype = case
    x, w, ids, wq = _case(t, k, e_total, e_local, hid, inter, group, dtype, seed=t + hid, skew=t > 30)
    shared = _shared(hid, inter * chunks, dtype, seed=t) if chunks else None
    ours = kernels.moe_experts(x, w, ids, *wq, offset, e_total, impl="triton", shared=shared) if split == 1 else \
        moe_experts_w4a16(x, w, ids, *wq, offset, e_total, split_k=split, shared=shared)
    _check(ours, x, w, ids, wq, offset, e_total, dtype, shared)


T8 = MmaTiles(8, 16, 16, 1, 1, 2)  # the interpreter's default: blocks of 8, one warp, 8-word steps
MMA_CASES = [  # t, k, e_total, e_local, offset, hidden, inter, group, shared chunks, split, dtype, tiles
    (1, 2, 8, 8, 0, 64, 32, 32, 0, 1, BF16, T8),  # a decode row, no routing launch (T <= block_m)
    (1, 4, 8, 8, 0, 256, 32, 32, 1, 4, BF16, T8),  # + the shared expert, gate_up split 4 ways
    (8, 3, 16, 16, 0, 128, 32, 32, 1, 2, BF16, T8),  # T = block_m: an expert's tokens fill a block
    (12, 3, 8, 8, 0, 160, 96, 32, 1, 1, BF16, MmaTiles(8, 64, 64, 1, 4, 2)),  # routed, ragged last row tiles
    (3, 3, 8, 8, 0, 96, 24, 8, 2, 1, BF16, T8),  # 12 words (a partial step), 3-word down rows, 2 chunks
    (17, 2, 6, 6, 0, 160, 48, 16, 1, 3, BF16, T8),  # a tree + root, ragged last split, groups of 2 words
    (40, 2, 16, 16, 0, 64, 32, 32, 0, 1, BF16, MmaTiles(16, 16, 32, 1, 1, 1)),  # skewed: 2+ blocks an expert
    (2, 2, 8, 8, 0, 512, 64, 32, 1, 1, BF16, MmaTiles(8, 32, 64, 4, 2, 2)),  # 4 blocks a step, 2 warps
    (2, 2, 8, 8, 0, 512, 64, 8, 1, 2, BF16, MmaTiles(8, 32, 64, 4, 2, 1)),  # a scale a word, depth 1
    (2, 2, 8, 8, 0, 512, 128, 128, 0, 1, BF16, MmaTiles(8, 16, 32, 2, 1, 2)),  # a group longer than a step
    (9, 2, 8, 4, 4, 64, 32, 32, 1, 2, BF16, T8),  # expert parallel: this rank owns 4..7, shared still added
    (9, 2, 8, 4, 0, 64, 32, 32, 0, 1, BF16, MmaTiles(16, 16, 16, 1, 1, 2)),  # ... owns 0..3, no shared
    (5, 2, 8, 8, 0, 64, 32, 32, 1, 1, torch.float16, T8),  # fp16 (scales in fp16: f16x2 unpack)
]


@pytest.mark.parametrize("case", MMA_CASES, ids=[
    f"t{c[0]}E{c[3]}@{c[4]}h{c[5]}g{c[7]}c{c[8]}s{c[9]}-{str(c[10])[6:]}-{c[11].spec()}" for c in MMA_CASES])
def test_mma_matches_float64_and_twin(case):
    """The MMA kernel: decode without routing, routed blocks, split K, shared chunks, partial
    steps and tiles, groups shorter / longer than a lane's words, EP, fp16."""
    t, k, e_total, e_local, offset, hid, inter, group, chunks, split, dtype, tiles = case
    x, w, ids, wq = _case(t, k, e_total, e_local, hid, inter, group, dtype, seed=t + hid, skew=t > 30)
    if dtype == torch.float16:  # the MMA kernel takes scales in x's dtype
        wq = [Int4Weight(q.packed, q.scale.to(dtype), q.group_size) for q in wq]
    shared = _shared(hid, inter * chunks, dtype, seed=t) if chunks else None
    assert moe_w4a16.mma.supported(x, wq[0], wq[2], shared) is None
    ours = moe_experts_w4a16(x, w, ids, *wq, offset, e_total, shared=shared, impl="mma", mma_tiles=tiles,
                             split_k=split)
    _check(ours, x, w, ids, wq, offset, e_total, dtype, shared)


def test_mma_counters_and_determinism():
    """The MMA call leaves every arrival counter (gate_up's split K, down's top-k sum) at zero, and
    a second call gives the same bits; fp32 x and groups not a power of two x 8 go portable."""
    x, w, ids, wq = _case(3, 2, 8, 8, 128, 16, 16, torch.bfloat16, seed=3)
    shared = _shared(128, 16, torch.bfloat16, seed=4)
    first = moe_experts_w4a16(x, w, ids, *wq, shared=shared, impl="mma", mma_tiles=T8, split_k=4)
    assert all(int(c.abs().sum()) == 0 for c in device._counters.values())
    assert torch.equal(moe_experts_w4a16(x, w, ids, *wq, shared=shared, impl="mma", mma_tiles=T8, split_k=4), first)
    assert "bf16 / fp16" in moe_w4a16.mma.supported(x.float(), wq[0], wq[2], None)
    odd = _int4(8, 16, 96, 24, torch.Generator().manual_seed(0))
    assert "group 24" in moe_w4a16.mma.supported(x[:, :96], odd, wq[2], None)


def test_fp16_takes_the_unscaled_nibbles():
    """fp16 (no 16^-v on x: it would underflow) against the twin, a decode row and a tree."""
    for t in (1, 17):
        x, w, ids, wq = _case(t, 2, 8, 8, 64, 32, 32, torch.float16, seed=t)
        _check(kernels.moe_experts(x, w, ids, *wq, impl="triton"), x, w, ids, wq, 0, 8, torch.float16)


def test_split_k_counters_and_determinism():
    """Split K gives the unsplit result; the tile counters are back at zero, so a second call sums
    the same partials the same way (bit for bit)."""
    x, w, ids, wq = _case(2, 2, 8, 8, 128, 16, 16, torch.bfloat16, seed=3)
    shared = _shared(128, 16, torch.bfloat16, seed=4)
    split = moe_experts_w4a16(x, w, ids, *wq, split_k=4, shared=shared)
    one = moe_experts_w4a16(x, w, ids, *wq, split_k=1, shared=shared)
    assert_close(split, one, torch.bfloat16, "split K against one split")
    assert all(int(c.abs().sum()) == 0 for c in device._counters.values())
    assert torch.equal(moe_experts_w4a16(x, w, ids, *wq, split_k=4, shared=shared), split)


@pytest.mark.parametrize("tiles", [Tiles(32, 16, 16, 32, 16, 16, 1), Tiles(16, 32, 32, 16, 16, 64, 2, 4, 2)])
def test_other_tiles(tiles):
    """Other block sizes / tiles (argument; `RuntimeOptions.w4a16_tiles`' integers through
    `kernels.moe_experts`) give the same result."""
    x, w, ids, wq = _case(12, 3, 8, 8, 128, 32, 32, torch.float32, seed=5)
    shared = _shared(128, 32, torch.float32, seed=6)
    want = _loop64(x, w, ids, wq, 0, shared).float()
    assert_close(moe_experts_w4a16(x, w, ids, *wq, shared=shared, tiles=tiles), want, torch.float32, "tiles")
    ints = tuple(int(v) for v in tiles.spec().split(":"))
    got = kernels.moe_experts(x, w, ids, *wq, impl="triton", shared=shared, tiles=ints, split_k=2)
    assert_close(got, want, torch.float32, "kernels.moe_experts tiles")


def test_tiles_parse_refuses_bad_sizes():
    assert Tiles.parse([32, 64, 16, 64, 16, 64, 1]) == Tiles(32, 64, 16, 64, 16, 64, 1, 4, 4)
    for bad in ([8, 64, 16, 64, 16, 64, 1], [16, 64, 24, 64, 16, 64, 1], [16, 64, 16, 64, 16, 8, 1, 4, 4]):
        with pytest.raises(ValueError, match="power of two >= 16"):
            Tiles.parse(bad)


def test_untouched_experts_are_never_read():
    """NaN scales in experts no token picked must not reach the output."""
    x, w, ids, wq = _case(5, 2, 8, 8, 64, 32, 32, torch.float32, seed=7)
    ids = torch.tensor([[0, 3], [3, 5], [5, 0], [0, 3], [5, 3]], device=DEVICE)
    for e in (1, 2, 4, 6, 7):
        for q in wq:
            q.scale[e] = float("nan")
    got = moe_experts_w4a16(x, w, ids, *wq)
    assert torch.isfinite(got).all()
    assert_close(got, _loop64(x, w, ids, wq, 0).float(), torch.float32, "poisoned")


@pytest.mark.parametrize("offset", [0, 4])
def test_stats_filled(offset):
    """stats: last = tokens per expert of these ids, total += last, whether the routing launch
    fills them (every expert local) or the counting kernel does (expert parallel)."""
    x, w, ids, wq = _case(6, 2, 8, 8 - offset, 64, 32, 32, torch.float32, seed=8)
    stats = (torch.full((8,), 3, dtype=torch.long, device=DEVICE), torch.arange(8, device=DEVICE))
    want = (stats[0].clone(), stats[1].clone())
    kernels.expert_counts(ids, *want, impl="torch")
    moe_experts_w4a16(x, w, ids, *wq, offset, 8, stats=stats)
    assert torch.equal(stats[0], want[0]) and torch.equal(stats[1], want[1])


def test_bad_inputs_refused():
    x, w, ids, wq = _case(2, 2, 8, 8, 64, 32, 32, torch.float32, seed=11)
    dense = wq[0].dequantize()
    with pytest.raises(TypeError, match="all be Int4Weight"):
        kernels.moe_experts(x, w, ids, dense, wq[1], wq[2], impl="triton")
    with pytest.raises(ValueError, match="do not split"):
        moe_experts_w4a16(x, w, ids, *wq, shared=_shared(64, 48, torch.float32, 0))
    with pytest.raises(AssertionError):  # down of the wrong logical shape
        moe_experts_w4a16(x, w, ids, wq[0], wq[1], wq[0])
    with pytest.raises(AssertionError):  # x in another dtype than the shared experts
        moe_experts_w4a16(x.to(torch.bfloat16), w, ids, *wq, shared=_shared(64, 32, torch.float32, 0))


def test_dispatch_and_mma_plan(monkeypatch):
    """The table's rows, the pins, and the MMA split plan at Kimi K2 TP8 on 132 SMs: one decode
    token (8 routed + 1 shared block x 8 column tiles) splits gate_up 8 ways: routed programs of
    128 words, shared ones of 32 (a 16-bit word is ~4x the bytes), 672 programs in all."""
    from treeflash.kernels.moe_w4a16 import dispatch, mma

    monkeypatch.delenv("TREEFLASH_W4A16_IMPL", raising=False)
    monkeypatch.delenv("TREEFLASH_W4A16_MMA", raising=False)
    assert [dispatch.rule(t).max_rows for t in (1, 8, 9, 16, 17, 64, 65, 1024)] == [8, 8, 16, 16, 64, 64, 512, 1 << 62]
    assert dispatch.impl(1) == "mma"
    monkeypatch.setenv("TREEFLASH_W4A16_IMPL", "portable")
    assert dispatch.impl(1) == "portable"
    monkeypatch.setenv("TREEFLASH_W4A16_MMA", "16:64:64:2:4:1")
    assert dispatch.mma_tiles(1, 8, 384) == MmaTiles(16, 64, 64, 2, 4, 1)
    monkeypatch.delenv("TREEFLASH_W4A16_MMA")
    monkeypatch.setattr(mma, "_num_sms", lambda index: 132)
    monkeypatch.setattr(mma.gluon_interp, "interpreting", lambda: False)
    p = mma.plan(1, 8, 384, 256, 7168, 1, torch.device("cuda"))
    assert (p.slots, p.split_r, p.kw_r, p.split_s, p.kw_s) == (True, 7, 128, 28, 32)
    p = mma.plan(64, 8, 384, 256, 7168, 1, torch.device("cuda"))
    assert not p.slots and p.split_r == 1 and p.tiles == dispatch.rule(64).tiles
    for bad in ([4, 32, 64, 4, 4, 2], [8, 24, 64, 4, 4, 2], [8, 32, 64, 4, 4, 3]):
        with pytest.raises(ValueError):
            MmaTiles.parse(bad)


def test_plan_split_and_default_tiles():
    """Kimi K2 TP8 (inter 256: 4 column tiles of 64, hidden 7168 = 896 words) on 132 SMs: a
    decode token + the shared expert (36 programs) takes 8 splits, 2 tokens 4, 8 tokens 2, a
    32-node tree none; short K is never cut below MIN_SPLIT_STEPS steps a split."""
    assert plan_split(8, 384, 256, 896, 64, 32, 132, extra_blocks=1) == 8
    assert plan_split(16, 384, 256, 896, 64, 32, 132, extra_blocks=1) == 4
    assert plan_split(64, 384, 256, 896, 64, 32, 132, extra_blocks=1) == 2
    assert plan_split(256, 384, 256, 896, 64, 32, 132, extra_blocks=2) == 1
    assert plan_split(8, 384, 256, 64, 64, 32, 132) == 1
    assert plan_split(8, 384, 256, 896, 64, 16, 132, extra_blocks=1) == 8  # 112 words a split = 7 steps of 16
    assert moe_w4a16.default_tiles(8, 384, False) == moe_w4a16.SMALL_TILES
    assert moe_w4a16.default_tiles(8 * 1024, 384, False) == moe_w4a16.LARGE_TILES
    assert moe_w4a16.default_tiles(8, 384, True) == moe_w4a16.INTERPRETER_TILES


def _run_ptx(asm: str, operands: dict[str, int], dtype: torch.dtype) -> dict[str, int]:
    """Interpret the few PTX instructions `_UNPACK_ASM` uses (mov, shr, prmt, lop3, fma.rn on
    16-bit pairs) on 32-bit values: $n operands in, registers out (the GPU test runs the real thing)."""
    regs = dict(operands)

    def val(tok: str) -> int:
        return regs[tok] if tok in regs else int(tok, 0)

    def halves(v: int) -> torch.Tensor:
        return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(dtype).double()

    for line in asm.split(";"):
        toks = line.replace(",", " ").split()
        if not toks or toks[0] in ("{", "}", ".reg") or toks[0].startswith("."):
            continue
        op, d, *a = toks[0].lstrip("{").strip(), *toks[1:]
        if op == ".reg" or not op:
            continue
        if op == "mov.b32":
            regs[d] = val(a[0])
        elif op == "shr.b32":
            regs[d] = val(a[0]) >> val(a[1])
        elif op == "prmt.b32":  # byte i of d = byte (selector nibble i) of {a1, a0}
            src, sel = val(a[0]) | val(a[1]) << 32, val(a[2])
            regs[d] = sum(((src >> 8 * (sel >> 4 * i & 7)) & 0xFF) << 8 * i for i in range(4))
        elif op == "lop3.b32":
            assert a[3] == "0xEA"  # (a & b) | c
            regs[d] = (val(a[0]) & val(a[1])) | val(a[2])
        elif op.startswith("fma.rn."):  # exact in float64, one rounding to the 16-bit type
            r = (halves(val(a[0])) * halves(val(a[1])) + halves(val(a[2]))).to(dtype)
            lo, hi = r.view(torch.int16).to(torch.int32).tolist()
            regs[d] = (lo & 0xFFFF) | (hi & 0xFFFF) << 16
        else:
            raise AssertionError(f"unexpected PTX {op}")
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unpack_ptx_gives_the_nibble_pairs(dtype):
    """`_UNPACK_ASM` on random words (every nibble, the sign bit) and scales: output m is
    (nibble 2m, nibble 2m + 1) x scale, each rounded once to the 16-bit type, low half first,
    as compressed-tensors unpacks the word."""
    asm, magic = moe_w4a16.UNPACK_PTX[dtype]
    g = torch.Generator().manual_seed(12)
    words = torch.randint(-2**31, 2**31, (64,), generator=g, dtype=torch.int64).to(torch.int32)
    q = unpack_from_int32(words[:, None], 4, torch.Size((64, 8)))  # [64, 8] int8 in -8..7
    scales = ((torch.rand(64, generator=g) + 0.5) * 0.01).to(dtype)
    for w, qs, sc in zip(words.tolist(), q, scales):
        s_bits = int(sc.view(torch.int16)) & 0xFFFF
        regs = _run_ptx(asm, {"$4": w & 0xFFFFFFFF, "$5": w & 0xFFFFFFFF, "$6": s_bits | s_bits << 16, "$7": magic,
                              "$8": magic}, dtype)
        for m in range(4):
            out = regs[f"${m}"]
            got = torch.tensor([out & 0xFFFF, out >> 16], dtype=torch.int32).to(torch.int16).view(dtype)
            want = (qs[2 * m:2 * m + 2].double() * sc.double()).to(dtype)
            assert torch.equal(got, want), (hex(w), m, got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unpack8_ptx_gives_the_nibbles_in_order(dtype):
    """The MMA kernel's pack=8 unpack (`mma.UNPACK8_PTX`: the word in $4, the scale pair in $12,
    the magic in $16): output m is (nibble 2m, nibble 2m + 1) x scale, each rounded once."""
    asm, magic = UNPACK8_PTX[dtype]
    g = torch.Generator().manual_seed(13)
    words = torch.randint(-2**31, 2**31, (64,), generator=g, dtype=torch.int64).to(torch.int32)
    q = unpack_from_int32(words[:, None], 4, torch.Size((64, 8)))
    scales = ((torch.rand(64, generator=g) + 0.5) * 0.01).to(dtype)
    for w, qs, sc in zip(words.tolist(), q, scales):
        s_bits = int(sc.view(torch.int16)) & 0xFFFF
        regs = _run_ptx(asm, {"$4": w & 0xFFFFFFFF, "$12": s_bits | s_bits << 16, "$16": magic}, dtype)
        for m in range(4):
            got = torch.tensor([regs[f"${m}"] & 0xFFFF, regs[f"${m}"] >> 16], dtype=torch.int32).to(torch.int16)
            assert torch.equal(got.view(dtype), (qs[2 * m:2 * m + 2].double() * sc.double()).to(dtype)), (hex(w), m)
