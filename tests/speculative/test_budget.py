"""The tree sizing (speculative/budget.py, speculative/calibration.py): calibration converges to what walks
accept, the plan is the argmax of committed tokens per second over buckets and groups, an
always-wrong request goes plain and is re-probed on schedule, requests of a batch are sized
apart, and the rule finds the best fixed budget (or none) on synthetic drafters and costs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.optimize import isotonic_regression

from helpers.spec import SyntheticCost
from treeflash.costs import StepShape
from treeflash.speculative import budget as B
from treeflash.speculative.budget import BUCKETS, Plan, TreeSizer
from treeflash.speculative.build import build_tree
from treeflash.speculative.calibration import DepthCalibration, nonincreasing, nonincreasing_rows
from treeflash.speculative.verify import walk_tree

DEPTH = 7  # block 8, as Kimi's drafters


# ---- calibration -------------------------------------------------------------------------------
def test_pool_adjacent_violators_is_scipys_isotonic_regression():
    g = np.random.default_rng(0)
    for _ in range(20):
        y, w = g.random(15), g.random(15) + 0.1
        want = isotonic_regression(y, weights=w, increasing=False).x
        np.testing.assert_allclose(nonincreasing(y, w), want, atol=1e-12)


def test_the_table_refit_is_scipys_isotonic_regression_row_by_row():
    g = np.random.default_rng(1)
    y, w = g.random((17, 15)), g.random((17, 15)) + 0.1
    y[3] = np.linspace(0, 1, 15)  # increasing: one pooled value
    y[4] = np.linspace(1, 0, 15)  # already non-increasing: unchanged
    want = np.stack([isotonic_regression(y[d], weights=w[d], increasing=False).x for d in range(17)])
    np.testing.assert_allclose(nonincreasing_rows(y, w), want, atol=1e-12)


@pytest.mark.parametrize("truth", ["overconfident", "underconfident", "depth-dependent"])
def test_calibration_converges_on_a_synthetic_drafter(truth):
    """Nodes drawn at random depths and path probabilities, accepted with a known probability
    that is not the drafter's claim: the table converges to it (bins with data, within 0.06)."""
    acc = {"overconfident": lambda d, p: 0.5 * p, "underconfident": lambda d, p: np.sqrt(p),
           "depth-dependent": lambda d, p: p * np.where(d <= 2, 1.0, 0.3)}[truth]
    g = np.random.default_rng(1)
    cal = DepthCalibration(DEPTH)
    for _ in range(600):
        depths = g.integers(1, DEPTH + 1, 64)
        scores = -g.exponential(1.5, 64).astype(np.float32)
        taken = g.random(64) < acc(depths, np.exp(scores))
        cal.observe(depths, scores, taken)
    table = cal.table
    for d in (1, 3, 6):
        for lo, hi in ((0.03, 0.07), (0.3, 0.5), (1.0, 1.5), (2.0, 3.0)):
            mid = -(lo + hi) / 2
            got = float(cal.predict(np.array([d]), np.array([mid], dtype=np.float32))[0])
            p = np.exp(np.linspace(-hi, -lo, 50))
            want = float(np.mean(acc(np.full(50, d), p)))
            assert abs(got - want) < 0.06, (d, lo, got, want)
        assert (np.diff(table[d]) <= 1e-12).all()  # non-increasing in the score bin


def test_calibration_starts_at_the_drafters_claim_and_forgets():
    cal = DepthCalibration(3)
    claim = cal.predict(np.array([1, 1]), np.array([-0.005, -2.5], dtype=np.float32))
    assert claim[0] > 0.95 and 0.05 < claim[1] < 0.12
    for _ in range(300):  # confident and always rejected
        cal.observe(np.array([1] * 8), np.full(8, -0.001, dtype=np.float32), np.zeros(8, dtype=bool))
    assert cal.predict(np.array([1]), np.array([-0.001], dtype=np.float32))[0] < 0.02


