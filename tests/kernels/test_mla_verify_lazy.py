"""CPU check of v5d's lazy-rescale recurrence (mla_verify_v5 `_online_softmax_lazy`), the only
correctness evidence available without a GPU: the same per-tile arithmetic in torch (fp32 state,
P rounded to bf16 as the kernel's single P for both halves, 64-key tiles, log2 domain, the
warpgroup-wide "skip O *= alpha when no row moved its max" rule) against the eager recurrence
(`_online_softmax`) and a float64 softmax.
"""

from __future__ import annotations

import math

import pytest
import torch

from treeflash.kernels.mla_verify_v5 import LAZY_THRESH

TILE = 64


def _online(s2: torch.Tensor, v: torch.Tensor, lazy: bool, p_dtype=torch.bfloat16):
    """(O, lse2, tiles with a rescale, tiles) of one 64-row warpgroup: s2 [M, T] log2-domain
    scores (-inf: not visible), v [T, D]. Mirrors the kernel: m starts at -inf, rows with nothing
    visible use m = 0 for exp2, O / l and m + log2(l) at the end (l == 0: 0 and -inf)."""
    m_rows, t = s2.shape
    m_i = torch.full((m_rows,), float("-inf"))
    l_i = torch.zeros(m_rows)
    o = torch.zeros(m_rows, v.shape[1])
    rescales = 0
    n_tiles = 0
    for lo in range(0, t, TILE):
        s = s2[:, lo:lo + TILE].float()
        m_tile = s.max(1).values
        if lazy:
            need = m_tile > m_i + LAZY_THRESH
            m_new = torch.where(need, m_tile, m_i)
        else:
            m_new = torch.maximum(m_i, m_tile)
        m_use = torch.where(m_new == float("-inf"), torch.zeros(()), m_new)
        alpha = torch.exp2(m_i - m_use)
        p = torch.exp2(s - m_use[:, None]).to(p_dtype)
        l_i = l_i * alpha + p.float().sum(1)
        if lazy:
            rescale = bool(need.any())  # the warpgroup's flag (f_smem, REDUX.MAX)
            if not rescale:
                # what skipping relies on: every row's alpha is 1, or 0 on a row whose O and l
                # are still 0 (nothing visible yet)
                assert bool(((alpha == 1.0) | ((alpha == 0.0) & (l_i == 0.0)
                                                & (o.abs().sum(1) == 0.0))).all())
        else:
            rescale = True
        if rescale:
            o = o * alpha[:, None]
            rescales += 1
        # PV in bf16 x bf16 -> fp32 (the wgmma)
        o = o + p.float() @ v[lo:lo + TILE].to(p_dtype).float()
        m_i = m_new
        n_tiles += 1
        if lazy:  # the invariant that keeps fp32 safe: P <= 2^LAZY_THRESH
            assert float(p.float().max()) <= 2.0 ** LAZY_THRESH
    l_safe = torch.where(l_i == 0.0, torch.ones(()), l_i)
    out = o / l_safe[:, None]
    lse2 = torch.where(l_i == 0.0, torch.full((), float("-inf")), m_i + torch.log2(l_safe))
    return out, lse2, rescales, n_tiles


def _reference(s2: torch.Tensor, v: torch.Tensor):
    s = s2.double()
    lse2 = torch.logsumexp(s * math.log(2.0), 1) / math.log(2.0)
    w = torch.exp2(s - torch.where(torch.isinf(lse2), torch.zeros(()).double(), lse2)[:, None])
    w = torch.nan_to_num(w, nan=0.0)
    return w @ v.to(torch.bfloat16).double(), lse2


