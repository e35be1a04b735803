"""DFlash drafter: equal to the z-lab reference, incremental cache equal to recomputation,
bounded sliding-window cache, and refusals of drafters that do not fit their target."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.drafter import (
    reference_block_logits,
    reference_drafter,
    target_heads,
    write_drafter,
)
from treeflash.config import DrafterConfig, ModelConfig
from treeflash.models.drafter import DFlashDrafter

pytest.importorskip("dflash")

FULL3 = ("full_attention",) * 3
MIXED = ("sliding_attention", "full_attention", "sliding_attention")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}

CASES = {
    "full": dict(layer_types=FULL3),
    "mixed_w5": dict(layer_types=MIXED, sliding_window=5),
    "all_sliding_w3": dict(layer_types=("sliding_attention",) * 2, sliding_window=3),
    "causal_all": dict(layer_types=MIXED, sliding_window=4, is_causal=True),
    "noncausal_all": dict(layer_types=MIXED, sliding_window=4, is_causal=False),
    "yarn_b6": dict(layer_types=MIXED, sliding_window=6, block_size=6, rope_scaling=YARN),
    "three_taps_mha": dict(layer_types=FULL3, target_layer_ids=(0, 1, 3), num_key_value_heads=4),
}
TOL = dict(atol=2e-5, rtol=2e-5)


def _load(tmp_path, name, **kw):
    path = write_drafter(tmp_path / name, seed=hash(name) % 1000, **kw)
    raw = json.loads((path / "config.json").read_text())
    embed, head = target_heads(raw["vocab_size"], raw["hidden_size"])
    ours = DFlashDrafter.from_pretrained(path, embed, head, dtype=torch.float32)
    return ours, reference_drafter(path), embed, head


def _features(drafter, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, drafter.cfg.num_taps * drafter.cfg.hidden_size, generator=g)


def _propose_one(drafter, cache, bonus, start, bs=None):
    return drafter.propose([cache], torch.tensor([bonus]), torch.tensor([start]), bs)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name, fused", [(n, None) for n in CASES] + [("mixed_w5", "triton"), ("yarn_b6", "triton")])
def test_block_logits_match_reference(tmp_path, name, fused):
    """fused="triton": q_norm / k_norm + rotary in one launch and the layer norms fused (what
    CUDA runs), through the interpreter."""
    from treeflash.models.layers import set_options
    from treeflash.runtime import RuntimeOptions

    kw = dict(CASES[name])
    if "rope_scaling" in kw:
        kw["max_position_embeddings"] = 512
    ours, ref, embed, head = _load(tmp_path, name, **kw)
    set_options(ours, RuntimeOptions(fused_kernels=fused))
    feats = _features(ours, 11)
    cache = ours.new_cache()
    ours.extend(cache, feats, torch.arange(11))
    got = _propose_one(ours, cache, 7, 11)
    want = reference_block_logits(ref, feats, 7, embed, head)
    assert got.shape == (ours.block_size - 1, 64)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["full", "mixed_w5", "all_sliding_w3", "noncausal_all"])
def test_incremental_cache_equals_recompute_every_step(tmp_path, name):
    ours, ref, embed, head = _load(tmp_path, name, **CASES[name])
    feats = _features(ours, 40, seed=1)
    cache, start = ours.new_cache(), 0
    g = torch.Generator().manual_seed(3)
    for step in range(12):
        t = int(torch.randint(1, ours.block_size + 1, (1,), generator=g))
        ours.extend(cache, feats[start : start + t], torch.arange(start, start + t))
        start += t
        bonus = step % 60
        got = _propose_one(ours, cache, bonus, start)
        # (a) the reference from scratch over the whole committed context
        want = reference_block_logits(ref, feats[:start], bonus, embed, head)
        torch.testing.assert_close(got, want, **TOL)
        # (b) our own path from scratch (one extend)
        fresh = ours.new_cache()
        ours.extend(fresh, feats[:start])
        torch.testing.assert_close(got, _propose_one(ours, fresh, bonus, start), **TOL)
        _check_cache_bounds(ours, cache, start)


def _check_cache_bounds(drafter, cache, committed):
    assert cache.seq_len == committed
    for i, layer in enumerate(cache.layers):
        w = drafter.cfg.window(i)
        if w is None:
            assert layer.n == committed
        else:
            assert layer.n == min(committed, w - 1) and layer.capacity <= w
            _, _, pos = layer.view()
            assert sorted(pos.tolist()) == list(range(committed - layer.n, committed))


def test_sliding_window_masks_old_context(tmp_path):
    """With W small, changing features older than W must not change the logits."""
    ours, _, _, _ = _load(
        tmp_path, "allsl", layer_types=("sliding_attention",) * 2, sliding_window=3
    )
    feats = _features(ours, 12, seed=5)
    other = feats.clone()
    other[:8] = torch.randn_like(other[:8])  # positions <= 12-3-1 are outside every window
    a, b = ours.new_cache(), ours.new_cache()
    ours.extend(a, feats)
    ours.extend(b, other)
    torch.testing.assert_close(_propose_one(ours, a, 3, 12), _propose_one(ours, b, 3, 12))


def test_batched_propose_equals_single(tmp_path):
    ours, _, _, _ = _load(tmp_path, "mixed", **CASES["mixed_w5"])
    lengths, bonus = [3, 9, 1], [5, 6, 7]
    caches = []
    for i, t in enumerate(lengths):
        c = ours.new_cache()
        ours.extend(c, _features(ours, t, seed=10 + i))
        caches.append(c)
    got = ours.propose(caches, torch.tensor(bonus), torch.tensor(lengths))
    for i, c in enumerate(caches):
        torch.testing.assert_close(got[i], _propose_one(ours, c, bonus[i], lengths[i]), **TOL)


def test_short_block_override_matches_reference(tmp_path):
    ours, ref, embed, head = _load(tmp_path, "mixed", **CASES["mixed_w5"])
    feats = _features(ours, 6)
    cache = ours.new_cache()
    ours.extend(cache, feats)
    got = _propose_one(ours, cache, 2, 6, bs=2)
    torch.testing.assert_close(got, reference_block_logits(ref, feats, 2, embed, head, 2), **TOL)


# ---- refusals ----------------------------------------------------------------------------
def _target_cfg(**over) -> ModelConfig:
    from helpers.hf_checkpoints import BASE

    return ModelConfig.from_hf(
        {"model_type": "deepseek_v3", **{**BASE, "hidden_size": 32, "vocab_size": 64}, **over}
    )


@pytest.mark.parametrize(
    "over, drafter_kw, match",
    [
        (dict(hidden_size=64), {}, "hidden_size"),
        (dict(vocab_size=80), {}, "vocab_size"),
        (dict(num_hidden_layers=2), {}, r"target_layer_ids \[2\]"),
        ({}, dict(mask_token_id=64, vocab_size=None), "mask_token_id"),
    ],
)
def test_check_fits_refuses(tmp_path, over, drafter_kw, match):
    kw = {**CASES["full"], **drafter_kw}
    vocab_none = kw.pop("vocab_size", 1) is None
    path = write_drafter(tmp_path / "d", **kw)
    if vocab_none:
        raw = json.loads((path / "config.json").read_text())
        del raw["vocab_size"]
        (path / "config.json").write_text(json.dumps(raw))
    cfg = DrafterConfig.from_hf(path)
    target = _target_cfg(**over)
    with pytest.raises(ValueError, match=match):
        cfg.check_fits(target)
    embed, head = target_heads(target.vocab_size, 32)
    with pytest.raises(ValueError, match=match):
        DFlashDrafter.from_pretrained(path, embed, head, target_cfg=target)


def test_fitting_drafter_loads(tmp_path):
    path = write_drafter(tmp_path / "d", **CASES["mixed_w5"])
    embed, head = target_heads(64, 32)
    d = DFlashDrafter.from_pretrained(
        path, embed, head, target_cfg=_target_cfg(), dtype=torch.bfloat16
    )
    cache = d.new_cache()
    d.extend(cache, torch.randn(5, 64, dtype=torch.bfloat16))
    assert d.propose([cache], torch.tensor([1]), torch.tensor([5])).shape == (1, 3, 64)


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda c: c["dflash_config"].pop("target_layer_ids"), "target_layer_ids"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c.pop("block_size"), "block_size"),
        (lambda c: c.update(sliding_window=None), "sliding_window"),
        (lambda c: c.update(layer_types=["sliding_attention", "linear_attention"]), "layer_types"),
        (lambda c: c["dflash_config"].update(selector_rank=8), "selector_rank"),
        (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[0, 9]), "target_layer_ids"),
        (lambda c: c.update(is_causal="yes"), "is_causal"),
    ],
)
def test_bad_config_names_the_field(tmp_path, edit, field):
    path = write_drafter(
        tmp_path / "d", layer_types=("sliding_attention", "full_attention"), sliding_window=4
    )
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    with pytest.raises(ValueError, match=field):
        DrafterConfig.from_hf(raw)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file

    path = write_drafter(tmp_path / "d", **CASES["full"])
    sd = load_file(str(path / "model.safetensors"))
    del sd["layers.1.self_attn.k_norm.weight"]
    embed, head = target_heads(64, 32)
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_norm\.weight"):
        DFlashDrafter.from_state_dict(DrafterConfig.from_hf(path), sd, embed, head)


# ---- chain mode vs the reference dflash_generate on a transformers DeepSeek-V3 target ----
def _hf_taps(target, ids: list[int], taps) -> tuple[torch.Tensor, torch.Tensor]:
    """Full forward (no cache): logits [T, V] and tapped features [T, n_taps*hidden]."""
    out = target(torch.tensor([ids]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[layer + 1][0] for layer in taps], dim=-1)
    return out.logits[0], feats


@pytest.mark.slow
@pytest.mark.parametrize("bs, layer_types", [(4, FULL3), (5, MIXED)])
@torch.no_grad()
def test_chain_matches_reference_dflash_generate(tmp_path, bs, layer_types):
    from dflash.model import dflash_generate

    from helpers.hf_checkpoints import make_hf_model
    from treeflash.speculative.build import build_tree
    from treeflash.speculative.verify import walk_greedy

    target = make_hf_model()
    v, h = target.config.vocab_size, target.config.hidden_size
    with torch.no_grad():  # a near rank-1 head: few likely tokens, so drafts get accepted
        g = torch.Generator().manual_seed(bs)
        c = torch.linspace(-1, 1, v)[torch.randperm(v, generator=g)]
        u = torch.randn(h, generator=g)
        target.lm_head.weight.copy_(3 * c[:, None] * u + 0.05 * torch.randn(v, h, generator=g))
    path = write_drafter(
        tmp_path / "d",
        layer_types=layer_types,
        sliding_window=6,
        block_size=bs,
        hidden_size=h,
        vocab_size=v,
        mask_token_id=v - 1,
        target_layer_ids=(0, 1),
        num_target_layers=3,
        head_dim=16,
    )
    _negate_final_norm(path)  # with the rank-1 head, this makes the drafter agree often
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    ours = DFlashDrafter.from_pretrained(path, embed, head, dtype=torch.float32)
    ref = reference_drafter(path)
    ref_blocks, our_blocks = [], []
    compute = ref.compute_logits
    ref.compute_logits = lambda hid, o: _record(ref_blocks, compute(hid, o))
    prompt, new = [3, 14, 15, 9, 2, 6], 24
    want = dflash_generate(ref, target, torch.tensor([prompt]), new, None)[0].tolist()

    max_len = len(prompt) + new
    logits, feats = _hf_taps(target, prompt, ours.target_layer_ids)
    out, cache = prompt + [int(logits[-1].argmax())], ours.new_cache(prompt)
    ours.extend(cache, feats)
    accepted = []
    while len(out) < max_len:
        start, size = len(out) - 1, min(bs, max_len - len(out) + 1)
        bonus = torch.tensor([out[-1]])
        draft = ours.propose([cache], bonus, torch.tensor([start]), size)
        our_blocks.append(draft.argmax(-1)[0].tolist())
        tree = build_tree("dflash", draft, bonus, torch.tensor([start]))
        logits, feats = _hf_taps(target, out + tree.tokens[0, 1:].tolist(), ours.target_layer_ids)
        walk = walk_greedy(tree, logits[start:][None])
        k = int(walk.num_accepted[0])
        accepted.append(k)
        out += walk.new_tokens[0, : k + 1].tolist()
        ours.extend(cache, feats[start : start + k + 1])
    assert out[:max_len] == want
    assert max(accepted) >= 2  # multi-row extends and partial acceptance were exercised
    assert our_blocks == ref_blocks


def _negate_final_norm(path):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path / "model.safetensors"))
    sd["norm.weight"] = -sd["norm.weight"]
    save_file(sd, str(path / "model.safetensors"))


def _record(store, logits):
    store.append(logits.argmax(-1)[0].tolist())
    return logits