# ---- synthetic drafters through build + walk ---------------------------------------------------
def _logits(batch: int, vocab: int = 50) -> torch.Tensor:
    """A drafter sure of token 1 at every depth (p ~ 0.95), the rest spread."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, DEPTH, vocab, generator=g)
    x[..., 1] = 6.0
    return x


def _step(sizer, states, plan: Plan, right: list[int]) -> None:
    """Build the plan's trees, walk them against a target whose tokens are 1 for the first
    right[r] depths of request r (then 2), and feed the sizer what the decoder would."""
    spec = plan.spec
    if not spec:
        return
    n = len(spec)
    built = build_tree("ddtree", _logits(n), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                       plan.build)  # a scoring step builds wide and verifies the first `budget` nodes
    tree = built if built.width <= plan.budget + 1 else built.prefix(plan.budget + 1)
    post = torch.where(tree.depths < torch.tensor([right[i] for i in spec])[:, None], 1, 2)
    walk = walk_tree(tree, post)
    sizer.record([states[i] for i in spec], built.depths[:, 1:].numpy(), built.scores[:, 1:].numpy(),
                 walk.index.numpy(), min(plan.budget, built.width - 1), plan.why)


def _run(sizer, right: list[int], steps: int, contexts=None) -> list[Plan]:
    states = [sizer.new_state() for _ in right]
    plans = []
    for _ in range(steps):
        plan = sizer.plan(states, contexts or [1000] * len(right))
        plans.append(plan)
        _step(sizer, states, plan, right)
    return plans


# step seconds by budget (0: plain), batch 1: launch-bound (flat) and MoE-like (steep)
COSTS = {"flat": {0: 1.0, 1: 1.6, 3: 1.62, 7: 1.65, 15: 1.7, 31: 1.8, 63: 2.1},
         "moe": {0: 1.0, 1: 1.25, 3: 1.6, 7: 2.2, 15: 3.2, 31: 5.0, 63: 8.0}}


def _best_by_brute_force(cost: dict, right: int) -> int:
    """argmax over {off, buckets} of (1 + accepted) / seconds, the drafter's chain being the
    top nodes (its sibling branches never accepted)."""
    tput = {b: (1 + min(right, b, DEPTH)) / s for b, s in cost.items()}
    top = max(tput.values())
    return min(b for b, t in tput.items() if t >= top * (1 - 1e-9))


@pytest.mark.slow
@pytest.mark.parametrize("cost", ["flat", "moe"])
@pytest.mark.parametrize("right", [0, 1, 3, DEPTH])
def test_finds_the_best_fixed_budget_or_none(cost, right):
    """One request, 80 steps: after its first steps, on at least 85% of the last 40 steps (the
    rest: probes, explorations) the plan runs the best of {off, every bucket} (brute force) or
    one within the margins the rule holds a choice by (a dearer plan pays MARGIN more; the held
    one stays unless another pays SWITCH_MARGIN more)."""
    table = COSTS[cost]
    sizer = TreeSizer(SyntheticCost(lambda n: table[0], lambda n, b: table[b]), DEPTH)
    plans = _run(sizer, [right], 80)
    want = _best_by_brute_force(table, right)
    chosen = [p.budget if p.spec else 0 for p in plans[40:]]

    def tput(b):
        return (1 + min(right, b, DEPTH)) / table[b]

    near = tput(want) / ((1 + B.MARGIN) * (1 + B.SWITCH_MARGIN))
    assert sum(tput(b) >= near for b in chosen) >= 34, (want, chosen)


def test_an_always_wrong_request_goes_plain_and_is_reprobed_with_backoff():
    table = COSTS["moe"]
    sizer = TreeSizer(SyntheticCost(lambda n: table[0], lambda n, b: table[b]), DEPTH)
    plans = _run(sizer, [0], 200)
    spec_steps = [i for i, p in enumerate(plans) if p.spec]
    assert spec_steps[0] == 0 and plans[0].budget == B.START_BUDGET and plans[0].why == "start"
    gaps = np.diff(spec_steps).tolist()
    # each probe finds nothing: the waits double from REPROBE[0] to REPROBE[1] plain steps
    first, longest = B.REPROBE
    waits = [min(first << k, longest) + 1 for k in range(len(gaps))]
    assert gaps == waits or (gaps[0] <= 2 and gaps[1:] == waits[:-1]), gaps
    assert all(plans[i].budget == B.PROBE_BUDGET and plans[i].why == "probe" for i in spec_steps[2:])
    assert len(spec_steps) <= 8


def test_a_probe_that_takes_nothing_leaves_the_request_plain():
    """Trees barely dearer than a plain step (a wrong drafter's 0.3 drafts would pay for a
    7-node tree): a one-node probe that the walk rejects says nothing about deeper nodes, whose
    calibration is still the drafter's claim; the request stays plain until the next probe
    (the H100 run at 5ce2afd: kimi-k2.6-tp8 at acceptance 0 verified 7 nodes after each probe,
    0.90x spec off)."""
    for table in ({0: 1.0, 1: 1.1, 3: 1.15, 7: 1.25, 15: 1.4, 31: 1.6, 63: 2.0},
                  {0: 6.9, 1: 8.2, 3: 9.3, 7: 13.4, 15: 13.8, 31: 15.8, 63: 24.4}):  # (the H100's, ms)
        sizer = TreeSizer(SyntheticCost(lambda n, t=table: t[0], lambda n, b, t=table: t[b]), DEPTH)
        _run(sizer, [0], 24)  # an earlier request: the engine's gains are known
        trees = [p for p in _run(sizer, [0], 200) if p.spec]
        assert len(trees) >= 2 and all(p.why == "probe" and p.budget == B.PROBE_BUDGET for p in trees), trees


class _AgedCost(SyntheticCost):
    """Prices from a table; a budget's price ages by one a plan, and a plan of it renews it."""

    def __init__(self, table):
        super().__init__(lambda n: table[0], lambda n, b: table[b])
        self.sizer = None
        self.at: dict = {}

    def age(self, key) -> float:
        plans = self.sizer.decisions
        return float(plans - self.at.get(key, plans - 1000))


