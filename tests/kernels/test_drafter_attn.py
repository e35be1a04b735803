"""DFlash drafter attention: the Triton kernel (interpreter on CPU) against the float64 torch
twin, on the context layouts the drafter really passes, and a whole proposal through it."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from treeflash import kernels  # noqa: E402
from treeflash.config import DrafterConfig  # noqa: E402
from treeflash.kernels.drafter_attn import (  # noqa: E402
    TileConfig,
    drafter_attention_triton,
    pick_tiles,
    plan_splits,
)
from treeflash.kernels.reference import drafter_attention as drafter_attention_torch  # noqa: E402
from treeflash.kernels.reference import drafter_block_mask as block_mask  # noqa: E402
from treeflash.kernels.testing import TOLERANCES, assert_close  # noqa: E402
from treeflash.models.drafter import DFlashDrafter  # noqa: E402


def _positions(b: int, length: int, n_valid: int, layout: str, g: torch.Generator) -> torch.Tensor:
    """ctx_pos [B, L]: "tail" = 0..n-1 then -1 (a static capacity view), "holes" = -1 slots
    scattered inside, "ring" = a sliding ring's rotated order, -1 past the valid slots."""
    pos = torch.full((b, length), -1, dtype=torch.long)
    for r in range(b):
        base = 100 * r + 7  # requests at different places of their sequences
        if layout == "tail":
            pos[r, :n_valid] = base + torch.arange(n_valid)
        elif layout == "holes":
            keep = torch.randperm(length, generator=g)[:n_valid].sort().values
            pos[r, keep] = base + torch.arange(n_valid)
        elif layout == "ring":
            shift = int(torch.randint(0, max(n_valid, 1), (1,), generator=g))
            pos[r, :n_valid] = (base + torch.arange(n_valid)).roll(shift)
        else:
            raise ValueError(layout)
    return pos


def _case(b, hkv, groups, nq, d, length, n_valid, layout, dtype, seed):
    """Inputs laid out as the drafter lays them out: the context a slice of a bigger
    [B, Hkv, cap, D] buffer (LayerKV.view) with NaN in every padding slot, q and the block's
    K/V transposed views of [B, Q, H, D] projections."""
    g = torch.Generator().manual_seed(seed)
    cap = length + 5
    ctx_k = torch.randn(b, hkv, cap, d, generator=g)[:, :, :length]
    ctx_v = torch.randn(b, hkv, cap, d, generator=g)[:, :, :length]
    ctx_pos = _positions(b, length, n_valid, layout, g)
    pad = (ctx_pos < 0)[:, None, :, None].expand_as(ctx_k)
    ctx_k[pad], ctx_v[pad] = float("nan"), float("nan")
    start = ctx_pos.amax(dim=1) + 1 if length else torch.zeros(b, dtype=torch.long)  # block follows
    q_pos = start[:, None] + torch.arange(nq)
    q = torch.randn(b, nq, hkv * groups, d, generator=g).transpose(1, 2)
    blk_k = torch.randn(b, nq, hkv, d, generator=g).transpose(1, 2)
    blk_v = torch.randn(b, nq, hkv, d, generator=g).transpose(1, 2)
    cast = [t.to(dtype) for t in (q, ctx_k, ctx_v, blk_k, blk_v)]
    return (*cast, ctx_pos, q_pos)


