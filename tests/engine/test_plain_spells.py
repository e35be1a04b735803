"""tree_budget="auto"'s plain spells (speculative/budget.py, speculative/plain.py): at acceptance 0
they run spec off's own forward (no taps, the same graph) except the last TAP_BEFORE_PROBE steps
before each re-probe, and emit spec off's tokens; a drafter right again after an untapped
stretch is accepted from the next probe on; the real drafter's cache holds the untapped
positions as a gap and proposes over it, lossless."""

from __future__ import annotations

import itertools

import pytest

from helpers.spec import VOCAB, SyntheticCost
from treeflash import LLM, SamplingParams
from treeflash.engine.warmup import warm
from treeflash.graph_capture import graph_captures
from treeflash.speculative import budget as B
from treeflash.speculative.budget import Plan
from treeflash.speculative.testing_drafters import WrongDrafter

pytestmark = pytest.mark.slow  # (each 0.5-1 s, the reference's 120 tokens 4.6 s)

FLAT = SyntheticCost(lambda n: 1.0, lambda n, b: 1.5 + 0.01 * b)  # no tree pays at acceptance 0
TOKENS = 120  # the start tree, spells of 16, 32 and 64 plain steps, three probes


def _record(engine) -> list[tuple]:
    """Each decode-phase forward of `engine` (batch 1) from now on: (kind, call, graph key,
    position, request id): kind "T" a tree verify, "p" a plain step with the drafter's taps, "u"
    one without; call: what the forward was asked besides its tensors (rows, taps, graphable,
    masked, commit_later)."""
    calls, real = [], engine.forward

    def forward(reqs, input_ids, positions, prefix_lens, tree_mask=None, taps=(), graphable=False,
                commit_later=False):
        out = real(reqs, input_ids, positions, prefix_lens, tree_mask, taps, graphable, commit_later)
        if graphable:
            rows = input_ids.shape[1]
            kind = "T" if rows > 1 else ("p" if taps else "u")
            graphs = engine.executor.graphs
            key = graphs.last_step.key if graphs is not None else None
            calls.append((kind, (rows, tuple(taps), graphable, tree_mask is not None, commit_later), key,
                          int(positions[0, 0]), reqs[0].request_id))
        return out

    engine.forward = forward
    return calls


def _kinds(calls) -> str:
    return "".join(c[0] for c in calls)


def _no_untapped_before_a_tree(kinds: str) -> None:
    for j, k in enumerate(kinds):
        if k == "T" and j:
            assert "u" not in kinds[max(0, j - B.TAP_BEFORE_PROBE):j], (j, kinds)


@pytest.fixture(scope="module")
def long_reference(target):
    """A 24-token prompt (the warm-up's short length) and spec off's greedy TOKENS after it, with
    spec off's decode forwards (CUDA-graph path, eager on the CPU)."""
    prompt = [(7 * i + 3) % (VOCAB - 2) + 1 for i in range(24)]
    off = LLM(target, device="cpu", dtype="float32", page_size=8, cuda_graphs=True)
    calls = _record(off.engine)
    tokens = off.generate(prompt, SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0].token_ids
    return prompt, tokens, calls


def _auto(target, drafter):
    llm = LLM(target, drafter, spec="ddtree", tree_budget="auto", device="cpu", dtype="float32",
              page_size=8, cuda_graphs=True)
    llm.engine.spec._cost = FLAT
    return llm


def test_acceptance_0_plain_steps_are_spec_offs_forward(target, long_reference):
    """An always-wrong drafter, after the warm-up: spec off's tokens; every plain step of a
    spell runs the forward (same call, same graph key) spec off's decode runs, untapped, except
    the last TAP_BEFORE_PROBE before each probe; no graph is captured after the warm-up."""
    prompt, want, off_calls = long_reference
    llm = _auto(target, WrongDrafter(VOCAB, 6, sequences=[prompt + want], target_layer_ids=(0, 2)))
    warm(llm.engine, [prompt], TOKENS)  # LLM.warmup's round, on a prompt the test drafter knows
    assert llm.engine.spec.plain_forwards["untapped"] > 0  # the warm-up's forced untapped plan
    before, calls, warmed = graph_captures(), _record(llm.engine), dict(llm.engine.spec.plain_forwards)
    out = llm.generate(prompt, SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0]
    assert out.token_ids == want
    assert graph_captures() == before  # the untapped plain graph was warmed too
    kinds = _kinds(calls)
    _no_untapped_before_a_tree(kinds)
    first, _ = B.REPROBE
    untapped = 2 * first - B.TAP_BEFORE_PROBE  # the second spell's untapped steps
    assert kinds.startswith("T" + "p" * first + "T" + "u" * untapped + "p" * B.TAP_BEFORE_PROBE + "T"
                            + "u" * (4 * first - B.TAP_BEFORE_PROBE) + "p" * B.TAP_BEFORE_PROBE + "T"), kinds
    assert llm.engine.spec.plain_forwards["untapped"] - warmed["untapped"] == kinds.count("u") >= 60
    assert {(c[1], c[2]) for c in off_calls} == {(c[1], c[2]) for c in calls if c[0] == "u"}
    tapped = {c[1] for c in calls if c[0] == "p"}
    assert tapped == {(1, (0, 2), True, False, False)}  # one more forward kind: the drafter's taps
    m = out.metrics["speculative_decoding"]
    assert m["num_accepted_draft_tokens"] == 0 and "invariant_error" not in m


