"""tree_budget="auto" through the engine: lossless while trees change size between steps and
requests switch between trees and plain steps; an always-wrong drafter drives a request to
plain decoding with re-probes; requests of one batch are sized apart; the metrics say it."""

from __future__ import annotations

import itertools
import time

import pytest

from helpers.spec import VOCAB, SyntheticCost
from treeflash import LLM, SamplingParams
from treeflash.speculative import budget as B
from treeflash.speculative.budget import Plan
from treeflash.speculative.testing_drafters import AdversarialDrafter, OracleDrafter, WrongDrafter


def _auto(target, drafter, cost=None, **kw):
    """cost: a SyntheticCost for the sizing (this shared machine's step times swing 10x: the
    tests of what the rule decides price steps themselves; the default model's runs check
    losslessness and plumbing)."""
    llm = LLM(target, drafter, spec="ddtree", tree_budget="auto", device="cpu", dtype="float32",
              page_size=8, **kw)
    llm.engine.spec._cost = cost
    return llm


# a tree costs half a plain step more, and rows make a batch's step dear (each row its experts):
# with a small fixed cost a forward, a split step (one request's tree, the other plainly) commits
# ~1.4x the tokens a second of any one forward (the rule splits only past SPLIT_MARGIN)
FLAT = SyntheticCost(lambda n: 1.0, lambda n, b: 1.5 + 0.01 * b)
ROWS = SyntheticCost(lambda n: 0.2 + n, lambda n, b: 0.2 + n * (b + 1) ** 0.5)


def _check(outs, expected, llm, free):
    assert [o.token_ids for o in outs] == expected
    assert llm.pool.num_free_pages == free
    for o in outs:
        m = o.metrics["speculative_decoding"]
        assert "invariant_error" not in m
        assert m["tree_budget"] == "auto" and m["tree_budget_max"] == 63
        assert m["tree_budget_choice"] in (0, *B.BUCKETS)
        assert sum(m["steps_by_budget"].values()) == m["num_spec_steps"] == len(m["per_step_budget"])
        assert set(m["steps_by_budget"]) <= {str(b) for b in B.BUCKETS}
        # every step emitted its commit: 1 (prefill) + per tree (accepted + 1) + per plain step 1
        assert 1 + sum(a + 1 for a in m["per_step_accepted"]) + m["num_plain_steps"] >= len(o.token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["real", "adversarial", "oracle", "wrong"])
def test_auto_budget_is_lossless(target, drafter_path, reference, kind):
    """The default sizing (cost model from the built model, CPU ceilings probed)."""
    ps, expected = reference
    seqs = [p + e for p, e in zip(ps, expected)]
    drafter = {"real": drafter_path,
               "adversarial": AdversarialDrafter(VOCAB, 6, seed=2, sequences=seqs, target_layer_ids=(0,)),
               "oracle": OracleDrafter(VOCAB, 6, sequences=seqs, target_layer_ids=(1,)),
               "wrong": WrongDrafter(VOCAB, 6, sequences=seqs, target_layer_ids=(0, 2))}[kind]
    llm = _auto(target, drafter)
    assert llm.engine.spec.verify_width == 64  # KV reserved for the widest bucket (63 + root)
    free = llm.pool.num_free_pages
    _check(llm.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True)), expected, llm, free)
    sizer = llm.engine.spec.sizer
    assert sizer is not None and sizer.decisions > 0 and sizer.calibration.observations > 0


