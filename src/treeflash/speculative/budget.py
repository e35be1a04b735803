"""The tree sizing (tree_budget="auto"): each step, the one forward that pays for the batch.

The rule. A request's step commits 1 + G(b) tokens with a tree of b nodes, where G(b), the
expected accepted drafts, is the sum over the tree's first b nodes of each node's calibrated
acceptance (DDTree numbers nodes by the drafter's path probability: the tree of budget b is the
first b nodes of any bigger tree; speculative/learning.py maps a node's depth and score to the
fraction of such nodes walks accepted and corrects it by what this request's walks accepted). A
step costs T(plain requests, tree requests, b) seconds (`costs.StepCostModel`, fitted to the
steps the engine measures, every bucket priced by the warm-up's steps). Plans, from the
cheapest: the whole batch plainly, the whole batch with trees of b nodes for b in BUCKETS; a
dearer one must commit MARGIN more tokens per second (on a launch-bound step the buckets cost
nearly the same, and calibration's last hundredths of a token would otherwise pick the widest
tree). A split step (the best requests' trees, the others plainly) runs two forwards, each with
its fixed cost, which the cost model prices; it is taken only when it commits SPLIT_MARGIN more
tokens per second than the best single forward (the first GPU run's `bench serve`: splits beside
hundreds of plain request-steps, 0.28-0.44x the best fixed setting).

Exploration is cheap and bounded. Buckets wider than the verified tree are predicted from the
drafter's scores, never verified to find out: every SCORE_EVERY-th tree step (and a request's
first, and each re-probe) the builder keeps the widest bucket's nodes and the step verifies only
the first b of them (one wider build, ~60 us on the H200 against a 63-node verify); the copy
brings back every kept node's depth and score. When no tree pays the batch decodes plainly and
is re-probed after REPROBE[0] plain steps with a one-node tree (the cheapest verify) built wide,
the wait doubling up to REPROBE[1] while the probes find nothing that pays: at most a few
one-node steps in a hundred plain ones. A plain spell runs spec off's own forward (no taps of
the target's hidden states for the drafter) except its last TAP_BEFORE_PROBE steps, which tap
them: the drafter's cache then holds a gap (the untapped positions) and the last steps' features
before the probe; a re-decision that would leave a spell for a tree without a probe first runs
the tapped steps it lacks ("warm"). Lossless either way: the walk follows the target's tokens.

Decisions hold. A decision is repriced HOLD[0] steps later, the hold doubling to HOLD[1] while it
stays the same; in between a step reuses it and the host only keeps the step's arrays, absorbed
in one vectorised pass at the next decision (speculative/learning.py). A start or a re-probe decides
again as soon as its walk is back; a plain spell's decision holds through its untapped stretch
(until the batch changes). On the shipped pair's 0.4-0.6 ms steps the host is the
critical path: per-step pricing and learning (~0.6 ms a step on this project's CPU) was what
put auto at 0.6-0.9 ms a step against fixed 15's 0.51.

Where the scores come from, and when. Trees are built on the device and verified by graphs
captured per (batch, budget); the host syncs once per step, and the size of step i+1 is decided
from what came back in earlier steps' copies (one step behind sequentially, two when the CUDA
step is overlapped: its next tree is queued before its copy is read).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from treeflash.costs import StepCostModel, StepShape
from treeflash.speculative.learning import Learner, RequestSizing, WalkRecord, gains_of

# Graph-able tree sizes: 2^k - 1 nodes, so root + nodes = 2^k rows a request and heads x rows
# fill whole 64-row tiles of the verify kernel from 7 nodes up (8 heads: 64, 128, 256, 512 rows;
# 1 and 3 nodes take 16 and 32 rows of one tile).
BUCKETS = (1, 3, 7, 15, 31, 63)
START_BUDGET = 7  # the first tree of an engine that knows nothing yet
PROBE_BUDGET = 1  # a re-probe's verified tree: the cheapest (built wide: every bucket predicted)
REPROBE = (16, 256)  # plain steps before a re-probe: first wait, longest wait
HOLD = (2, 16)  # steps a decision holds: first, longest (doubling while it stays the same)
SCORE_EVERY = 8  # tree steps between two wide (scoring) builds of a held decision
MARGIN = 0.02  # a plan dearer than the best so far must commit 2% more tokens/s
SPLIT_MARGIN = 0.10  # a split step (two forwards) must commit 10% more than the best single forward
HYSTERESIS = 0.9  # gains last measured before a plain spell count for this much until a probe
SWITCH_MARGIN = 0.05  # another single forward must commit 5% more tokens/s than the held one
# plain steps that tap the target's hidden states for the drafter before a tree follows a plain
# spell (the first GPU run, results/h100-20261207-spec-cost: auto's plain steps, all tapped,
# measured 1.58x / 1.22x of spec off's step at 1k / 32k at acceptance 0); the ones before run
# untapped, spec off's forward and graph. A full drafter layer then misses those positions (it
# attends by each slot's position); a sliding one of window W <= TAP_BEFORE_PROBE + 1 misses nothing.
TAP_BEFORE_PROBE = 16
# A held tree's neighbouring buckets are re-priced in steady state once their newest price is
# REPRICE_AGE samples old: REPRICE_STEPS steps at the neighbour (the first, a switch, prices
# nothing). Their prices came from the warm-up or a spell long gone, where a switch every few
# steps costs what steady steps do not (the H100 run at 819705b: the shipped pair's auto held 31
# for all 80 steps at 30k with buckets 1-31 priced alike, 0.80x budget 15).
REPRICE_AGE, REPRICE_STEPS = 96, 3
TRACE = 512  # plans kept for reading back what auto did (`bench sweep`'s auto_plans)
# the warm-up's forced plain plans, (budget 0, build): with the drafter's taps, and without them
PLAIN_TAPPED, PLAIN_UNTAPPED = (0, 0), (0, -1)


@dataclass
class Plan:
    """One step: `spec` (indices into the batch) verify trees of `budget` nodes, built with
    `build` >= budget nodes (a wide, scoring build: only the first `budget` are verified);
    `plain` decode without a tree, tapping the target's hidden states for the drafter's cache
    (`tapped`) or not (spec off's forward: a plain spell far from its next tree)."""

    budget: int
    spec: list[int]
    plain: list[int]
    why: str = "rule"  # rule | split | start | probe | explore | price | reprice | wait | warm | forced
    build: int = 0
    tapped: bool = True

    def __post_init__(self):
        self.build = max(self.build, self.budget)


@dataclass(frozen=True)
class Decision:
    """What the batch does until the next decision: trees of `budget` nodes (0: plainly) for
    every request, or (a split) for the requests whose states are in `spec`."""

    budget: int
    spec: frozenset | None = None
    why: str = "rule"


@dataclass
class TreeSizer:
    cost: StepCostModel
    max_depth: int
    buckets: tuple[int, ...] = BUCKETS
    learner: Learner = field(init=False)
    decisions: int = 0  # plans made (forced ones aside)
    repriced: int = 0  # of them, decided afresh
    plans: Counter = field(default_factory=Counter)  # budget (0: all plain) -> plans
    current: Decision | None = None
    hold: int = 0  # plans left before the next decision
    hold_len: int = HOLD[0]
    plain_run: int = 0  # consecutive plain steps (pricing steps aside)
    backoff: int = REPROBE[0]  # plain steps before the next re-probe
    since_score: int = 0  # tree steps since the last wide build
    react: bool = False  # a start's or a probe's walk is back: decide at the next plan
    after_probe: bool = False
    explored: int = 0  # the bucket the last exploration went up from (0: none pending)
    explore_wait: int = REPROBE[0]  # tree steps between two explorations (doubling while they find nothing)
    since_explore: int = 0  # tree steps since the last exploration
    warm_steps: int = TAP_BEFORE_PROBE  # tapped plain steps since the last untapped one (capped)
    # a plain spell held through its untapped stretch: its batch's states, and the hold it started with
    spell_batch: tuple[tuple, int] | None = None
    _before_reprice: tuple | None = None  # (the decision, its hold length) a re-price interrupted
    decide_s: float = 0.0  # host seconds spent deciding (absorbing walks, pricing): not a step's cost
    trace: deque = field(default_factory=lambda: deque(maxlen=TRACE))  # the last plans' (budget, why)

    def __post_init__(self):
        self.buckets = tuple(sorted(set(int(b) for b in self.buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"tree buckets must be positive ints, got {self.buckets!r}")
        self.learner = Learner(self.buckets, self.max_depth)

    @property
    def max_budget(self) -> int:
        return self.buckets[-1]

    @property
    def calibration(self):
        return self.learner.calibration

    def new_state(self) -> RequestSizing:
        return RequestSizing.fresh(len(self.buckets))

    # ---- gains ------------------------------------------------------------------------------
    def gains(self, st: RequestSizing) -> list[float] | None:
        """Expected accepted drafts per bucket for this request's next tree (None: never scored)."""
        self.learner.absorb()
        return gains_of([st], self.max_depth)[0].tolist() if st.scored else None

    def _gains(self, states: Sequence[RequestSizing], typical) -> np.ndarray:
        """[n, buckets]; a request never scored: the engine's mean gains (0 before any)."""
        g, scored = self.learner.gains(states)
        if not scored.all():
            g[~scored] = 0.0 if typical is None else typical
        return g

    def profile_gain(self, i: int) -> float | None:
        t = self.learner.typical()
        return None if t is None else float(t[i])

    # ---- the plan ---------------------------------------------------------------------------------
    def plan(self, states: Sequence[RequestSizing], contexts: Sequence[int], forced: int | None = None,
             forced_build: int | None = None) -> Plan:
        """This step's plan for a batch (states and contexts in batch order). forced (the
        warm-up): every request at this budget (0: plainly), built with forced_build nodes."""
        n = len(states)
        if forced is not None:
            if not forced:
                return Plan(0, [], list(range(n)), "forced", tapped=(0, forced_build) != PLAIN_UNTAPPED)
            return Plan(forced, list(range(n)), [], "forced", forced_build or forced)
        self.decisions += 1
        if self._due(states):
            t0 = time.perf_counter()
            self.current = self._decide(states, contexts)
            self._hold_stretch(states)
            self.decide_s += time.perf_counter() - t0
        self.hold -= 1
        plan = self._apply(states)
        self._commit(states, plan)
        self.trace.append((plan.budget if plan.spec else 0, plan.why))
        return plan

    def _due(self, states) -> bool:
        d = self.current
        if d is None or self.react or self.hold <= 0:
            return True
        if self.spell_batch is not None and _spell_ended(self.spell_batch, states, self.hold):
            if not any(s.off or s.steps for s in states):  # new requests: no untapped gap to warm
                self.warm_steps = TAP_BEFORE_PROBE
            return True
        return d.budget == 0 and d.why not in ("price", "warm") and self.plain_run >= self.backoff  # a re-probe

    def _decide(self, states, contexts) -> Decision:
        self.repriced += 1
        self.learner.absorb()
        previous, probed = self.current, self.after_probe
        self.react = self.after_probe = False
        typical = self.learner.typical()
        if typical is None and not any(s.scored for s in states):  # nothing known: a middling tree
            return self._hold(Decision(START_BUDGET, None, "start"), previous, until_walk=True)
        if previous is not None and previous.budget == 0 and previous.why not in ("price", "warm") and \
                self.plain_run >= self.backoff:
            return self._hold(Decision(PROBE_BUDGET, None, "probe"), previous, until_walk=True)
        gains = self._gains(states, typical)
        if previous is not None and previous.budget == 0 and not probed:  # stale gains: pay clearly
            gains = gains * HYSTERESIS
        decision = self._best(states, contexts, gains, previous)
        if probed and decision.budget and not any(s.saturated for s in states):
            # the probe's walks took no node: deeper nodes were never verified, their calibration
            # is the drafter's claim, and wider trees' gains are that claim scaled (the H100 run at
            # 5ce2afd: 7 nodes after each probe at acceptance 0, 0.90x spec off). Plain; the wait doubles.
            decision = Decision(0)
        elif decision.budget and decision.why == "rule" and previous is not None and previous.budget == 0 \
                and previous.why in ("rule", "warm") and not probed and not self._verified(states, decision.budget):
            # a plain spell ends through its probe, not on gains no walk verified at that size: the
            # same claims would take it straight to a tree the walks then reject
            decision = Decision(0)
        if self.explored:  # an exploration's walk is back: did the rule go up?
            up = decision.budget > self.explored
            self.explore_wait = REPROBE[0] if up else min(2 * self.explore_wait, REPROBE[1])
            self.explored = 0
        decision = self._explore(states, decision)
        decision = self._reprice(decision)
        if decision.budget and not self.cost.priced(0) and self.repriced > 1:
            # what a plain step costs is what off is judged by: measured once (two steps: the
            # first is no sample) before it decides anything (warmed engines have priced it)
            decision = Decision(0, None, "price")
        if decision.budget and self.warm_steps < TAP_BEFORE_PROBE:
            # the drafter caches miss the spell's untapped positions up to the last few: tap
            # the steps they lack before any tree, then decide again
            decision = self._hold(Decision(0, None, "warm"), previous)
            self.hold = TAP_BEFORE_PROBE - self.warm_steps
            return decision
        if probed:
            self.backoff = REPROBE[0] if decision.budget else min(2 * self.backoff, REPROBE[1])
        elif decision.budget:
            self.backoff = REPROBE[0]
        return self._hold(decision, previous, until_walk=decision.why == "explore")

    def _verified(self, states, budget: int) -> bool:
        """Whether every request of the spell has had trees of `budget` nodes or wider verified
        (its gains there are measured, not only the drafter's claims); a request new to the
        batch is judged by the engine's gains."""
        i = self.buckets.index(budget)
        return all(s.predicted[i] > 0 for s in states if s.off)

    def _hold_stretch(self, states) -> None:
        """A plain spell's rule decision holds to the end of its untapped stretch, or (at most every
        HOLD[1] steps) until the batch changes: within it no tree could follow before
        TAP_BEFORE_PROBE tapped steps anyway, and re-deciding every HOLD[1] steps was the host's
        largest share of a plain step under auto (benchmarks/notes/spec-cost.md)."""
        d, stretch = self.current, self.backoff - TAP_BEFORE_PROBE - self.plain_run
        self.spell_batch = None
        if d.budget == 0 and d.spec is None and d.why == "rule" and stretch > self.hold:
            self.hold, self.spell_batch = stretch, (tuple(states), stretch)

    def _hold(self, decision: Decision, previous: Decision | None, until_walk: bool = False) -> Decision:
        if previous is not None and previous.why == "reprice" and self._before_reprice is not None:
            previous, self.hold_len = self._before_reprice  # a re-price interrupts a hold, ends none
        if decision.why == "reprice":
            self._before_reprice = (previous, self.hold_len)
        same = previous is not None and (previous.budget, previous.spec) == (decision.budget, decision.spec)
        self.hold_len = min(2 * self.hold_len, HOLD[1]) if same else HOLD[0]
        self.hold = HOLD[1] if until_walk else {"price": 3, "reprice": REPRICE_STEPS}.get(decision.why, self.hold_len)
        return decision

    def _best(self, states, contexts, gains: np.ndarray, held: Decision | None = None) -> Decision:
        """The best single forward (all plainly, or all with trees of one bucket), then a split
        if it pays SPLIT_MARGIN more; visited from the cheapest, a dearer plan pays MARGIN more.
        The held single forward stays unless another pays SWITCH_MARGIN more: estimates of
        neighbouring buckets within a few percent of each other would otherwise swap the bucket
        every decision (each swap a scoring step and, for a new key, a graph)."""
        n, total = len(states), float(sum(contexts))
        best_d, best = Decision(0), n / self.cost.predict_of(n, total, 0, 0.0, 0)
        col = gains.sum(0)
        tputs = {0: best}
        for bi, b in enumerate(self.buckets):
            tput = tputs[b] = (n + col[bi]) / self.cost.predict_of(0, 0.0, n, total, b)
            if tput > best * (1 + MARGIN):
                best_d, best = Decision(b), tput
        if held is not None and held.spec is None and held.why in ("rule", "explore") and \
                held.budget in tputs and best < tputs[held.budget] * (1 + SWITCH_MARGIN):
            best_d, best = Decision(held.budget), tputs[held.budget]
        if n == 1:
            return best_d
        bar, split = best * (1 + SPLIT_MARGIN), None
        ctx = np.asarray(contexts, dtype=np.float64)
        for bi, b in enumerate(self.buckets):
            order = np.argsort(-gains[:, bi], kind="stable")
            tok = np.cumsum(gains[order, bi])
            s_s = np.cumsum(ctx[order])
            for m in _grid(n):
                tput = (n + tok[m - 1]) / self.cost.predict_of(n - m, total - s_s[m - 1], m, s_s[m - 1], b)
                if tput > bar:
                    bar, split = tput, Decision(b, frozenset(id(states[i]) for i in order[:m]), "split")
        return split or best_d

    def _explore(self, states, decision: Decision) -> Decision:
        """A tree step whose requests' last walks all went as deep as their verified trees (and
        no deeper than the rule's pick) says nothing about deeper nodes: calibration learns a
        depth only from verified nodes, so a drafter wrong for a while, then right again, would
        be held at the small tree it was re-probed with. Verify the next bucket up once, at most
        every `explore_wait` tree steps (doubling from REPROBE[0] to REPROBE[1] while explorations
        do not move the rule up)."""
        group = states if decision.spec is None else [s for s in states if id(s) in decision.spec]
        if not decision.budget or decision.budget >= self.max_budget or not group or \
                self.since_explore < self.explore_wait:
            return decision
        last = max(s.last_budget for s in group)
        if decision.budget > last or not all(s.saturated for s in group):
            return decision
        up = next(b for b in self.buckets if b > last) if last < self.max_budget else decision.budget
        if up <= decision.budget:
            return decision
        self.explored, self.since_explore = last, 0
        return Decision(up, decision.spec, "explore")

    def _reprice(self, decision: Decision) -> Decision:
        """A held tree of the whole batch whose neighbouring bucket (below first) was last priced
        REPRICE_AGE samples ago runs that bucket for REPRICE_STEPS steps."""
        if decision.why != "rule" or not decision.budget or decision.spec is not None:
            return decision
        i = self.buckets.index(decision.budget)
        for j in (i - 1, i + 1):
            if 0 <= j < len(self.buckets) and REPRICE_AGE <= self.cost.age(self.buckets[j]) < float("inf"):
                return Decision(self.buckets[j], None, "reprice")
        return decision

    def _apply(self, states) -> Plan:
        """The current decision for this batch: requests that joined a split decode plainly until
        the next decision; a wide build every SCORE_EVERY tree steps and for a new request."""
        d, n = self.current, len(states)
        everyone = list(range(n))
        spec = everyone if d.spec is None else [i for i, s in enumerate(states) if id(s) in d.spec]
        if not d.budget or not spec:
            # untapped: a plain spell of the rule's, its probe more than TAP_BEFORE_PROBE steps away
            far = d.why == "rule" and d.spec is None and self.plain_run < self.backoff - TAP_BEFORE_PROBE
            return Plan(0, [], everyone, d.why, tapped=not far)
        plain = [i for i in everyone if i not in set(spec)] if d.spec is not None else []
        wide = d.why in ("start", "probe", "explore") or self.since_score + 1 >= SCORE_EVERY or any(
            not states[i].widened for i in spec)
        plan = Plan(d.budget, spec, plain, d.why, self.max_budget if wide else d.budget)
        if d.why == "probe":  # one step; plainly until its walk is back
            self.current = Decision(0, None, "wait")
        return plan

    def _commit(self, states: Sequence[RequestSizing], plan: Plan) -> None:
        self.plans[plan.budget if plan.spec else 0] += 1
        self.warm_steps = TAP_BEFORE_PROBE if plan.spec else (
            min(self.warm_steps + 1, TAP_BEFORE_PROBE) if plan.tapped else 0)
        if plan.spec:
            self.plain_run = 0
            self.since_explore += 1
            self.since_score = 0 if plan.build > plan.budget or plan.why == "start" else self.since_score + 1
        elif plan.why != "price":
            self.plain_run += 1
        for i in plan.plain:
            states[i].off = True
        for i in plan.spec:
            states[i].off = False
            states[i].last_budget = plan.budget
            states[i].widened |= plan.build == self.max_budget

    # ---- what came back -------------------------------------------------------------------------------
    def record(self, states: Sequence[RequestSizing], depths: np.ndarray, scores: np.ndarray,
               path: np.ndarray, verified: int, why: str = "rule") -> None:
        """One speculative step of `states` (the tree group, batch order): depths / scores [B, M]
        of the built nodes 1..M, path [B, W] the walk's nodes (root first, 0 pads), nodes
        1..verified verified. Kept until the next decision (a start's or probe's: at once)."""
        self.learner.pending.append(WalkRecord(list(states), depths, scores, path, verified))
        if why in ("start", "probe", "explore"):
            self.react = True
            self.after_probe |= why == "probe"
        if len(self.learner.pending) > 4 * HOLD[1]:
            self.learner.absorb()

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        self.cost.observe(shape, seconds)

    # ---- explaining ---------------------------------------------------------------------------------
    def explain(self, contexts: Sequence[int], state: RequestSizing | None = None) -> dict:
        """Per bucket at these contexts (a batch of requests like `state`, else like the engine's
        mean): expected accepted drafts, step seconds, tokens/s, and per node the expected tokens
        gained and the marginal seconds over the bucket below; the choice among them and off."""
        n = len(contexts)
        self.learner.absorb()
        typical = self.learner.typical()
        if state is not None and state.scored:
            g = gains_of([state], self.max_depth)[0].tolist()
        else:
            g = list(typical) if typical is not None else [0.0] * len(self.buckets)
        plain_s = self.cost.predict(StepShape(tuple(contexts), (), 0))
        rows, prev_g, prev_s, prev_b = [], 0.0, plain_s, 0
        for b, gb in zip(self.buckets, g, strict=True):
            s = self.cost.predict(StepShape((), tuple(contexts), b))
            rows.append({"budget": b, "accepted": gb, "step_s": s, "tok_s": n * (1 + gb) / s,
                         "gain_per_node": (gb - prev_g) / (b - prev_b),
                         "cost_per_node_s": (s - prev_s) / (n * (b - prev_b)), "priced": self.cost.priced(b)})
            prev_g, prev_s, prev_b = gb, s, b
        off = n / plain_s
        choice, best = 0, off
        for r in rows:  # as the rule: from the cheapest, a bigger tree must pay MARGIN more
            if r["tok_s"] > best * (1 + MARGIN):
                choice, best = r["budget"], r["tok_s"]
        return {"batch": n, "contexts": list(contexts), "off": {"step_s": plain_s, "tok_s": off,
                                                                 "priced": self.cost.priced(0)},
                "buckets": rows, "choice": choice, "theta": self.cost.theta,
                "calibrated_steps": self.calibration.observations}

    def summary(self) -> dict:
        typical = self.learner.typical()
        return {"decisions": self.decisions, "repriced": self.repriced,
                "plans_by_budget": {str(k): v for k, v in sorted(self.plans.items())},
                "mean_gain_by_budget": {str(b): None if typical is None else float(typical[i])
                                        for i, b in enumerate(self.buckets)},
                "theta": self.cost.theta}


def plans_text(plans) -> str:
    """(budget, why) plans as runs: "7 rule x5, 0 price x2" (0: plainly)."""
    runs: list[list] = []
    for p in plans:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return ", ".join(f"{b} {why} x{n}" for (b, why), n in runs)


def _spell_ended(spell: tuple[tuple, int], states, hold: int) -> bool:
    """Whether a plain spell's long hold ends at this batch: none of the requests it was decided
    for is left (the H100 run of 2026-12-07, results/h100-20261207-spec-cost-3: `bench sweep`'s
    timed request, real drafter at acceptance ~3, inherited the untimed one's spell and ran 21
    plain steps before its probe, auto 0.56x the best fixed budget), or the batch changed once
    HOLD[1] steps of it have passed (decided as often as a held decision is: at 64 requests
    the batch may change every step). States are compared by identity, held for the spell (an
    id() of a finished request's state may be reused by a new one)."""
    batch, started = spell
    if len(batch) != len(states) or any(a is not b for a, b in zip(batch, states, strict=False)):
        kept = {id(s) for s in batch}
        return not any(id(s) in kept for s in states) or started - hold >= HOLD[1]
    return False


def _grid(n: int) -> list[int]:
    """Split sizes to try (1..n-1 requests verify trees): all up to 8, then powers of two."""
    if n <= 9:
        return list(range(1, n))
    return sorted({*range(1, 9), *(1 << k for k in range(3, (n - 1).bit_length()))} - {n})


_BOUNDS: dict = {}  # (candidates, device) -> the candidates as a device tensor, made once


def candidate_bounds(candidates: Sequence[int], device):
    """The candidates as a [C] long tensor on `device`, made once: the walk's `candidates`
    (speculative/verify.py), for which it counts each request's drafts accepted among nodes 1..b, per
    candidate b (what a tree of each smaller budget would have accepted: `bench sweep`'s
    hindsight bound). Made once: a tensor made from a list each step is a pageable
    host-to-device copy, which waits for the stream."""
    import torch

    key = (tuple(candidates), device)
    bounds = _BOUNDS.get(key)
    if bounds is None:
        bounds = _BOUNDS[key] = torch.tensor(list(candidates), dtype=torch.long, device=device)
    return bounds