def test_a_held_tree_reprices_its_stale_neighbours_in_steady_state():
    """The buckets a held tree left keep the prices of their last steps (the warm-up's, where plans
    change every few steps); once a neighbour's price is REPRICE_AGE samples old the batch runs it
    for REPRICE_STEPS steps, then decides afresh, and holds its best tree the rest of the time."""
    cost = _AgedCost(COSTS["flat"])
    sizer = cost.sizer = TreeSizer(cost, DEPTH)
    states = [sizer.new_state()]
    plans = []
    for _ in range(400):
        plans.append(sizer.plan(states, [1000]))
        cost.at[plans[-1].budget if plans[-1].spec else 0] = sizer.decisions
        _step(sizer, states, plans[-1], [DEPTH])
    runs = [p.split() for p in B.plans_text([(p.budget, p.why) for p in plans]).split(", ")][1:-1]
    reprices = [(int(b), int(n[1:])) for b, why, n in runs if why == "reprice"]
    held = max({int(b) for b, why, _ in runs if why == "rule"}, key=lambda b: sum(
        int(n[1:]) for bb, why, n in runs if why == "rule" and int(bb) == b))
    assert reprices and all(n == B.REPRICE_STEPS for _, n in reprices), runs
    assert {b for b, _ in reprices} <= {3, 15} and held == 7, runs
    # a re-price interrupts the hold and ends none: the held tree's decisions stay HOLD[1] apart
    assert sizer.repriced <= 400 / B.HOLD[1] + len(reprices) + 2, sizer.repriced
    per_neighbour = 400 * B.REPRICE_STEPS / B.REPRICE_AGE + B.REPRICE_STEPS
    assert sum(n for _, n in reprices) <= 2 * per_neighbour, runs


def test_a_new_request_is_judged_by_the_engines_mean_gains():
    """While nothing is known a new request's first tree has START_BUDGET nodes; once earlier
    requests have shown that no tree pays, a new one starts plainly (and is re-probed)."""
    table = COSTS["moe"]
    sizer = TreeSizer(SyntheticCost(lambda n: table[0], lambda n, b: table[b]), DEPTH)
    _run(sizer, [0], 20)
    later = sizer.new_state()
    first = sizer.plan([later], [1000])
    assert (first.budget, first.spec, first.plain) == (0, [], [0])
    assert later.off and sizer.backoff >= B.REPROBE[0]
    plans = [sizer.plan([later], [1000])]
    while not plans[-1].spec and len(plans) <= B.REPROBE[1]:
        plans.append(sizer.plan([later], [1000]))
    assert plans[-1] == Plan(B.PROBE_BUDGET, [0], [], "probe", B.BUCKETS[-1])  # small (built wide), not a first
    sizer = TreeSizer(SyntheticCost(lambda n: table[0], lambda n, b: table[b]), DEPTH)
    _run(sizer, [DEPTH], 20)
    plan = sizer.plan([sizer.new_state()], [1000])
    assert plan.spec == [0] and plan.budget >= 3 and plan.why in ("rule", "explore")


