"""Grouped expert GEMM: Triton (interpreter on CPU) against the torch twin, the twin against the
per-expert loop it replaced, and the block routing's invariants."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from treeflash.kernels import device, moe_experts, moe_gemm, reference  # noqa: E402
from treeflash.kernels.moe_gemm import (  # noqa: E402
    BLOCK_M,
    ROUTE_MAX_LOCAL,
    ROUTE_MAX_PAIRS,
    moe_experts_triton,
    plan_split_k,
    route_blocks,
    route_blocks_torch,
)
from treeflash.kernels.testing import assert_close  # noqa: E402

pytestmark = pytest.mark.slow


def _case(t, k, e_total, e_local, offset, hid, inter, dtype, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hid, generator=g).to(dtype)
    scores = torch.rand(t, e_total, generator=g)
    if skew:  # most pairs on two experts: blocks must split long segments
        scores[:, :2] += 10.0
    ids = scores.topk(k, dim=-1).indices
    w = torch.rand(t, k, generator=g) + 0.1
    s = hid ** -0.5
    wg = (torch.randn(e_local, inter, hid, generator=g) * s).to(dtype)
    wu = (torch.randn(e_local, inter, hid, generator=g) * s).to(dtype)
    wd = (torch.randn(e_local, hid, inter, generator=g) * inter ** -0.5).to(dtype)
    return x, w, ids, wg, wu, wd, offset


def _loop(x, w, ids, wg, wu, wd, offset):
    """The per-expert loop MoE.forward ran before (host sync per layer), in float64."""
    x64 = x.double()
    out = torch.zeros_like(x64)
    for local in range(wg.shape[0]):
        token, slot = torch.where(ids == offset + local)
        if token.numel() == 0:
            continue
        h = x64[token]
        h = F.silu(h @ wg[local].double().T) * (h @ wu[local].double().T)
        out.index_add_(0, token, (h @ wd[local].double().T) * w[token, slot, None].double())
    return out


CASES = [  # t, k, e_total, e_local, offset, hidden, inter
    (1, 2, 8, 8, 0, 64, 32),  # one decode row
    (3, 3, 8, 8, 0, 40, 24),  # odd sizes, not multiples of any block
    (17, 2, 6, 6, 0, 33, 17),  # a 16-node tree + root
    (127, 8, 16, 16, 0, 48, 20),  # more pairs per expert than BLOCK_M
    (9, 2, 8, 4, 4, 32, 16),  # expert parallel: this rank owns experts 4..7
    (9, 2, 8, 4, 0, 32, 16),  # ... or 0..3
]


@pytest.mark.parametrize("case", CASES, ids=[f"t{c[0]}k{c[1]}E{c[3]}of{c[2]}@{c[4]}" for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_twin(case, dtype):
    t, k, e_total, e_local, offset, hid, inter = case
    x, w, ids, wg, wu, wd, off = _case(t, k, e_total, e_local, offset, hid, inter, dtype, skew=t > 100)
    ours = moe_experts(x, w, ids, wg, wu, wd, off, e_total, impl="triton")
    ref = reference.moe_experts(x, w, ids, wg, wu, wd, off, e_total)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert_close(ours, _loop(x, w, ids, wg, wu, wd, off).to(dtype) if dtype == torch.float32 else ref,
                 dtype, "moe out")


SPLIT_CASES = [  # t, k, e_total, e_local, offset, hidden, inter, split_k
    (1, 2, 8, 8, 0, 160, 32, 3),  # a decode row, hidden cut 64 / 64 / 32
    (3, 3, 8, 8, 0, 97, 24, 2),  # a ragged last chunk (64 + 33)
    (17, 2, 6, 6, 0, 33, 17, 8),  # more splits asked than 32-column steps: clamped to 2
    (9, 2, 8, 4, 4, 128, 16, 4),  # expert parallel
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=[f"t{c[0]}h{c[5]}s{c[7]}" for c in SPLIT_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_matches_twin(case, dtype):
    """gate_up cut along the hidden dimension (fp32 partials summed by the down kernel) gives
    the unsplit result."""
    *c, split = case
    t, k, e_total, e_local, offset, hid, inter = c
    x, w, ids, wg, wu, wd, off = _case(t, k, e_total, e_local, offset, hid, inter, dtype, seed=5)
    ours = moe_experts_triton(x, w, ids, wg, wu, wd, off, e_total, split_k=split)
    one = moe_experts_triton(x, w, ids, wg, wu, wd, off, e_total, split_k=1)
    ref = reference.moe_experts(x, w, ids, wg, wu, wd, off, e_total)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert_close(ours, _loop(x, w, ids, wg, wu, wd, off).to(dtype) if dtype == torch.float32 else ref,
                 dtype, "moe out, split K")
    assert_close(ours, one, dtype, "split K against one split")
    # the tile counters are left at zero, so a second call sums the same partials the same way
    assert all(int(c.abs().sum()) == 0 for c in device._counters.values())
    assert torch.equal(moe_experts_triton(x, w, ids, wg, wu, wd, off, e_total, split_k=split), ours)


SHARED_CASES = [  # t, k, e_total, e_local, offset, hidden, inter, shared chunks, split_k
    (1, 2, 8, 8, 0, 64, 32, 1, 1),  # a decode row, one shared expert of the routed size
    (3, 3, 8, 8, 0, 40, 24, 2, 1),  # odd sizes, shared MLP twice the routed width
    (17, 2, 6, 6, 0, 33, 17, 1, 1),  # a tree: 2 shared blocks of 16 / 1 token
    (9, 2, 8, 4, 4, 32, 16, 3, 1),  # expert parallel: unowned pairs zero, shared still added
    (1, 2, 8, 8, 0, 160, 32, 1, 3),  # split K over routed and shared blocks alike
    (5, 2, 8, 8, 0, 97, 24, 2, 2),
]


def _shared_mlp(hid, inter, chunks, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    si = inter * chunks
    sg = (torch.randn(si, hid, generator=g) * hid ** -0.5).to(dtype)
    su = (torch.randn(si, hid, generator=g) * hid ** -0.5).to(dtype)
    sd = (torch.randn(hid, si, generator=g) * si ** -0.5).to(dtype)
    return sg, su, sd


@pytest.mark.parametrize("case", SHARED_CASES, ids=[f"t{c[0]}E{c[3]}@{c[4]}c{c[7]}s{c[8]}" for c in SHARED_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_experts_in_the_call(case, dtype):
    """The shared MLP run as more experts of weight 1 inside the grouped launches equals the
    routed call plus a separate float64 MLP (and the torch twin's own shared path)."""
    *c, chunks, split = case
    t, k, e_total, e_local, offset, hid, inter = c
    x, w, ids, wg, wu, wd, off = _case(t, k, e_total, e_local, offset, hid, inter, dtype, seed=7)
    shared = _shared_mlp(hid, inter, chunks, dtype, seed=8)
    ours = moe_experts_triton(x, w, ids, wg, wu, wd, off, e_total, split_k=split, shared=shared)
    sg, su, sd = (s.double() for s in shared)
    x64 = x.double()
    expect = _loop(x, w, ids, wg, wu, wd, off) + F.linear(F.silu(F.linear(x64, sg)) * F.linear(x64, su), sd)
    twin = reference.moe_experts(x, w, ids, wg, wu, wd, off, e_total, shared=shared)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert_close(ours, expect.to(dtype) if dtype == torch.float32 else twin, dtype, "moe + shared")
    assert_close(twin, expect.to(dtype), dtype, "twin + shared")
    # without the shared MLP the same call is the routed experts alone
    alone = moe_experts_triton(x, w, ids, wg, wu, wd, off, e_total, split_k=split)
    assert_close(alone, reference.moe_experts(x, w, ids, wg, wu, wd, off, e_total), dtype, "routed only")


@pytest.mark.parametrize("tiles", [(32, 64, 64, 32, 2), (64, 32, 32, 64, 3), (32, 32, 32, 32, 3, 8, 2)])
def test_tiles_override(tiles):
    """Other gate_up / down tiles (the tuning argument; `RuntimeOptions.moe_tiles` through
    `kernels.moe_experts`) give the twin's result."""
    x, w, ids, wg, wu, wd, off = _case(5, 3, 8, 8, 0, 96, 64, torch.float32, seed=2)
    shared = _shared_mlp(96, 64, 1, torch.float32, seed=4)
    want = reference.moe_experts(x, w, ids, wg, wu, wd, off, shared=shared)
    got = moe_experts_triton(x, w, ids, wg, wu, wd, off, shared=shared, tiles=tiles)
    assert_close(got, want, torch.float32, "tiles")
    got = moe_experts(x, w, ids, wg, wu, wd, off, impl="triton", shared=shared, tiles=tiles, split_k=2)
    assert_close(got, want, torch.float32, "kernels.moe_experts tiles")


def test_default_tiles():
    """16-bit GPU calls take gate_up's 128-wide K step; float32 keeps 64 (at 128 its 3 stages need
    144 KB of shared memory, past a consumer GPU's 99 KB); the interpreter runs 32s."""
    assert moe_gemm.default_tiles(torch.bfloat16, False)[:2] == (64, 128)
    assert moe_gemm.default_tiles(torch.float16, False) == moe_gemm.GPU_TILES
    assert moe_gemm.default_tiles(torch.float32, False)[1] == 64
    assert moe_gemm.default_tiles(torch.float32, True) == (32, 32, 32, 32, 3)


def test_shared_chunks_rejects_other_widths():
    sg, su, sd = _shared_mlp(16, 24, 1, torch.float32, 0)
    assert moe_gemm.shared_chunks((sg, su, sd), 24) == 1
    assert moe_gemm.shared_chunks((sg, su, sd), 12) == 2
    assert moe_gemm.shared_chunks((sg, su, sd), 16) == 0  # 24 is not a multiple of 16
    x, w, ids, wg, wu, wd, off = _case(2, 2, 4, 4, 0, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="do not split"):
        moe_experts_triton(x, w, ids, wg, wu, wd, off, shared=(sg, su, sd))


def test_plan_split_k():
    """A decode token at Kimi K2 TP8 (8 pairs, inter 256: 4 column tiles, hidden 7168) gets 8
    splits, 2 tokens 4, 4 tokens 2 (128 programs), 8 tokens (256 programs: more than the
    H200's 132 SMs) and a 32-node tree none; a short hidden dimension is never cut below
    MIN_SPLIT_STEPS steps a split."""
    assert plan_split_k(8, 384, 256, 7168, 64, 64, 132) == 8
    assert plan_split_k(16, 384, 256, 7168, 64, 64, 132) == 4
    assert plan_split_k(32, 384, 256, 7168, 64, 64, 132) == 2
    assert plan_split_k(64, 384, 256, 7168, 64, 64, 132) == 1
    assert plan_split_k(64, 16, 256, 7168, 64, 64, 132) == 4  # 16 local experts (EP) bound it
    assert plan_split_k(256, 384, 256, 7168, 64, 64, 132) == 1
    assert plan_split_k(8, 48, 256, 256, 64, 64, 132) == 1  # 4 steps: one split keeps them
    assert plan_split_k(8, 48, 256, 512, 64, 64, 132) == 2
    assert plan_split_k(8, 48, 256, 1024, 64, 64, 132) == 4
    # a decode token with its shared expert as a ninth: 36 programs -> 4 splits (144)
    assert plan_split_k(8, 384, 256, 7168, 64, 64, 132, extra_blocks=1) == 4


@pytest.mark.parametrize("case", CASES)
def test_twin_is_exact(case):
    """Both evaluations of the twin equal the old per-expert loop (float64: to rounding)."""
    t, k, e_total, e_local, offset, hid, inter = case
    x, w, ids, wg, wu, wd, off = _case(t, k, e_total, e_local, offset, hid, inter, torch.float64, seed=3)
    expect = _loop(x, w, ids, wg, wu, wd, off)
    local = ids - off
    per_pair = reference._moe_per_pair(x, local.clamp(0, e_local - 1), wg, wu, wd, torch.float64)
    dense = reference._moe_dense(x, local, wg, wu, wd, torch.float64)
    owned = ((local >= 0) & (local < e_local))[..., None]
    for y in (per_pair, dense):
        got = torch.where(owned, y * w.double()[..., None], torch.zeros(())).sum(1)
        assert_close(got, expect, torch.float64, "moe twin")
    assert_close(reference.moe_experts(x, w, ids, wg, wu, wd, off), expect, torch.float64)


def test_unrouted_experts_are_never_read():
    """NaN weights in experts no token picked must not reach the output (either path)."""
    x, w, ids, wg, wu, wd, off = _case(5, 2, 8, 8, 0, 32, 16, torch.float32, seed=7)
    ids = torch.tensor([[0, 3], [3, 5], [5, 0], [0, 3], [5, 3]])
    for e in (1, 2, 4, 6, 7):
        wg[e], wu[e], wd[e] = float("nan"), float("nan"), float("nan")
    expect = _loop(x, w, ids, wg, wu, wd, off).float()
    for impl in ("triton", "torch"):
        got = moe_experts(x, w, ids, wg, wu, wd, impl=impl)
        assert torch.isfinite(got).all(), impl
        assert_close(got, expect, torch.float32, impl)


@pytest.mark.parametrize("t,k,e,offset", [(1, 1, 4, 0), (5, 2, 8, 0), (40, 4, 6, 0), (33, 3, 4, 4)])
def test_route_blocks(t, k, e, offset):
    g = torch.Generator().manual_seed(t)
    ids = torch.rand(t, 2 * e, generator=g).topk(k, dim=-1).indices  # ids 0 .. 2e-1
    order, blk_e, r0, r1, counts, filled = route_blocks(ids, e, offset)
    assert not filled
    flat = ids.reshape(-1) - offset
    owned = (flat >= 0) & (flat < e)
    assert torch.equal(counts, torch.bincount(flat[owned], minlength=e))
    covered = torch.zeros(t * k, dtype=torch.long)
    for b in range(blk_e.shape[0]):
        if blk_e[b] < 0:
            continue
        rows = torch.arange(int(r0[b]), min(int(r1[b]), int(r0[b]) + BLOCK_M))
        assert rows.numel() > 0
        pairs = order[rows].long()
        assert bool((flat[pairs] == blk_e[b]).all()), "a block straddles experts"
        covered[pairs] += 1
    assert torch.equal(covered, owned.long()), "every owned pair exactly once, no other"


def _route_ids(kind, a, num_local, offset, g):
    """[a, 1] global ids of one kind; this rank owns offset .. offset + num_local - 1."""
    end = offset + num_local
    if kind == "uniform":  # owned and (past the end, or before an offset) elsewhere
        ids = torch.randint(0, end + offset + 3, (a,), generator=g)
    elif kind == "boundary":  # ids exactly at and next to both ends of the owned range
        edges = torch.tensor(sorted({max(offset - 1, 0), offset, min(offset + 1, end - 1), end - 1, end, end + 1}))
        ids = edges[torch.randint(0, len(edges), (a,), generator=g)]
    elif kind == "one":  # every pair on one expert: long segments split into many blocks
        ids = torch.full((a,), offset + int(torch.randint(0, num_local, (1,), generator=g)))
    elif kind == "last":  # every pair on the last local expert
        ids = torch.full((a,), end - 1)
    elif kind == "skew":  # most pairs on one expert, the rest anywhere
        ids = torch.randint(0, end + 2, (a,), generator=g)
        ids[torch.rand(a, generator=g) < 0.8] = offset
    else:  # "elsewhere": no pair is owned here
        ids = end + torch.randint(0, 5, (a,), generator=g)
        if offset:
            ids[torch.rand(a, generator=g) < 0.5] = offset - 1
    return ids.reshape(a, 1)


ROUTE_KINDS = ["uniform", "boundary", "one", "last", "skew", "elsewhere"]
ROUTE_CASES = [(kind, n, off) for n in (1, 8, 48, 384) for off in (0, 5) for kind in ROUTE_KINDS]


def _assert_route_equal(ids, num_local, offset, block_m=BLOCK_M):
    got = route_blocks(ids, num_local, offset, block_m)
    want = route_blocks_torch(ids, num_local, offset, block_m)
    for name, x, y in zip(("order", "block_expert", "block_row0", "block_row1", "counts"), got, want):
        assert x.dtype == y.dtype and torch.equal(x, y), (name, ids.numel(), num_local, offset, x, y)


@pytest.mark.parametrize("kind,num_local,offset", ROUTE_CASES, ids=[f"{c[0]}-E{c[1]}@{c[2]}" for c in ROUTE_CASES])
def test_fused_route_blocks_equals_torch(kind, num_local, offset):
    """The one-launch routing kernel reproduces route_blocks_torch bit for bit (idle blocks' rows too)."""
    g = torch.Generator().manual_seed(num_local * 131 + offset * 7 + ROUTE_KINDS.index(kind))
    for a in (1, int(torch.randint(2, 64, (1,), generator=g))):
        _assert_route_equal(_route_ids(kind, a, num_local, offset, g), num_local, offset)


@pytest.mark.parametrize("num_local, offset", [(8, 0), (384, 0), (48, 5)])
def test_route_blocks_fills_the_routing_stats(num_local, offset):
    """stats=(last, total): with every expert local the route kernel writes last = tokens per
    expert and adds them to total (equal to kernels.expert_counts, torch); with an offset (EP) it
    leaves them and says so."""
    from treeflash import kernels

    g = torch.Generator().manual_seed(num_local + offset)
    want = (torch.full((num_local,), 3, dtype=torch.long), torch.arange(num_local))
    got = (want[0].clone(), want[1].clone())
    for a in (1, 37):
        ids = _route_ids("uniform", a, num_local, offset, g).reshape(-1, 1) % (offset + num_local)
        filled = route_blocks(ids, num_local, offset, stats=got)[-1]
        assert filled == (offset == 0)
        if filled:
            kernels.expert_counts(ids, *want, impl="torch")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("a,num_local,offset,kind", [(300, 384, 0, "uniform"), (200, 48, 48, "skew"),
                                                     (129, 8, 3, "one")])
def test_fused_route_blocks_equals_torch_large(a, num_local, offset, kind):
    _assert_route_equal(_route_ids(kind, a, num_local, offset, torch.Generator().manual_seed(a)), num_local, offset)


def test_fused_route_blocks_shapes():
    """[T, K] layouts (incl. non-contiguous ids), other block sizes, and the torch fallback beyond the sizes."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 20, (8, 6), generator=g)
    _assert_route_equal(ids, 16, 2)
    _assert_route_equal(ids.t(), 16, 2)  # non-contiguous: pair index follows the [6, 8] layout
    _assert_route_equal(ids, 16, 2, block_m=4)
    _assert_route_equal(ids, 16, 2, block_m=64)
    big = torch.randint(0, 8, (ROUTE_MAX_PAIRS + 1, 1), generator=g)
    _assert_route_equal(big, 8, 0)  # falls back to the torch version (same function then)
    _assert_route_equal(ids, ROUTE_MAX_LOCAL + 1, 0)
