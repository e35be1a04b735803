"""tree_budget="auto" through the engine: still lossless while the budget changes between steps."""

from __future__ import annotations

import itertools

import pytest

from spec_helpers import VOCAB
from treeflash import LLM, SamplingParams
from treeflash.spec.budget import BudgetController
from treeflash.spec.testing_drafters import AdversarialDrafter, OracleDrafter


def _auto(target, drafter):
    return LLM(target, drafter, spec="ddtree", tree_budget="auto", device="cpu", dtype="float32",
               page_size=8)


def _check(outs, expected, llm, free):
    assert [o.token_ids for o in outs] == expected
    assert llm.pool.num_free_pages == free
    for o in outs:
        m = o.metrics["speculative_decoding"]
        assert "invariant_error" not in m
        assert m["tree_budget"] == "auto" and m["tree_budget_max"] == 127
        assert m["tree_budget_choice"] in llm.engine.spec.controller.candidates


@pytest.mark.parametrize("kind", ["real", "adversarial", "oracle"])
def test_auto_budget_is_lossless(target, drafter_path, reference, kind):
    """The default controller (floors from the built model, CPU ceilings probed)."""
    ps, expected = reference
    seqs = [p + e for p, e in zip(ps, expected)]
    drafter = {"real": drafter_path,
               "adversarial": AdversarialDrafter(VOCAB, 6, seed=2, sequences=seqs, target_layer_ids=(0,)),
               "oracle": OracleDrafter(VOCAB, 6, sequences=seqs, target_layer_ids=(1,))}[kind]
    llm = _auto(target, drafter)
    assert llm.engine.spec.verify_width == 128  # KV reserved for the widest candidate (127 + root)
    free = llm.pool.num_free_pages
    _check(llm.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True)), expected, llm, free)
    ctrl = llm.engine.spec.controller
    assert ctrl is not None and ctrl.steps > 0
    assert any(w > 0 for w in ctrl.acceptance.weights)


def test_budget_changing_every_step_is_lossless(target, drafter_path, reference):
    """A controller re-evaluated every step on a floor that favours a different budget each
    time: trees of 1..127 nodes follow each other in one request and across the batch."""
    ps, expected = reference
    llm = _auto(target, drafter_path)
    spec = llm.engine.spec
    wobble = itertools.cycle([1.0, 50.0, 3.0, 0.2, 9.0, 0.01])
    spec.controller = BudgetController(lambda b, ctxs: next(wobble) * (1 + b % 7), spec.drafter.block_size - 1,
                                       candidates=(1, 2, 4, 8, 16, 127), every=1, probe_every=1)
    used = []
    orig = spec.controller.budget_for
    spec.controller.budget_for = lambda ctxs: used.append(orig(ctxs)) or used[-1]
    free = llm.pool.num_free_pages
    _check(llm.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True)), expected, llm, free)
    assert len(set(used)) >= 3, used


def test_auto_with_sampling_runs_clean(target, drafter_path, reference):
    """Sampling under auto: the walk's own draws, metrics consistent. (A seeded request
    reproduces only when the budget sequence does: the budget follows measured time.)"""
    ps, _ = reference
    llm = _auto(target, drafter_path)
    free = llm.pool.num_free_pages
    outs = llm.generate(ps, SamplingParams(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    assert llm.pool.num_free_pages == free
    assert all("invariant_error" not in o.metrics["speculative_decoding"] for o in outs)


def test_fused_tree_build_through_the_engine_is_lossless(target, drafter_path, reference, monkeypatch):
    """The one-launch tree build (kernels/tree_build.py, interpreter) in real steps, the
    budget changing under auto: still the target's greedy text."""
    from treeflash.spec import build

    monkeypatch.setattr(build, "FUSED_TREE", "triton")
    calls = []
    from treeflash.kernels import tree_build

    real = tree_build.build_ddtree_triton
    monkeypatch.setattr(tree_build, "build_ddtree_triton", lambda *a, **kw: calls.append(a[-1]) or real(*a, **kw))
    ps, expected = reference
    llm = _auto(target, drafter_path)
    free = llm.pool.num_free_pages
    outs = llm.generate(ps[:2], SamplingParams(max_tokens=12, ignore_eos=True))
    _check(outs, [e[:12] for e in expected[:2]], llm, free)
    assert calls  # the fused build ran