def test_a_reprobe_that_finds_the_drafter_right_again_turns_it_back_on():
    table = COSTS["moe"]
    sizer = TreeSizer(SyntheticCost(lambda n: table[0], lambda n, b: table[b]), DEPTH)
    states = [sizer.new_state()]
    right = [0]
    for i in range(80):
        if i == 20:
            right = [DEPTH]  # the drafter recovers (a new part of the text)
        plan = sizer.plan(states, [1000])
        _step(sizer, states, plan, right)
    assert not states[0].off and plan.spec == [0] and plan.budget >= 3


def _kinds(plans: list[Plan]) -> str:
    """T: a tree step, p: a tapped plain step, u: an untapped one (spec off's forward)."""
    return "".join("T" if p.spec else ("p" if p.tapped else "u") for p in plans)


def _no_untapped_before_a_tree(kinds: str) -> None:
    """No tree follows an untapped plain step by TAP_BEFORE_PROBE steps or fewer: the drafter's
    cache holds the features of the last TAP_BEFORE_PROBE positions before each tree."""
    for j, k in enumerate(kinds):
        if k == "T":
            assert "u" not in kinds[max(0, j - B.TAP_BEFORE_PROBE):j], (j, kinds)


def test_a_plain_spell_runs_untapped_but_its_last_steps_before_a_probe():
    """An always-wrong drafter: each plain spell runs spec off's forward except its last
    TAP_BEFORE_PROBE steps before the re-probe; the first spell (REPROBE[0] steps) is all tapped."""
    table = COSTS["moe"]
    sizer = TreeSizer(SyntheticCost(lambda n: table[0], lambda n, b: table[b]), DEPTH)
    kinds = _kinds(_run(sizer, [0], 200))
    _no_untapped_before_a_tree(kinds)
    spells = kinds[1:].split("T")  # the plain steps between trees (the last one cut by the run's end)
    first, longest = B.REPROBE
    assert spells[0] == "p" * first, kinds
    for k, spell in enumerate(spells[1:-1], 1):
        wait = min(first << k, longest)
        assert spell == "u" * (wait - B.TAP_BEFORE_PROBE) + "p" * B.TAP_BEFORE_PROBE, (k, kinds)
    assert kinds.count("u") >= 0.6 * (len(kinds) - kinds.count("T")), kinds


@pytest.mark.parametrize("switch", [25, 60, 90, 120])
def test_a_plain_spell_left_for_a_tree_taps_first(switch):
    """Trees too dear, so a drafter right at every depth decodes plainly; then trees get cheap
    (at `switch`, inside an untapped stretch): the rule decides again at the stretch's end (the
    decision holds through it) and leaves the spell for trees after tapping the steps the
    drafter's cache lacks ("warm"), never right after untapped steps."""
    dear = {"spec": 100.0}
    sizer = TreeSizer(SyntheticCost(lambda n: 1.0, lambda n, b: dear["spec"] + 0.01 * b), DEPTH)
    states, plans = [sizer.new_state()], []
    for i in range(switch + 130):
        if i == switch:
            dear["spec"] = 1.05
        plans.append(sizer.plan(states, [1000]))
        _step(sizer, states, plans[-1], [DEPTH])
    kinds = _kinds(plans)
    _no_untapped_before_a_tree(kinds)
    assert kinds.endswith("T" * 5) and kinds[switch - 1] == "u", kinds  # (the switch: in an untapped stretch)
    warm = [i for i, p in enumerate(plans) if p.why == "warm"]
    assert len(warm) == B.TAP_BEFORE_PROBE and warm[0] > switch and kinds[warm[-1] + 1] == "T", kinds