@pytest.mark.slow
def test_an_always_wrong_drafter_decodes_plainly_and_reprobes(target, reference):
    """A confident drafter that is never right: after its first tree the request decodes
    plainly, re-probed after REPROBE[0] plain steps with a small tree, then after twice as many;
    its drafter cache catches up with the tapped plain steps' features before each probe (all of
    the first spell's, the last TAP_BEFORE_PROBE of the second: its first steps ran untapped)."""
    ps, expected = reference
    prompt = ps[0]
    long = LLM(target, device="cpu", dtype="float32", page_size=8).generate(
        prompt, SamplingParams(max_tokens=60, ignore_eos=True))[0].token_ids
    drafter = WrongDrafter(VOCAB, 6, sequences=[prompt + long], target_layer_ids=(0, 2))
    llm = _auto(target, drafter, FLAT)
    extends = []
    real_extend = drafter.extend
    drafter.extend = lambda cache, feats, pos=None: extends.append(feats.shape[0]) or real_extend(cache, feats, pos)
    out = llm.generate(prompt, SamplingParams(max_tokens=60, ignore_eos=True))[0]
    assert out.token_ids == long
    m = out.metrics["speculative_decoding"]
    assert m["num_accepted_draft_tokens"] == 0
    assert m["per_step_budget"][0] == B.START_BUDGET and set(m["per_step_budget"][1:]) <= {B.PROBE_BUDGET}
    assert m["num_plain_steps"] >= 50 and 2 <= m["num_spec_steps"] <= 5
    assert m["num_plain_steps"] + m["num_spec_steps"] == len(long) - 1
    caught_up = [t for t in extends if t > 1]  # the plain steps' rows, appended before a probe
    assert caught_up[1:3] == [B.REPROBE[0], B.TAP_BEFORE_PROBE], extends
    assert m["tree_budget_choice"] == 0


def test_requests_of_a_batch_are_sized_apart(target, reference):
    """One batch, one drafter right for request 0 and wrong for request 1: request 0 verifies
    trees and accepts, request 1 decodes plainly in the same steps."""
    ps, expected = reference
    seqs = [p + e for p, e in zip(ps, expected)]
    llm = _auto(target, WrongDrafter(VOCAB, 6, sequences=seqs, target_layer_ids=(0,), right=[0]), ROWS)
    free = llm.pool.num_free_pages
    outs = llm.generate(ps[:2], SamplingParams(max_tokens=24, ignore_eos=True))
    _check(outs, expected[:2], llm, free)
    right, wrong = (o.metrics["speculative_decoding"] for o in outs)
    assert right["num_accepted_draft_tokens"] >= 3 * right["num_spec_steps"] - 5
    assert right["num_plain_steps"] <= 1
    assert wrong["num_accepted_draft_tokens"] == 0 and wrong["num_plain_steps"] >= 15


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_trees_changing_size_every_step_are_lossless(target, drafter_path, reference, overlap, monkeypatch):
    """Plans that change every step (each bucket, plain steps, mixed groups) in one batch; the
    overlapped step queues the next tree only when the next plan gives it the same requests."""
    from treeflash.speculative import overlap as overlap_driver

    monkeypatch.setattr(overlap_driver, "OVERLAP", overlap)
    ps, expected = reference
    llm = _auto(target, drafter_path)
    assert llm.engine.spec.overlap is overlap
    spec = llm.engine.spec
    cycle = itertools.cycle([(63, "all"), (0, "all"), (1, "half"), (15, "all"), (3, "half"), (31, "all"),
                             (7, "all")])

    def wobble(self, states, contexts, forced=None, forced_build=None):
        budget, who = next(cycle)
        n = len(states)
        spec_ = list(range(n)) if who == "all" else list(range(0, n, 2))
        if not budget:
            return Plan(0, [], list(range(n)))
        return Plan(budget, spec_, [i for i in range(n) if i not in spec_])

    sizer = spec._sizer(llm.engine)
    sizer.plan = wobble.__get__(sizer)
    free = llm.pool.num_free_pages
    outs = llm.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    _check(outs, expected, llm, free)
    seen = {b for o in outs for b in o.metrics["speculative_decoding"]["per_step_budget"]}
    assert seen >= {1, 3, 7, 15, 31, 63}
    assert all(o.metrics["speculative_decoding"]["num_plain_steps"] > 0 for o in outs)