def test_a_probe_after_an_untapped_stretch_accepts_a_drafter_right_again(target, long_reference):
    """The drafter turns right in the middle of the third spell's untapped stretch: the probe
    after it (its last TAP_BEFORE_PROBE steps tapped) accepts, trees follow and accept at
    every depth; spec off's tokens throughout."""
    prompt, want, _ = long_reference
    turn = len(prompt) + 25  # the second spell runs its untapped steps at positions ~42 to ~57
    drafter = WrongDrafter(VOCAB, 6, sequences=[prompt + want], target_layer_ids=(0, 2), right_from=turn)
    llm = _auto(target, drafter)
    calls = _record(llm.engine)
    out = llm.generate(prompt, SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0]
    assert out.token_ids == want
    kinds = _kinds(calls)
    _no_untapped_before_a_tree(kinds)
    m = out.metrics["speculative_decoding"]
    accepting = next(i for i, a in enumerate(m["per_step_accepted"]) if a)
    trees = [c for c in calls if c[0] == "T"]
    probe = calls.index(trees[accepting])
    assert trees[accepting][3] > turn and m["per_step_budget"][accepting] == B.PROBE_BUDGET
    assert "u" in kinds[probe - 40:probe] and kinds[probe - B.TAP_BEFORE_PROBE:probe] == "p" * B.TAP_BEFORE_PROBE
    later = m["per_step_accepted"][accepting + 1:]
    assert later and sum(later) >= 3 * len(later) - 5, m["per_step_accepted"]  # trees back, deep


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_the_real_drafter_proposes_over_the_gap(target, drafter_path, reference, overlap, monkeypatch):
    """The real drafter (a sliding layer of window 5, a full layer) with plans that run untapped
    plain steps right before trees: spec off's tokens, and its full layer holds every position
    up to the last committed but the untapped ones (the catch-up appends each run apart)."""
    from treeflash.speculative import overlap as overlap_module

    monkeypatch.setattr(overlap_module, "OVERLAP", overlap)
    ps, expected = reference
    llm = LLM(target, drafter_path, spec="ddtree", tree_budget="auto", device="cpu", dtype="float32",
              page_size=8)
    spec = llm.engine.spec
    cycle = itertools.cycle([(7, True), (0, False), (0, False), (0, True), (0, False), (0, True), (0, True),
                             (3, True), (0, True), (0, False), (15, True)])

    def wobble(self, states, contexts, forced=None, forced_build=None):
        budget, tapped = next(cycle)
        n = len(states)
        return Plan(budget, list(range(n)), [], "rule") if budget else Plan(0, [], list(range(n)), tapped=tapped)

    sizer = spec._sizer(llm.engine)
    sizer.plan = wobble.__get__(sizer)
    calls = _record(llm.engine)
    held = []  # (request id, the full layer's positions) as each request finishes
    real_finish = spec.on_finish
    spec.on_finish = lambda req: held.append(
        (req.request_id, req.spec_state.cache.layers[1].view()[2].tolist())) or real_finish(req)
    outs = [llm.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))[0] for p in ps[:2]]
    assert [o.token_ids for o in outs] == expected[:2]
    assert spec.plain_forwards["untapped"] == sum(c[0] == "u" for c in calls) > 0
    assert len(held) == 2
    for rid, pos in held:
        untapped = {c[3] for c in calls if c[0] == "u" and c[4] == rid}
        top = max(pos)  # (positions past the last tree: tapped ones wait for the next catch-up)
        assert untapped and min(untapped) < top
        assert sorted(pos) == [p for p in range(top + 1) if p not in untapped], (pos, untapped)