def test_a_plain_spells_decision_holds_through_its_untapped_stretch_unless_the_batch_changes():
    """Held to the stretch's end (no decision every HOLD[1] steps), but a request joining the
    batch is decided for at once once HOLD[1] steps have passed (as often as a held decision)."""
    table = COSTS["moe"]
    sizer = TreeSizer(SyntheticCost(lambda n: table[0], lambda n, b: table[b]), DEPTH)
    states = [sizer.new_state()]
    for _ in range(60):  # past the second probe: a spell of 64 steps, its first 48 untapped
        _step(sizer, states, sizer.plan(states, [1000]), [0])
    assert sizer.spell_batch is not None
    repriced = sizer.repriced
    for _ in range(20):
        _step(sizer, states, sizer.plan(states, [1000]), [0])
    assert sizer.repriced == repriced
    states.append(sizer.new_state())
    sizer.plan(states, [1000, 24])
    assert sizer.repriced == repriced + 1


def test_a_plain_spell_ends_when_none_of_its_requests_is_left():
    """A new request after the spell's requests finished is decided for at once, with no tapped
    steps first (its drafter cache holds every position): `bench sweep`'s timed request had
    inherited its untimed predecessor's spell (H100, 2026-12-07: 21 plain steps, the real
    drafter at acceptance ~3, auto 0.56x the best fixed budget)."""
    table = COSTS["moe"]
    sizer = TreeSizer(SyntheticCost(lambda n: table[0], lambda n, b: table[b]), DEPTH)
    states = [sizer.new_state()]
    for _ in range(200):
        _step(sizer, states, sizer.plan(states, [1000]), [0])
        if sizer.spell_batch is not None and sizer.spell_batch[1] - sizer.hold < 4:
            break
    assert sizer.spell_batch is not None and sizer.hold > 8
    sizer.learner.profile[:] = [[DEPTH] * len(sizer.buckets), [1.0] * len(sizer.buckets)]  # trees paid since
    repriced, states = sizer.repriced, [sizer.new_state()]
    plan = sizer.plan(states, [1000])
    assert sizer.repriced == repriced + 1 and plan.spec == [0], plan


def test_requests_of_a_batch_are_sized_apart():
    """A request the drafter gets right verifies a tree, one it gets wrong decodes plainly in the
    same step, where that split (two forwards) commits SPLIT_MARGIN more tokens a second than
    any one forward: requests' rows make a step dear (each row its own experts)."""
    sizer = TreeSizer(SyntheticCost(lambda n: 1.0 + 0.05 * n, lambda n, b: 1.0 + 0.2 * n * (b + 1) / 2), DEPTH)
    plans = _run(sizer, [DEPTH, 0, DEPTH, 0], 40)
    late = plans[20:]
    assert sum(p.spec == [0, 2] and p.plain == [1, 3] for p in late) >= 15, late


def test_a_large_batch_turns_speculation_down():
    """The same drafter (right for 3 depths): at batch 1 a tree pays, at batch 32 whose rows
    would touch every expert it does not (cost per step grows with the rows verified)."""
    def spec_s(n, b):  # compute-bound beyond 16 rows
        return 1.5 + 0.1 * max(0, n * (b + 1) - 16)
    for n, want_spec in ((1, True), (32, False)):
        sizer = TreeSizer(SyntheticCost(lambda k: 1.0 + 0.1 * max(0, k - 16), spec_s), DEPTH)
        plans = _run(sizer, [3] * n, 40)
        assert bool(plans[-1].spec) is want_spec, (n, plans[-1])


def test_plan_is_the_argmax_over_every_group_and_bucket():
    """Equal contexts, four requests with different gains: the plan's throughput is the best over
    all 2^4 groups x buckets (brute force), to within the margin a dearer plan must clear."""
    cost = SyntheticCost(lambda n: 1.0 + 0.3 * n, lambda n, b: 1.5 + 0.1 * n * (b + 1) ** 0.7)
    sizer = TreeSizer(cost, DEPTH)
    states = [sizer.new_state() for _ in range(4)]
    for s, right in zip(states, (0, 1, 3, DEPTH), strict=True):  # give each a gain curve
        _step(sizer, [s], Plan(15, [0], []), [right])
    gains = [sizer.gains(s) for s in states]
    plan = sizer.plan(states, [100] * 4)

    def tput(group, bi):
        plain = [i for i in range(4) if i not in group]
        shape = StepShape(tuple([100] * len(plain)), tuple([100] * len(group)), BUCKETS[bi] if group else 0)
        return (4 + sum(gains[i][bi] for i in group)) / cost.predict(shape)

    best = max(tput(g, bi) for r in range(5) for g in itertools.combinations(range(4), r)
               for bi in range(len(BUCKETS)))
    got = tput(plan.spec, BUCKETS.index(plan.budget) if plan.spec else 0)
    assert best / (1 + B.MARGIN) ** 2 <= got <= best * (1 + 1e-12)