def _scores(t: int, g: torch.Generator) -> torch.Tensor:
    """[64, t] log2-domain scores with the hard rows first, the rest random."""
    rows = []
    pos = torch.arange(t, dtype=torch.float32)
    rows.append(pos * 0.01)  # max creeps up slowly: crosses the threshold every 800 keys
    rows.append(pos * 0.2)  # rises fast: (nearly) every tile rescales
    late = torch.randn(t, generator=g)
    late[-5] = 60.0  # a late big jump (2^60 larger than the rest)
    rows.append(late)
    early = torch.randn(t, generator=g)
    early[3] = 40.0  # the max comes first, everything after is tiny
    rows.append(early)
    masked = torch.randn(t, generator=g)
    masked[: t - 70] = float("-inf")  # nothing visible until the last tiles
    rows.append(masked)
    rows.append(torch.full((t,), float("-inf")))  # nothing visible at all
    drift = torch.cumsum(torch.randn(t, generator=g) * 0.5, 0)  # a random walk
    rows.append(drift)
    step = torch.randn(t, generator=g)
    step[t // 2:] += 7.9  # just under the threshold: never rescales after the first tile
    rows.append(step)
    rest = torch.randn(64 - len(rows), t, generator=g) * 3.0
    return torch.cat([torch.stack(rows), rest])


@pytest.mark.parametrize("t", [64, 1000, 4096 + 17])
def test_lazy_rescale_matches_eager_and_reference(t):
    g = torch.Generator().manual_seed(t)
    s2 = _scores(t, g)
    # keys past a ragged end are masked (-inf) in the kernel; pad to whole tiles the same way
    pad = (-t) % TILE
    s2p = torch.cat([s2, torch.full((64, pad), float("-inf"))], 1)
    v = torch.randn(t + pad, 32, generator=g)
    v[t:] = 0.0  # `_zero_tail_rows`
    ref, ref_lse = _reference(s2p, v)
    eager, eager_lse, eager_rs, n = _online(s2p, v, lazy=False)
    lazy, lazy_lse, lazy_rs, n2 = _online(s2p, v, lazy=True)
    assert n == n2
    vis = torch.isfinite(ref_lse)
    assert not bool(vis[5])  # the all-masked row: 0 and -inf, as the kernel stores
    assert bool((lazy[5] == 0).all()) and lazy_lse[5] == float("-inf")
    assert bool(torch.isfinite(lazy).all())
    for out, lse in ((eager, eager_lse), (lazy, lazy_lse)):
        err = (out.double() - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, err  # P in bf16, as the kernel
        # l sums the bf16 P too (as the kernel): ~2^-9 relative a term
        assert (lse[vis].double() - ref_lse[vis]).abs().max() < 4e-3
    # lazy vs eager: the same P up to where bf16 rounds P * 2^k differently (k <= 8)
    d = (lazy - eager).abs().max() / eager.abs().max()
    assert d < 2e-2, d
    assert (lazy_lse[vis] - eager_lse[vis]).abs().max() < 4e-3
    # the flag is per warpgroup: the row rising 12.8 a tile makes every tile rescale here
    assert lazy_rs <= eager_rs == n


def test_lazy_rescale_fp32_p_is_exact_to_rounding():
    """With P in fp32 the lazy and eager recurrences differ only by fp32 rounding."""
    g = torch.Generator().manual_seed(7)
    t = 2048
    s2 = _scores(t, g)
    v = torch.randn(t, 16, generator=g)
    ref, ref_lse = _reference(s2, v.to(torch.bfloat16).float())
    vis = torch.isfinite(ref_lse)
    for lazy in (False, True):
        out, lse, _, _ = _online(s2, v.to(torch.bfloat16).float(), lazy=lazy,
                                 p_dtype=torch.float32)
        assert (out.double() - ref).abs().max() / ref.abs().max() < 1e-5
        assert (lse[vis].double() - ref_lse[vis]).abs().max() < 1e-5


def test_lazy_rescale_counts():
    """Slow growth rescales rarely, a late jump rescales once more, a random tile once."""
    t = 64 * 40
    pos = torch.arange(t, dtype=torch.float32)
    v = torch.ones(t, 4)
    slow = (pos * 0.01)[None].expand(64, t).contiguous()  # +0.64 a tile: every ~13 tiles
    _, _, rs, n = _online(slow, v, lazy=True)
    assert n == 40 and 1 <= rs <= 5
    jump = torch.zeros(64, t)
    jump[:, -1] = 100.0
    _, lse, rs, _ = _online(jump, v, lazy=True)
    assert rs == 2  # the first tile (from -inf) and the jump
    assert torch.allclose(lse, torch.full((64,), 100.0), atol=1e-4)
    # the decode-like case: 64 rows of i.i.d. scores (scale ~ 3 in log2 units) rescale in the
    # first tile and then only while the max of 64 x 64k draws climbs by > 8: a few tiles
    g = torch.Generator().manual_seed(3)
    rnd = torch.randn(64, t, generator=g) * 3.0
    _, _, rs, _ = _online(rnd, v, lazy=True)
    assert rs <= 3


def test_v5d_plumbing():
    """v5d = v5b + lazy_rescale (opt-in everywhere: off by default)."""
    import inspect
    from dataclasses import replace

    from treeflash.bench.kernel import VARIANTS
    from treeflash.kernels import mla_verify as mv
    from treeflash.kernels import mla_verify_v5 as v5

    assert mv.KernelConfig(64, 64, 4, 1).lazy_rescale is False
    assert inspect.signature(v5.launch_v5).parameters["lazy"].default is False
    for m in (8, 256, 2048):
        assert VARIANTS["v5d"](m)["config"] == replace(VARIANTS["v5b"](m)["config"],
                                                       lazy_rescale=True)
    assert VARIANTS["v5ddirect"](8)["num_splits"] == 1
    assert VARIANTS["v5ddirect"](8)["config"].lazy_rescale
    assert LAZY_THRESH == 8.0
