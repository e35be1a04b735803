"""The tree sizing (tree_budget="auto"): each step, for each request, the tree that pays, or none.

The rule. A request's next step commits 1 + G(b) tokens with a tree of b nodes, where G(b),
the expected accepted drafts, is the sum over the tree's first b nodes of each node's
calibrated acceptance: DDTree numbers nodes by the drafter's path probability (the tree of
budget b is the first b nodes of any bigger tree), and spec/calibration.py maps a node's
(depth, path log-prob) to the fraction of such nodes the walk accepted. A step costs
T(plain requests, speculative requests, b) seconds (`costs.StepCostModel`: attention at the
contexts, distinct experts touched by all the rows, weights by format, 64-row tiles, the
drafter, fixed costs, fitted to the steps the engine measures). The plan maximises committed
tokens / T over b in BUCKETS and over which requests verify a tree, the others decoding
plainly. For one request this is the marginal rule: grow the tree to the next bucket while the
expected tokens it gains per node pay for its marginal seconds per node at the current tokens
per second, and verify no tree at all when plain decoding commits more per second. Plans are
visited from the cheapest, and a dearer one must commit MARGIN more tokens per second (on a
launch-bound step the buckets cost nearly the same and calibration's last hundredths of a token
would otherwise pick the widest tree).

Off is a choice, per request: a request the plan leaves plain (its drafter is unreliable
here, its context long, the batch large) decodes plainly, its drafter cache catching up when it
speculates again, and is re-probed after REPROBE[0] plain steps with one tree of PROBE_BUDGET
nodes, the wait doubling up to REPROBE[1] while the probes keep finding nothing that pays. A new
request is judged by the engine's mean gains (its first tree has START_BUDGET nodes only while
nothing is known), so where no tree has been paying it starts plainly. Early in an engine's life
a plain step is priced once (two steps of the batch decoded plainly) before it is judged by.

Where the scores come from, and when. A tree is built on the device (inside the drafter's CUDA
graph, straight into the verify graph's inputs), verified by graphs captured per (batch,
budget), and the host syncs once per step. Sizing step i from step i's own scores would need a
second sync between its draft and its verify, and deciding on the device saves nothing (a
graph verifies every row it was captured with). So the size of step i+1 is decided on the host
from what came back in step i's one copy: the depth and score of every node of step i's tree
and the path the walk took. Sequentially that is one step behind; the overlapped CUDA step
queues step i+1's tree before it reads step i's copy, so there it is two steps behind. Each
request keeps G per bucket smoothed over its last steps (SMOOTHING) and a reliability (what
its walks accepted over what calibration predicted, per bucket and decayed), so a drafter
confident and wrong on this request is recognised within a step or two whatever the table says
for the others. Buckets above the request's last tree are extrapolated by the ratio of the
engine-wide mean accepted drafts (from steps that verified them), and one step explores the next
bucket up when it might pay and no tree of the group covered it for EXPLORE_EVERY steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from treeflash.costs import StepCostModel, StepShape
from treeflash.spec.calibration import DepthCalibration

# Graph-able tree sizes: 2^k - 1 nodes, so root + nodes = 2^k rows a request and heads x rows
# fill whole 64-row tiles of the verify kernel from 7 nodes up (8 heads: 64, 128, 256, 512 rows;
# 1 and 3 nodes take 16 and 32 rows of one tile).
BUCKETS = (1, 3, 7, 15, 31, 63)
START_BUDGET = 7  # a request's first tree when nothing is known yet
PROBE_BUDGET = 1  # a re-probe's tree: the cheapest, whether depth 1 is accepted again
REPROBE = (8, 64)  # plain steps before a re-probe: first wait, longest wait
SMOOTHING = 0.5  # weight of the newest step in a request's predicted gains
REQUEST_DECAY = 0.8  # a request's accepted / predicted sums: a memory of ~5 steps
KAPPA = 0.25  # pseudo-count pulling a request's accepted / predicted ratio to 1 before data
PROFILE_DECAY = 0.98  # the engine-wide mean gain per bucket
REPLAN_EVERY = 4  # steps a batch of more than 8 keeps its plan (same requests, no probe or new one due)
MARGIN = 0.02  # a plan dearer than the best so far (more rows, a tree at all) must commit 2% more tokens/s
HYSTERESIS = 0.9  # an off request's gains count for this much until a re-probe refreshes them
EXPLORE_EVERY = 8  # plans between upward explorations (and steps a bucket goes unverified first)
OWN_STALE = 32  # steps a request's own gain at a bucket above its last tree stays in use


@dataclass
class RequestSizing:
    """One request's view: per bucket, its smoothed predicted gain and the decayed sums of what
    its walks accepted and what calibration predicted for the same trees; its off state."""

    curve: list[float]  # per bucket: smoothed calibrated expected accepted drafts (nan: never)
    age: list[int]  # steps since each bucket was covered by a tree
    actual: list[float] = field(default_factory=list)  # per bucket: decayed accepted drafts ...
    predicted: list[float] = field(default_factory=list)  # ... and calibration's prediction for them
    steps: int = 0  # speculative steps observed
    off: bool = False
    plain_run: int = 0  # plain steps since it was turned off
    backoff: int = REPROBE[0]  # plain steps before its next re-probe
    probing: bool = False  # its last tree was a re-probe
    last_budget: int = 0

    def __post_init__(self):
        self.actual = self.actual or [0.0] * len(self.curve)
        self.predicted = self.predicted or [0.0] * len(self.curve)

    @property
    def probe_due(self) -> bool:
        return self.off and self.plain_run >= self.backoff

    @staticmethod
    def fresh(buckets: int) -> RequestSizing:
        return RequestSizing([math.nan] * buckets, [1 << 30] * buckets)


@dataclass
class Plan:
    """One step: `spec` (indices into the batch) verify trees of `budget` nodes, `plain` decode."""

    budget: int
    spec: list[int]
    plain: list[int]
    why: str = "rule"  # rule | start | probe | explore | price | forced


@dataclass
class TreeSizer:
    cost: StepCostModel
    max_depth: int
    buckets: tuple[int, ...] = BUCKETS
    calibration: DepthCalibration = field(init=False)
    profile: list[list[float]] = field(init=False)  # per bucket [decayed accepted drafts, weight]
    decisions: int = 0
    plans: Counter = field(default_factory=Counter)  # budget (0: all plain) -> plans
    _last: tuple | None = None  # (the batch's states, its plan): a big batch replans every REPLAN_EVERY

    def __post_init__(self):
        self.buckets = tuple(sorted(set(int(b) for b in self.buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"tree buckets must be positive ints, got {self.buckets!r}")
        self.calibration = DepthCalibration(self.max_depth)
        self.profile = [[0.0, 0.0] for _ in self.buckets]

    @property
    def max_budget(self) -> int:
        return self.buckets[-1]

    def new_state(self) -> RequestSizing:
        return RequestSizing.fresh(len(self.buckets))

    # ---- gains ------------------------------------------------------------------------------
    def profile_gain(self, i: int) -> float | None:
        s, w = self.profile[i]
        return s / w if w > 0 else None

    def gains(self, st: RequestSizing) -> list[float] | None:
        """Expected accepted drafts per bucket for this request's next step (None: no tree yet):
        the latest trees' calibrated prediction times what this request's walks accepted over
        what calibration predicted for them (per bucket: a drafter overconfident here, or a
        table still learning, is corrected by the request's own walks; constant scores leave
        the measured acceptance), above its last tree extrapolated."""
        known = [i for i, a in enumerate(st.age) if a == 0]
        if not known:
            known = [i for i, c in enumerate(st.curve) if not math.isnan(c)]
        if not known:
            return None
        last = max(known)
        g = [0.0] * len(self.buckets)
        for i in range(last + 1):
            g[i] = self._estimate(st, i) if not math.isnan(st.curve[i]) else (g[i - 1] if i else 0.0)
        inc = g[last] - g[last - 1] if last else g[last]
        for i in range(last + 1, len(self.buckets)):
            base, here = self.profile_gain(last), self.profile_gain(i)
            if not math.isnan(st.curve[i]) and st.age[i] <= OWN_STALE:  # its own, a few steps old
                g[i] = max(g[i - 1], self._estimate(st, i))
            elif base and here is not None:  # other requests' trees of that size
                g[i] = max(g[i - 1], g[last] * here / base)
            else:  # DDTree's acceptance saturates: each doubling gains half the last one
                g[i] = g[i - 1] + inc * 0.5 ** math.log2(self.buckets[i] / self.buckets[i - 1])
            inc = g[i] - g[i - 1]
        out, top = [], 0.0
        for x in g:
            top = min(float(self.max_depth), max(top, x))  # a bigger tree never accepts less
            out.append(top)
        return out

    @staticmethod
    def _estimate(st: RequestSizing, i: int) -> float:
        return st.curve[i] * (st.actual[i] + KAPPA) / (st.predicted[i] + KAPPA)

    # ---- the plan ---------------------------------------------------------------------------------
    def plan(self, states: Sequence[RequestSizing], contexts: Sequence[int], forced: int | None = None) -> Plan:
        """This step's plan for a batch (states and contexts in batch order)."""
        n = len(states)
        if forced is not None:  # warm-up: every request at this budget (0: plainly), unobserved
            return Plan(forced, list(range(n)) if forced else [], [] if forced else list(range(n)), "forced")
        self.decisions += 1
        typical = self._typical()
        fresh = [i for i, s in enumerate(states) if s.steps == 0 and not s.off]
        # must verify a tree: re-probes, and new requests while nothing is known (else a new
        # request is judged by the engine's mean gains, and may start plainly)
        must = [i for i, s in enumerate(states) if s.probe_due] + (fresh if typical is None else [])
        ids = tuple(map(id, states))
        if n > 8 and not must and self._last is not None and self._last[0] == ids and self.decisions % REPLAN_EVERY:
            plan = dataclasses.replace(self._last[1], spec=list(self._last[1].spec), plain=list(self._last[1].plain))
            self._commit(states, plan)  # a big batch's plan holds a few steps (pricing ~70 candidates costs ~1 ms)
            return plan
        free = [i for i, s in enumerate(states) if (s.steps > 0 and not s.probe_due) or
                (typical is not None and i in fresh)]
        gains = {i: self.gains(states[i]) if states[i].steps else list(typical) for i in free}
        for i in free:  # an off request returns by the rule only if its (old) gains pay clearly:
            if states[i].off:  # the costs or the batch changed; else it waits for its re-probe
                gains[i] = [HYSTERESIS * g for g in gains[i]]
        plan, best = self._best(states, contexts, must, free, gains)
        new = [i for i in must if i in fresh]  # (a request off since before its first tree is a re-probe)
        if new:  # nothing measured yet: a middling tree
            plan.budget, plan.why = START_BUDGET, "start"
        elif not must and plan.spec and not self.cost.priced(0) and self.decisions > 1:
            # what a plain step costs is what off is judged by: measured early, once (two steps:
            # the first is no sample), before it decides anything (a fixed cost assumed equal to a
            # tree step's would keep a request verifying trees that gain a fraction of a token)
            plan = Plan(0, [], list(range(n)), "price")
        elif must and not new and all(i in must for i in plan.spec):  # re-probes alone: a small tree
            plan.budget, plan.why = PROBE_BUDGET, "probe"
        else:
            plan = self._explore(plan, best, states, contexts, gains, typical)
        self._commit(states, plan)
        self._last = (ids, plan) if plan.why == "rule" else None
        return plan

    def _typical(self) -> list[float] | None:
        """The engine-wide mean gain per bucket (a new request's guess), None before any step."""
        g = [self.profile_gain(i) for i in range(len(self.buckets))]
        if all(x is None for x in g):
            return None
        out, last = [], 0.0
        for x in g:
            last = last if x is None else max(last, x)
            out.append(last)
        return out

    def _best(self, states, contexts, must, free, gains) -> tuple[Plan, float]:
        """The best (bucket, group): for each bucket the requests with the highest gains there
        verify trees, the first m of them for m on a grid (all m up to 8), must always."""
        n, total = len(states), float(sum(contexts))
        must_sum = float(sum(contexts[i] for i in must))
        best_at, best = None, -1.0
        if not must:
            best = n / self.cost.predict_of(n, total, 0, 0.0, 0)
        for bi, b in enumerate(self.buckets):
            order = sorted(free, key=lambda i: -gains[i][bi])
            ctx = list(itertools.accumulate((contexts[i] for i in order), initial=0.0))
            tok = list(itertools.accumulate((gains[i][bi] for i in order), initial=0.0))
            for m in _grid(len(order)):
                n_s = len(must) + m
                if not n_s:
                    continue
                s_s = must_sum + ctx[m]
                tput = (n + tok[m]) / self.cost.predict_of(n - n_s, total - s_s, n_s, s_s, b)  # (must: no gain)
                if tput > best * (1 + MARGIN):  # visited from the cheapest: a dearer plan must pay clearly
                    best_at, best = (b, order, m), tput
        if best_at is None:
            return Plan(0, [], list(range(n))), best
        b, order, m = best_at
        spec = sorted(must + order[:m])
        return Plan(b, spec, [i for i in range(n) if i not in set(spec)]), best

    def _explore(self, plan: Plan, best: float, states, contexts, gains, typical) -> Plan:
        """Every EXPLORE_EVERY plans, the bucket above the choice for one step, if no tree of the
        group covered it for EXPLORE_EVERY steps and it would pay were each further node to gain
        what the choice's last nodes gained (a saturated drafter is never pushed up)."""
        if not plan.spec or self.decisions % EXPLORE_EVERY:
            return plan
        bi = self.buckets.index(plan.budget)
        if bi + 1 >= len(self.buckets) or min(states[i].age[bi + 1] for i in plan.spec) < EXPLORE_EVERY:
            return plan
        lo = self.buckets[bi - 1] if bi else 0
        hi, up = self.buckets[bi], self.buckets[bi + 1]
        tokens = len(contexts)
        for i in plan.spec:
            g = gains.get(i) or typical
            if g is None:
                continue
            per_node = (g[bi] - (g[bi - 1] if bi else 0.0)) / (hi - lo)
            tokens += min(float(self.max_depth), g[bi] + per_node * (up - hi))
        shape = StepShape(tuple(contexts[i] for i in plan.plain), tuple(contexts[i] for i in plan.spec), up)
        if tokens / self.cost.predict(shape) > best:
            return Plan(up, plan.spec, plan.plain, "explore")
        return plan

    def _commit(self, states: Sequence[RequestSizing], plan: Plan) -> None:
        """Turn requests off / on as the plan says; count the plan. (A pricing step's requests
        decode plainly for that step alone.)"""
        self.plans[plan.budget if plan.spec else 0] += 1
        if plan.why == "price":
            return
        for i in plan.plain:
            s = states[i]
            if s.off:
                s.plain_run += 1
                continue
            s.off, s.plain_run = True, 1
            s.backoff = min(2 * s.backoff, REPROBE[1]) if s.probing else REPROBE[0]
            s.probing = False
        for i in plan.spec:
            s = states[i]
            s.probing = s.off  # a re-probe (turned back on: the next plan judges it)
            s.off, s.plain_run = False, 0
            s.last_budget = plan.budget

    # ---- what came back -------------------------------------------------------------------------------
    def observe_walks(self, states: Sequence[RequestSizing], depths: np.ndarray, scores: np.ndarray,
                      path: np.ndarray, accepted: np.ndarray) -> None:
        """One speculative step of `states` (the spec group, batch order): depths / scores [B, M]
        of tree nodes 1..M (rank order), path [B, W] the walk's accepted nodes (root first, 0
        pads), accepted [B] drafts the walk took."""
        b, m = depths.shape
        taken = np.zeros((b, m + 1), dtype=bool)
        taken[np.arange(b)[:, None], path] = True
        taken = taken[:, 1:]
        self.calibration.observe(depths.ravel(), scores.ravel(), taken.ravel())
        covered = [i for i, c in enumerate(self.buckets) if c <= m]
        cols = [self.buckets[i] - 1 for i in covered]
        pred = np.cumsum(self.calibration.predict(depths, scores), axis=1)[:, cols]  # [B, covered]
        act = np.cumsum(taken, axis=1)[:, cols]  # what a tree of each covered bucket accepted
        for r, st in enumerate(states):
            self._observe_one(st, covered, pred[r].tolist(), act[r].tolist())
        for j, i in enumerate(covered):
            p = self.profile[i]
            p[0] = PROFILE_DECAY * p[0] + float(act[:, j].sum())
            p[1] = PROFILE_DECAY * p[1] + b

    @staticmethod
    def _observe_one(st: RequestSizing, covered: list[int], pred: list[float], act: list[float]) -> None:
        st.steps += 1
        st.age = [a + 1 for a in st.age]
        for i, v, a in zip(covered, pred, act, strict=True):
            old = st.curve[i]
            st.curve[i] = v if math.isnan(old) else SMOOTHING * v + (1 - SMOOTHING) * old
            st.age[i] = 0
            st.actual[i] = REQUEST_DECAY * st.actual[i] + a
            st.predicted[i] = REQUEST_DECAY * st.predicted[i] + v

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        self.cost.observe(shape, seconds)

    # ---- explaining ---------------------------------------------------------------------------------
    def explain(self, contexts: Sequence[int], state: RequestSizing | None = None) -> dict:
        """Per bucket at these contexts (a batch of requests like `state`, else like the engine's
        mean): expected accepted drafts, step seconds, tokens/s, and per node the expected tokens
        gained and the marginal seconds over the bucket below; the choice among them and off."""
        n = len(contexts)
        g = (self.gains(state) if state is not None else None) or self._typical() or [0.0] * len(self.buckets)
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
        for r in rows:  # as plan(): from the cheapest, a bigger tree must pay MARGIN more
            if r["tok_s"] > best * (1 + MARGIN):
                choice, best = r["budget"], r["tok_s"]
        return {"batch": n, "contexts": list(contexts), "off": {"step_s": plain_s, "tok_s": off,
                                                                 "priced": self.cost.priced(0)},
                "buckets": rows, "choice": choice, "theta": self.cost.theta,
                "calibrated_steps": self.calibration.observations}

    def summary(self) -> dict:
        return {"decisions": self.decisions, "plans_by_budget": {str(k): v for k, v in sorted(self.plans.items())},
                "mean_gain_by_budget": {str(b): self.profile_gain(i) for i, b in enumerate(self.buckets)},
                "theta": self.cost.theta}


def _grid(n: int) -> list[int]:
    """How many of the best requests to try as the speculative group: all counts up to 8, then
    powers of two and n."""
    if n <= 8:
        return list(range(n + 1))
    return sorted({0, *range(1, 9), *(1 << k for k in range(3, n.bit_length())), n})


_BOUNDS: dict = {}  # (candidates, device) -> the candidates as a device tensor, made once


def candidate_bounds(candidates: Sequence[int], device):
    """The candidates as a [C] long tensor on `device`, made once: the walk's `candidates`
    (spec/verify.py), for which it counts each request's drafts accepted among nodes 1..b, per
    candidate b. Made once: a tensor made from a list each step is a pageable host-to-device
    copy, which waits for the stream."""
    import torch

    key = (tuple(candidates), device)
    bounds = _BOUNDS.get(key)
    if bounds is None:
        bounds = _BOUNDS[key] = torch.tensor(list(candidates), dtype=torch.long, device=device)
    return bounds