def test_explain_says_gain_and_cost_per_node_and_picks_as_the_plan():
    table = COSTS["moe"]
    sizer = TreeSizer(SyntheticCost(lambda n: table[0], lambda n, b: table[b]), DEPTH)
    states = [sizer.new_state()]
    for _ in range(10):
        _step(sizer, states, sizer.plan(states, [1000]), [3])
    ex = sizer.explain([1000], states[0])
    rows = {r["budget"]: r for r in ex["buckets"]}
    assert rows[3]["accepted"] == pytest.approx(3.0, abs=0.3)
    assert rows[3]["gain_per_node"] == pytest.approx((rows[3]["accepted"] - rows[1]["accepted"]) / 2)
    assert rows[7]["cost_per_node_s"] == pytest.approx((table[7] - table[3]) / 4)
    assert ex["choice"] == _best_by_brute_force(table, 3) == 3
    assert ex["off"]["step_s"] == table[0]


@pytest.mark.parametrize("right, batch", [(0, 1), (3, 1), (DEPTH, 1), (3, 8), (DEPTH, 32)])
def test_explain_picks_what_the_rule_decides(right, batch):
    """doctor's tree_sizing (explain) at a context and batch names the bucket the rule's own
    decision takes for a batch of requests like this one (none held), with MoE-like costs that
    grow with the rows verified."""
    cost = SyntheticCost(lambda n: 1.0 + 0.01 * n, lambda n, b: 1.0 + 0.02 * n * (b + 1) ** 0.8)
    sizer = TreeSizer(cost, DEPTH)
    states = [sizer.new_state()]
    for _ in range(30):
        _step(sizer, states, sizer.plan(states, [1000]), [right])
    ex = sizer.explain([1000] * batch, states[0])
    group = [states[0]] * batch
    decided = sizer._best(group, [1000] * batch, np.repeat(np.array([sizer.gains(states[0])]), batch, 0))
    assert ex["choice"] == decided.budget, (ex["choice"], decided)
    tput = {r["budget"]: r["tok_s"] for r in ex["buckets"]} | {0: ex["off"]["tok_s"]}
    assert tput[ex["choice"]] * (1 + B.MARGIN) ** len(BUCKETS) >= max(tput.values())


def test_a_plain_step_is_priced_early_without_turning_anyone_off():
    """Before any plain step was measured, after the first trees, the batch decodes plainly for
    the cost model (three times: the step after the trees is a switch, a kind's first step is no
    sample), then the rule goes on; nobody is turned off by it."""
    class Unpriced(SyntheticCost):
        def __init__(self):
            super().__init__(lambda n: 1.0, lambda n, b: 1.2 + 0.01 * b)
            self.plain_steps = 0

        def priced(self, key):
            return key != 0 or self.plain_steps >= 3

    cost = Unpriced()
    sizer = TreeSizer(cost, DEPTH)
    states = [sizer.new_state() for _ in range(2)]
    whys = []
    for _ in range(8):
        plan = sizer.plan(states, [1000, 1000])
        whys.append(plan.why)
        cost.plain_steps += not plan.spec
        _step(sizer, states, plan, [DEPTH, DEPTH])
    assert whys[:4] == ["start", "price", "price", "price"] and whys[4:].count("price") == 0, whys
    assert not any(s.off for s in states)


def test_forced_budget_is_every_request_unobserved():
    sizer = TreeSizer(SyntheticCost(lambda n: 1.0, lambda n, b: 2.0), DEPTH)
    states = [sizer.new_state() for _ in range(3)]
    assert sizer.plan(states, [10, 20, 30], forced=15) == Plan(15, [0, 1, 2], [], "forced")
    assert sizer.plan(states, [10, 20, 30], forced=0) == Plan(0, [], [0, 1, 2], "forced")
    assert sizer.decisions == 0 and all(s.steps == 0 and not s.off for s in states)


def test_bad_buckets():
    with pytest.raises(ValueError, match="positive"):
        TreeSizer(None, DEPTH, buckets=(0, 3))
