"""Adaptive node budget: on synthetic cost and acceptance curves the controller finds the best of
{7, 15, 31, 63, 127}, follows the context as verify gets dearer, and reads acceptance off walks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from treeflash.spec import verify
from treeflash.spec.budget import (
    CANDIDATES,
    AcceptanceProfile,
    BudgetController,
    candidate_bounds,
)
from treeflash.spec.build import build_tree
from treeflash.spec.verify import walk_tree

# Expected accepted drafts per step vs budget (rising, saturating, as DDTree's tau does).
ACCEPT = {
    "saturating": dict(zip(CANDIDATES, (2.0, 2.9, 3.4, 3.6, 3.7), strict=True)),
    "steep": dict(zip(CANDIDATES, (1.0, 2.0, 3.5, 5.5, 7.0), strict=True)),
    "flat": dict(zip(CANDIDATES, (3.0, 3.05, 3.1, 3.12, 3.13), strict=True)),
}


def step_s(b: int, context: int, base: float = 10e-3, per_row: float = 0.05e-3,
           per_row_token: float = 2e-9) -> float:
    """A verify whose cost grows with the rows and, per row, with the context."""
    return base + per_row * (b + 1) + per_row_token * (b + 1) * context


def best(accept: dict, context: int, **kw) -> int:
    return max(CANDIDATES, key=lambda b: (1 + accept[b]) / step_s(b, context, **kw))


def run(ctrl: BudgetController, accept: dict, contexts, steps: int, **kw) -> list[int]:
    chosen = []
    for s in range(steps):
        ctx = contexts(s)
        b = ctrl.budget_for([ctx])
        chosen.append(b)
        ctrl.observe(b, [ctx], step_s(b, ctx, **kw), [[accept[c] for c in CANDIDATES]])
    return chosen


@pytest.mark.parametrize("curve", sorted(ACCEPT))
@pytest.mark.parametrize("context", [1024, 32768, 262144])
@pytest.mark.parametrize("cost", [dict(), dict(base=2e-3, per_row=0.2e-3), dict(per_row_token=2e-8)],
                         ids=["default", "row-bound", "attention-bound"])
def test_picks_the_best_fixed_budget(curve, context, cost):
    """Floor of the right shape (scaled: the measured ratio fixes the scale)."""
    accept = ACCEPT[curve]
    ctrl = BudgetController(lambda b, ctxs: 0.4 * step_s(b, ctxs[0], **cost), max_depth=15, every=4)
    chosen = run(ctrl, accept, lambda s: context, 64, **cost)
    assert chosen[0] == CANDIDATES[-1]  # first step measures every candidate's acceptance
    assert ctrl.choice == best(accept, context, **cost)
    # Probes aside, it runs at the best budget.
    assert sum(b == ctrl.choice for b in chosen[8:]) >= 0.8 * len(chosen[8:])


@pytest.mark.parametrize("curve", sorted(ACCEPT))
def test_misshapen_floor_is_corrected_by_probes(curve):
    """A flat floor says nothing about budgets: neighbour probes and per-budget ratios must
    still walk the controller to the best budget (the throughput curve is unimodal)."""
    accept = ACCEPT[curve]
    ctrl = BudgetController(lambda b, ctxs: 1e-3, max_depth=15, every=2, probe_every=1)
    run(ctrl, accept, lambda s: 32768, 300)
    assert ctrl.choice == best(accept, 32768)


def test_adapts_as_verify_gets_dearer_with_context():
    accept = ACCEPT["steep"]
    cost = dict(per_row_token=1e-8)
    first, last = best(accept, 1024, **cost), best(accept, 262144, **cost)
    assert first > last  # the curves are chosen so the best budget moves
    ctrl = BudgetController(lambda b, ctxs: 0.5 * step_s(b, ctxs[0], **cost), max_depth=15, every=4)
    steps = 400
    grow = lambda s: 1024 + (262144 - 1024) * s // steps  # noqa: E731
    chosen = run(ctrl, accept, grow, steps, **cost)
    assert chosen[2] == first  # after the largest budget's two steps
    assert Counter(chosen[2:16]).most_common(1)[0][0] == first  # probes aside
    assert ctrl.choice == last


@pytest.mark.parametrize("curve", sorted(ACCEPT))
def test_short_request_reaches_the_best_budget_early(curve):
    """Default schedule (every=16): a ~20-step request must not sit at the cheapest budget;
    the choice is made after the largest budget's two steps (one measures every acceptance,
    the second is its first cost sample) and held (probes aside)."""
    accept, ctx = ACCEPT[curve], 32768
    ctrl = BudgetController(lambda b, ctxs: 0.4 * step_s(b, ctxs[0]), max_depth=15)
    chosen = run(ctrl, accept, lambda s: ctx, 20)
    want = best(accept, ctx)
    assert chosen[0] == chosen[1] == CANDIDATES[-1] and chosen[2] == want
    assert sum(b == want for b in chosen[2:]) >= 14


def test_capture_steps_do_not_poison_the_cost():
    """A budget's first step (graph capture) and rare later spikes (an extend-graph capture)
    cost 100x; the controller must still settle on the best budget."""
    accept, ctx = ACCEPT["saturating"], 8192
    want = best(accept, ctx)
    ctrl = BudgetController(lambda b, ctxs: 0.4 * step_s(b, ctxs[0]), max_depth=15, every=4)
    seen, chosen = set(), []
    for s in range(80):
        b = ctrl.budget_for([ctx])
        chosen.append(b)
        t = step_s(b, ctx) * (100.0 if b not in seen or s % 13 == 0 else 1.0)
        seen.add(b)
        ctrl.observe(b, [ctx], t, [[accept[c] for c in CANDIDATES]])
    assert ctrl.choice == want
    assert sum(b == want for b in chosen[10:]) >= 0.8 * len(chosen[10:])


def test_acceptance_profile_extrapolates_and_decays():
    prof = AcceptanceProfile(CANDIDATES, max_depth=5, decay=0.5)
    assert prof.expected() == [None] * 5
    prof.observe([1.0, 2.0, None, None, None])
    exp = prof.expected()
    assert exp[:2] == [1.0, 2.0]
    assert 2.0 < exp[2] < exp[3] < exp[4] <= 5.0  # each doubling gains half the last one
    prof.observe([3.0, 3.0, 3.0, 3.0, 3.0])
    assert prof.measured(0) == pytest.approx((0.5 * 1 + 3) / 1.5)  # recent steps weigh more


def test_pinned_candidates_validated():
    with pytest.raises(ValueError):
        BudgetController(lambda b, c: 1.0, 5, candidates=())


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_walk_counts_what_smaller_budgets_would_accept(impl, monkeypatch):
    """The walk's per-candidate counts (the packed row's last columns) on a budget-128 walk equal
    the walk over the budget-b tree, for the torch walk and the fused one (interpreter)."""
    monkeypatch.setattr(verify, "WALK_IMPL", impl)
    g = torch.Generator().manual_seed(0)
    b, depth, vocab = 6, 7, 12
    logits = torch.randn(b, depth, vocab, generator=g) * 3
    roots = torch.randint(0, vocab, (b,), generator=g)
    start = torch.randint(0, 50, (b,), generator=g)
    big = build_tree("ddtree", logits, roots, start, 128)
    # A target that mostly agrees with the drafter's top choices, sometimes with lower ranks.
    n_big = big.width
    pick = torch.randint(0, 3, (b, n_big), generator=g)  # rank 0..2 of the drafter's choice
    ranks = logits.argsort(-1, descending=True)  # [B, D, V]
    slot = big.depths.clamp(max=depth - 1)  # after a node of depth d comes depth d+1 = slot d
    post = ranks[torch.arange(b)[:, None], slot, pick]  # [B, N]
    walk = walk_tree(big, post, candidate_bounds(CANDIDATES, post.device))
    under = walk.packed[:, -len(CANDIDATES):]
    for i, budget in enumerate(CANDIDATES):
        small = build_tree("ddtree", logits, roots, start, budget)
        n = small.width
        assert torch.equal(small.tokens, big.tokens[:, :n]), "a smaller tree is a prefix"
        sw = walk_tree(small, post[:, :n])
        assert torch.equal(under[:, i], sw.num_accepted), budget


def test_summary_reports_each_candidate():
    accept = ACCEPT["saturating"]
    ctrl = BudgetController(lambda b, ctxs: 0.5 * step_s(b, ctxs[0]), max_depth=15, every=4)
    run(ctrl, accept, lambda s: 8192, 20)
    s = ctrl.summary([8192])
    assert s["choice"] == ctrl.choice and set(s["candidates"]) == set(CANDIDATES)
    assert all(c["measured"] for c in s["candidates"].values())
    best_b = max(s["candidates"], key=lambda b: s["candidates"][b]["tok_s"])
    assert best_b == ctrl.choice


def test_floor_cost_follows_budget_context_and_batch():
    from treeflash.bench.floors import Ceilings
    from treeflash.bench.presets import build_preset
    from treeflash.spec.budget import FloorCost, _touched

    model, drafter, _ = build_preset("tiny", torch.device("cpu"), torch.float32)
    cost = FloorCost(model, drafter, Ceilings(1e11, 1e12, "test"))
    for ctx in (64, 4096):
        by_budget = [cost(b, [ctx]) for b in CANDIDATES]
        assert by_budget == sorted(by_budget) and by_budget[0] > 0
    assert cost(32, [8192]) > cost(32, [64])
    assert cost(32, [64, 64]) > cost(32, [64])
    moe = next(layer for layer in model.model.layers if hasattr(layer.mlp, "experts_gate"))
    e = moe.mlp.experts_gate.shape[0]
    touched = [_touched(moe, rows) for rows in (1, 4, 64, 4096)]
    assert touched[0] == pytest.approx(moe.mlp.gate.cfg.num_experts_per_tok)
    assert touched == sorted(touched) and touched[-1] == pytest.approx(e)


def test_capture_steps_are_not_cost_samples():
    """A step that captured CUDA graphs (seconds=None) leaves the cost model alone but still
    feeds the acceptance profile; the same slow steps as samples would mislead the choice."""
    accept = ACCEPT["saturating"]
    context = 32768

    def feed(ctrl, slow_as_samples):
        seen = dict.fromkeys(CANDIDATES, 0)
        for _ in range(96):
            b = ctrl.budget_for([context])
            t = step_s(b, context)
            seen[b] += 1
            slow = b <= CANDIDATES[2] and seen[b] <= 4  # a small budget's first steps capture graphs
            seconds = 5 * t if slow and slow_as_samples else (None if slow else t)
            ctrl.observe(b, [context], seconds, [[accept[c] for c in CANDIDATES]])
        return ctrl

    honest = feed(BudgetController(lambda b, c: 0.4 * step_s(b, c[0]), max_depth=15, every=4), False)
    assert honest.choice == best(accept, context)
    ctrl = BudgetController(lambda b, c: 0.4 * step_s(b, c[0]), max_depth=15, every=4)
    for seconds in (1e-3, 1e-3, None, None):  # the first is the budget's own first step
        ctrl.observe(CANDIDATES[1], [context], seconds, [[accept[c] for c in CANDIDATES]])
    i = 1
    assert len(ctrl.cost.history[i]) == 1  # the None steps left no cost sample
    assert ctrl.acceptance.weights[i] > 3.5  # but all four fed the acceptance profile


def test_probe_measures_every_unpriced_budget_nearest_first():
    """A budget whose cost is only borrowed (no sample of its own) is the next probe, nearest
    to the choice first, below as well as above, however far; a budget's first step is held
    for a second (the first is no sample), so each probe prices it (H200, 2026-12-03: with
    one-step probes of neighbours only, 7-31 were never priced and auto held 127)."""
    accept = ACCEPT["saturating"]
    ctrl = BudgetController(lambda b, c: 1e-3 * (1 + b / 64), max_depth=15, every=1, probe_every=1)
    row = [[accept[c] for c in CANDIDATES]]
    for b in (CANDIDATES[-1], CANDIDATES[3]):  # every A measured; 3 and 4 priced (2 steps each)
        for _ in range(2):
            ctrl.observe(b, [1024], 1.5e-3, row)
    ctrl.choice = CANDIDATES[4]
    assert ctrl._probe() == CANDIDATES[2]  # 3 is priced; 2 only borrows a price
    ctrl.choice = CANDIDATES[3]
    assert ctrl._probe() == CANDIDATES[2]  # nearest first, below the choice too
    ctrl = BudgetController(lambda b, c: 1e-3 * (1 + b / 64), max_depth=15, every=2, probe_every=1)
    for _ in range(24):
        b = ctrl.budget_for([1024])
        ctrl.observe(b, [1024], 1.5e-3 if b >= CANDIDATES[3] else 1.2e-3, row)
    assert all(ctrl.cost.history[i] for i in range(len(CANDIDATES)))  # every budget priced


def test_an_unpriced_budget_is_never_cheaper_than_a_smaller_priced_one():
    """A borrowed ratio may price a wide tree under a narrower tree's measured time (the
    floor's shape is off on a launch-bound step); the cost model keeps it at least as dear."""
    floor = {7: 1.0, 15: 1.0, 31: 1.1, 63: 1.3, 127: 2.0}
    ctrl = BudgetController(lambda b, c: 1e-3 * floor[b], max_depth=15)
    row = [[float(min(b, 15)) for b in CANDIDATES]]  # full acceptance: past 15 only the cost decides
    for b, seconds in ((127, 2.0e-3), (127, 2.0e-3), (15, 1.6e-3), (15, 1.6e-3)):
        ctrl.observe(b, [1024], seconds, row)
    # 63 borrows 127's ratio (1.0): 1.3 ms, under 15's measured 1.6 ms, were it not held up
    assert ctrl.cost.predict(63, [1024]) == pytest.approx(1.6e-3)
    assert ctrl.cost.predict(31, [1024]) == pytest.approx(1.76e-3)  # 15's ratio, nearer
    assert ctrl.best([1024]) == 15