def _check(args, causal, window, dtype, **kw):
    q, ctx_k, ctx_v, blk_k, blk_v, ctx_pos, q_pos = args
    scale = q.shape[-1] ** -0.5
    out = drafter_attention_triton(q, ctx_k, ctx_v, blk_k, blk_v, ctx_pos, q_pos, causal, window, scale, **kw)
    ref = drafter_attention_torch(q.double(), ctx_k.double(), ctx_v.double(), blk_k.double(),
                                  blk_v.double(), ctx_pos, q_pos, causal, window, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all(), "a NaN padding row was read"
    assert_close(out, ref, dtype)


CASES = [
    # B, Hkv, groups, Q, D, L, valid, layout, causal, window, dtype, forced splits
    (1, 1, 1, 1, 32, 37, 30, "tail", False, None, torch.float32, None),
    (1, 2, 4, 4, 16, 70, 61, "tail", True, None, torch.float32, 3),
    (2, 1, 8, 16, 32, 50, 41, "holes", True, 9, torch.float32, None),  # M = 128 rows
    (1, 1, 4, 16, 32, 64, 52, "ring", False, 30, torch.bfloat16, 4),
    (2, 2, 4, 4, 24, 33, 33, "ring", True, 12, torch.bfloat16, None),  # D = 24: masked columns
    (1, 1, 2, 16, 16, 20, 14, "tail", False, 3, torch.float16, 2),  # W < Q: block keys cut too
    (1, 1, 8, 16, 16, 0, 0, "tail", True, None, torch.float32, None),  # empty context
    (1, 1, 4, 1, 32, 40, 0, "tail", False, 8, torch.float32, 2),  # all padding: only itself
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"g{c[2]}q{c[3]}L{c[5]}{c[7]}{str(c[10])[6:]}")
def test_matches_reference(case):
    b, hkv, groups, nq, d, length, n_valid, layout, causal, window, dtype, splits = case
    args = _case(b, hkv, groups, nq, d, length, n_valid, layout, dtype, seed=length + nq)
    _check(args, causal, window, dtype, num_splits=splits)


@pytest.mark.slow
def test_auto_plan_splits_and_matches():
    """No forced count: the interpreter's plan (4 'SMs') still cuts a long context."""
    args = _case(1, 1, 4, 4, 16, 150, 133, "tail", torch.float32, seed=5)
    cfg = pick_tiles(16, 16, torch.float32, on_gpu=False)
    assert plan_splits(1, 150, cfg.block_n, 4)[0] > 1
    _check(args, True, None, torch.float32)


@pytest.mark.slow
def test_multiple_m_tiles():
    """G x Q rows over several M tiles: the head/row mapping across tiles."""
    args = _case(1, 2, 4, 16, 16, 30, 25, "holes", torch.float32, seed=9)
    _check(args, True, 7, torch.float32, tiles=TileConfig(16, 16, 4, 1), num_splits=2)


@pytest.mark.slow
def test_unpredicated_loads_zero_padding():
    """pred_loads=False fetches the padding rows (NaN here) and must zero them."""
    args = _case(1, 1, 4, 4, 16, 40, 29, "holes", torch.bfloat16, seed=4)
    _check(args, False, 20, torch.bfloat16, tiles=TileConfig(16, 16, 4, 1, pred_loads=False), num_splits=2)


def test_plan_depends_only_on_shapes():
    for length in (0, 1, 15, 16, 17, 1000, 262144):
        for units in (1, 3, 64):
            for forced in (None, 1, 7, 10**6):
                splits, chunk = plan_splits(units, length, 64, 132, forced)
                assert splits >= 1 and chunk % 64 == 0
                assert splits * chunk >= length and (splits - 1) * chunk < max(length, 1)
                if forced is not None and length:
                    assert splits <= forced
    assert plan_splits(1, 262144, 64, 132) == plan_splits(1, 262144, 64, 132)


def test_dispatch():
    args = _case(1, 1, 2, 4, 16, 12, 10, "tail", torch.float32, seed=1)
    torch_out = kernels.drafter_attention(*args, True, None, 0.25)  # CPU: the torch path
    triton_out = kernels.drafter_attention(*args, True, None, 0.25, impl="triton")
    assert_close(triton_out, torch_out, torch.float32)
    with pytest.raises(ValueError):
        kernels.drafter_attention(*args, True, None, 0.25, impl="cuda")


def test_block_mask_by_hand():
    ctx_pos = torch.tensor([[3, -1, 5, 6]])
    q_pos = torch.tensor([[7, 8]])
    vis = block_mask(q_pos, ctx_pos, causal=True, window=3)
    want = torch.tensor([[[0, 0, 1, 1, 1, 0],   # p=7: 7-3 >= 3 cut, -1 unseen, 5 and 6 seen, 8 > 7
                          [0, 0, 0, 1, 1, 1]]], dtype=torch.bool)  # p=8: 5 is 3 back: cut
    assert torch.equal(vis, want)


# ---- a whole proposal through the kernel ------------------------------------------------------
def _drafter(seed: int = 0) -> DFlashDrafter:
    from helpers.drafter import drafter_config, random_state_dict, target_heads

    raw = drafter_config(layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                         sliding_window=6, block_size=8, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=16)
    embed, head = target_heads(raw["vocab_size"], raw["hidden_size"])
    return DFlashDrafter.from_state_dict(DrafterConfig.from_hf(raw), random_state_dict(raw, seed),
                                         embed, head, dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True])
def test_propose_triton_matches_torch(static):
    drafter = _drafter()
    g = torch.Generator().manual_seed(2)
    caches, starts = [], []
    for n in ([21] if static else [21, 9]):
        cache = drafter.new_cache()
        feats = torch.randn(n, drafter.cfg.num_taps * drafter.cfg.hidden_size, generator=g)
        drafter.extend(cache, feats)
        caches.append(cache)
        starts.append(n)
    if static:  # the full layer's capacity has unused slots (pos -1) past the valid ones
        assert caches[0].layers[1].capacity > caches[0].layers[1].n
    bonus, start = torch.tensor([5, 11][: len(caches)]), torch.tensor(starts)
    want = drafter.propose(caches, bonus, start, static=static)
    drafter.impl = "triton"
    got = drafter.propose(caches, bonus, start, static=static)
    assert torch.isfinite(got).all()
    err = (got - want).abs().max() / want.abs().max()
    assert err <= 10 * TOLERANCES[torch.float32], err  # logits through 3 layers and the head