@pytest.mark.slow
def test_auto_with_sampling_runs_clean(target, drafter_path, reference):
    """Sampling under auto: the walk's own draws, metrics consistent. (A seeded request
    reproduces only when the plan sequence does: plans follow measured step times.)"""
    ps, _ = reference
    llm = _auto(target, drafter_path)
    free = llm.pool.num_free_pages
    outs = llm.generate(ps, SamplingParams(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    assert llm.pool.num_free_pages == free
    assert all("invariant_error" not in o.metrics["speculative_decoding"] for o in outs)


@pytest.mark.slow
def test_fused_tree_build_through_the_engine_is_lossless(target, drafter_path, reference, monkeypatch):
    """The one-launch tree build (kernels/tree_build.py, interpreter) in real steps, the
    budget changing under auto: still the target's greedy text."""
    from treeflash.speculative import build

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


def test_the_sizing_counts_in_prometheus(target, reference):
    """Per-budget and plain-step counters of the server's registry, fed by the engine's listeners."""
    from treeflash.server.metrics import ServerMetrics

    ps, expected = reference
    seqs = [p + e for p, e in zip(ps, expected)]
    llm = _auto(target, WrongDrafter(VOCAB, 6, sequences=seqs, target_layer_ids=(0,), right=[0]), ROWS)
    metrics = ServerMetrics("m")
    llm.engine.spec_listeners.append(metrics.on_spec_step)
    outs = llm.generate(ps[:2], SamplingParams(max_tokens=24, ignore_eos=True))
    text = metrics.render().decode()
    plain = sum(o.metrics["speculative_decoding"]["num_plain_steps"] for o in outs)
    steps = sum(o.metrics["speculative_decoding"]["num_spec_steps"] for o in outs)
    assert f'treeflash:spec_decode_num_plain_steps_total{{model_name="m"}} {float(plain)}' in text
    assert f'treeflash:spec_decode_num_drafts_total{{model_name="m"}} {float(steps)}' in text
    by = {}
    for o in outs:
        for b, n in o.metrics["speculative_decoding"]["steps_by_budget"].items():
            by[b] = by.get(b, 0) + n
    for b, n in by.items():
        assert f'treeflash:spec_decode_num_drafts_by_budget_total{{budget="{b}",model_name="m"}} {float(n)}' in text


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_decisions_and_scoring_builds_price_no_step(target, drafter_path, reference, overlap, monkeypatch):
    """A decision's host time (absorbing the walks, pricing: ~1 ms on the H100's host, where it
    fell on whichever budget ran and priced budget 3 above 31) is not the cost of the step it
    falls in, nor is a scoring step's wider build its budget's cost: here every decision sleeps
    0.5 s, no observed step takes that long, and only steps verifying their whole build are
    observed among the tree steps."""
    from treeflash.speculative import overlap as overlap_module

    monkeypatch.setattr(overlap_module, "OVERLAP", overlap)  # overlapped: the next plan is made inside a step
    ps, expected = reference
    cost = SyntheticCost(lambda n: 1.0, lambda n, b: 1.5 + 0.01 * b)
    llm = _auto(target, drafter_path, cost)
    decide, plan = B.TreeSizer._decide, B.TreeSizer.plan
    plans = []

    def slow_decide(self, *a, **k):
        time.sleep(0.5)
        return decide(self, *a, **k)

    def recorded(self, *a, **k):
        plans.append(plan(self, *a, **k))
        return plans[-1]

    at = []  # the plan index each observed step ran
    observe = cost.observe

    def observed(shape, seconds):
        at.append(len(plans) - 1)
        observe(shape, seconds)

    cost.observe = observed
    monkeypatch.setattr(B.TreeSizer, "_decide", slow_decide)
    monkeypatch.setattr(B.TreeSizer, "plan", recorded)
    out = llm.generate(ps[:1], SamplingParams(max_tokens=24, ignore_eos=True))
    assert out[0].token_ids == expected[0]
    sizer = llm.engine.spec.sizer
    assert sizer.repriced >= 2 and sizer.decide_s >= 1.0
    assert cost.observed and max(s for _, s in cost.observed) < 0.5, cost.observed
    narrow = sum(1 for p in plans if p.spec and p.build == p.budget)
    assert any(p.spec and p.build > p.budget for p in plans)
    assert sum(1 for shape, _ in cost.observed if shape.spec) <= narrow
    # nor the step after a change of budget (its tree was not queued behind the last step):
    # sequentially a step observes right after its own plan, the last made
    keys = [p.budget if p.spec else 0 for p in plans]
    if not overlap:
        switches = [i for i in at if not (i > 0 and keys[i] == keys[i - 1])]
        assert at and not switches, switches
