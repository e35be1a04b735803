"""The adaptive node budget: the DDTree budget that commits the most tokens per second.

Throughput at budget b is (1 + A(b)) / T(b): A = expected accepted drafts per step,
T = step seconds. Both are measured online; neither is taken on faith.

- A(b), the acceptance profile, comes from the walk (per depth, the score rank of the
  accepted node). Tree nodes are numbered in the
  order of their surrogate score (node i is the i-th best prefix), and the tree of budget
  b is exactly nodes 0..b of a bigger tree (the top-b prefixes, prefix-closed). The
  target's token after a node depends only on that node's path, so a walk over a tree
  of budget B also says what every smaller budget would have accepted: the accepted
  nodes numbered <= b. Each step thus measures A(b) for every candidate b <= B at once;
  for larger candidates A is extrapolated (each doubling gains half the last one, capped
  at the block depth) until a probe step measures it: the first step runs at the largest
  candidate (measuring every A at once), later probes go one candidate above or below the
  choice every `probe_every` re-evaluations, so profile and costs keep following the context.
- T(b) = ratio(b) x floor(b): the floor is `bench/floors.py`'s model of the step
  (attention over the batch's contexts, weights touched by B*(b+1) rows, the drafter), so
  T follows the context as it grows (verify gets dearer, and dearer for wide trees once
  attention is compute-bound); ratio(b) is the median of the last measured / floor per
  budget, its first (graph-capturing) step left out (budgets not yet measured borrow the
  nearest measured one's ratio, 1.0 before any).
- The controller re-evaluates argmax_b (1 + A(b)) / T(b) over the candidates at the batch's
  current contexts after steps 1, 2, 3, 5, 9 (a request of a few hundred tokens must not
  spend its first `every` steps at the cheapest budget: H200, 2026-12-02, that run held
  budget 8 for 16 of its 19 steps), then every `every` steps. A budget run for the first
  time is held for a second step, its first cost sample.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# One octave apart, and each a power of two minus one: the verify then runs 2^k rows a
# request (root included), so heads x rows fill whole 64-row tiles of the verify kernel (8
# heads: 64, 128, 256, 512, 1024 rows). Budget 32 (33 rows) pays a fifth tile for 8 rows,
# 17.5% of the kernel's tensor work: on the H200 (2026-12-02) the kimi-k2-tp8 step at budget
# 31 ran 4-7% faster than at 32 from 128k up, for one draft node less.
CANDIDATES = (7, 15, 31, 63, 127)

# floor(budget, contexts) -> seconds, contexts = the batch's committed tokens per request.
FloorFn = Callable[[int, Sequence[int]], float]


@dataclass
class AcceptanceProfile:
    """Decayed means of accepted drafts per step under each candidate budget."""

    candidates: tuple[int, ...]
    max_depth: int
    decay: float = 0.98  # per observation: old steps fade, so A follows the context
    sums: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.sums = [0.0] * len(self.candidates)
        self.weights = [0.0] * len(self.candidates)

    def observe(self, accepted: Sequence[float | None]) -> None:
        """accepted[i]: drafts one request's step accepted (or would have) under candidate i;
        None where that candidate exceeded the step's budget (not observed)."""
        for i, a in enumerate(accepted):
            if a is None:
                continue
            self.sums[i] = self.decay * self.sums[i] + float(a)
            self.weights[i] = self.decay * self.weights[i] + 1.0

    def measured(self, i: int) -> float | None:
        return self.sums[i] / self.weights[i] if self.weights[i] > 0 else None

    def expected(self) -> list[float | None]:
        """A(b) per candidate: measured, else extrapolated from the largest measured ones."""
        out = [self.measured(i) for i in range(len(self.candidates))]
        known = [i for i, a in enumerate(out) if a is not None]
        if not known:
            return out
        last = max(known)
        gain = out[last] - out[last - 1] if last > 0 and out[last - 1] is not None else 0.5
        for i in range(last + 1, len(out)):
            doublings = math.log2(self.candidates[i] / self.candidates[i - 1])
            gain *= 0.5 ** doublings
            out[i] = min(float(self.max_depth), out[i - 1] + max(gain, 0.0))
        return out


@dataclass
class CostModel:
    """Step seconds per budget: floor(b, contexts) x the median of the last measured / floor.

    Steps arrive with their CUDA-graph capture time already taken out (spec/decoder.py,
    `timed_capture`); a budget's first step is still not observed (its eager first runs of
    new shapes, Triton compiles outside a capture), and the median of the last `window`
    ratios shrugs off later one-offs. So the controller runs a budget's first step twice and
    probes every unpriced budget (on the H200, 2026-12-02/03, auto otherwise priced 7-31 off
    63's ratio and held 63-127 on the shipped pair, 0.89x spec off where pinned 32 ran 1.51x;
    pricing only unpriced neighbours of one-step probes did not help: 1.39x vs 1.76x)."""

    candidates: tuple[int, ...]
    floor: FloorFn
    window: int = 5
    history: list[deque] = field(default_factory=list)
    seen: set = field(default_factory=set)

    def __post_init__(self):
        self.history = [deque(maxlen=self.window) for _ in self.candidates]

    @property
    def ratios(self) -> list[float | None]:
        return [statistics.median(h) if h else None for h in self.history]

    def observe(self, budget: int, contexts: Sequence[int], seconds: float) -> None:
        if budget not in self.seen:
            self.seen.add(budget)  # its first step: first runs of new shapes, not its cost
            return
        i = self.candidates.index(budget)
        self.history[i].append(seconds / max(self.floor(budget, contexts), 1e-12))

    def ratio(self, i: int) -> float:
        ratios = self.ratios
        if ratios[i] is not None:
            return ratios[i]
        known = [j for j, r in enumerate(ratios) if r is not None]
        if not known:
            return 1.0
        near = min(known, key=lambda j: (abs(math.log2(self.candidates[j] / self.candidates[i])), -j))
        return ratios[near]

    def predict(self, budget: int, contexts: Sequence[int]) -> float:
        """Seconds a step at `budget`. A budget with no sample of its own borrows a ratio,
        and is never priced below a smaller priced budget: a wider tree does not verify
        faster (H200, 2026-12-03: 63 borrowed 127's ratio, was priced under 15's measured
        time, and auto ran 4 of a short request's 19 steps at 63 and 127)."""
        i = self.candidates.index(budget)
        seconds = self.ratio(i) * self.floor(budget, contexts)
        if not self.history[i]:
            below = [self.ratios[j] * self.floor(self.candidates[j], contexts)
                     for j in range(i) if self.history[j]]
            seconds = max([seconds, *below])
        return seconds


class BudgetController:
    """Picks the step's budget; `observe` feeds it each step's time and walk."""

    def __init__(self, floor: FloorFn, max_depth: int, candidates: Sequence[int] = CANDIDATES,
                 every: int = 16, probe_every: int = 4, decay: float = 0.98, window: int = 5):
        cands = tuple(sorted(set(int(c) for c in candidates)))
        if not cands or cands[0] < 1:
            raise ValueError(f"budget candidates must be positive ints, got {candidates!r}")
        self.candidates = cands
        self.acceptance = AcceptanceProfile(cands, max_depth, decay)
        self.cost = CostModel(cands, floor, window)
        self.every, self.probe_every = max(1, every), max(1, probe_every)
        self.choice = cands[0]  # cheapest first: measures A for itself, probes above
        self.steps = 0
        self.evaluations = 0
        self.probes = 0
        self.history: list[int] = []  # the choice after each re-evaluation
        self._hold: int | None = None  # a budget to run once more (its first step was no sample)
        self.last_budget: int | None = None  # the budget budget_for last returned (probes included)

    @property
    def max_budget(self) -> int:
        return self.candidates[-1]

    def budget_for(self, contexts: Sequence[int]) -> int:
        """The budget of the next step. At steps 1, 2, 3, 5, 9 and then every `every` steps:
        re-evaluate, then maybe probe."""
        self.last_budget = self._next_budget(contexts)
        return self.last_budget

    def _next_budget(self, contexts: Sequence[int]) -> int:
        self.steps += 1
        if self._hold is not None:
            held, self._hold = self._hold, None
            return held
        k = self.steps - 1
        if k % self.every and not (k < self.every and k & (k - 1) == 0):
            return self.choice
        self.choice = self.best(contexts)
        self.evaluations += 1
        self.history.append(self.choice)
        budget = self._probe() or self.choice
        if budget not in self.cost.seen:
            # A budget's first step is no cost sample (CostModel.observe): a one-step probe
            # or a choice replaced at the next evaluation would leave it priced off another
            # budget's ratio for good (H200, 2026-12-03: 7-31 never got a sample and auto
            # held 127 on the shipped pair at 1.54 ms a step where 15 ran 1.27 ms).
            self._hold = budget
        return budget

    def _probe(self) -> int | None:
        """A step off the choice, to measure what the model can only guess: at the largest
        candidate while any candidate's acceptance is unknown (one such step measures them
        all), else every `probe_every` evaluations the nearest candidate with no cost sample
        of its own (a borrowed ratio misprices a launch-bound step: the floor says 31 and
        127 cost the same where the GPU says otherwise), and once all are priced a neighbour
        of the choice, alternately above (acceptance, cost) and below (cost), so a misshapen
        floor is corrected too."""
        if any(self.acceptance.measured(i) is None for i in range(len(self.candidates))):
            return self.max_budget
        if self.evaluations % self.probe_every:
            return None
        i = self.candidates.index(self.choice)
        self.probes += 1
        unpriced = [j for j in range(len(self.candidates)) if j != i and not self.cost.history[j]]
        if unpriced:  # a budget whose cost is only borrowed from another's: measure the nearest
            return self.candidates[min(unpriced, key=lambda j: (abs(j - i), j))]
        up = self.probes % 2 == 1
        j = i + 1 if (up and i + 1 < len(self.candidates)) or i == 0 else i - 1
        return self.candidates[j] if 0 <= j < len(self.candidates) and j != i else None

    def throughput(self, contexts: Sequence[int]) -> list[float | None]:
        """Predicted committed tokens per second per candidate (None: no acceptance data)."""
        acc = self.acceptance.expected()
        return [None if a is None else (1.0 + a) / self.cost.predict(b, contexts)
                for b, a in zip(self.candidates, acc, strict=True)]

    def best(self, contexts: Sequence[int]) -> int:
        tps = self.throughput(contexts)
        scored = [(b, t) for b, t in zip(self.candidates, tps, strict=True) if t is not None]
        if not scored:
            return self.choice
        top = max(t for _, t in scored)
        return min(b for b, t in scored if t >= top * (1 - 1e-9))  # a tie (to rounding): the smaller tree

    def summary(self, contexts: Sequence[int]) -> dict:
        """The controller's view at these contexts (for the sweep, the doctor, logs)."""
        tps = self.throughput(contexts)
        acc = self.acceptance.expected()
        return {
            "choice": self.choice, "steps": self.steps, "evaluations": self.evaluations,
            "history": list(self.history),
            "candidates": {
                b: {"accepted": a, "measured": self.acceptance.measured(i) is not None,
                    "step_s": self.cost.predict(b, contexts), "ratio": self.cost.ratios[i],
                    "tok_s": t}
                for i, (b, a, t) in enumerate(zip(self.candidates, acc, tps, strict=True))
            },
        }

    def observe(self, budget: int, contexts: Sequence[int], seconds: float | None,
                accepted_by_candidate: Sequence[Sequence[float]]) -> None:
        """One step at `budget` over `contexts` took `seconds` (None: a step that captured
        CUDA graphs, whose time is not the budget's cost); accepted_by_candidate[r][i] is
        what request r would have accepted under candidate i (only i with b_i <= budget
        are observed)."""
        if budget in self.candidates and seconds is not None:
            self.cost.observe(budget, contexts, seconds)
        for row in accepted_by_candidate:
            self.acceptance.observe([a if b <= budget else None
                                     for b, a in zip(self.candidates, row, strict=True)])


_BOUNDS: dict = {}  # (candidates, device) -> the candidates as a device tensor, made once


def candidate_bounds(candidates: Sequence[int], device):
    """The candidates as a [C] long tensor on `device`, made once: the walk's `candidates`
    (spec/verify.py), for which it counts each request's drafts accepted among nodes 1..b, per
    candidate b. Node numbers are score ranks, so that is what a tree of budget b would have
    accepted (see the module docstring). Made once: a tensor made from a list each step is a
    pageable host-to-device copy, which waits for the stream (a likely part of the ~0.45 ms a
    step by which auto at budget 16 trailed a pinned budget 16 on the H200, 2026-12-02)."""
    import torch

    key = (tuple(candidates), device)
    bounds = _BOUNDS.get(key)
    if bounds is None:
        bounds = _BOUNDS[key] = torch.tensor(list(candidates), dtype=torch.long, device=device)
    return bounds


@dataclass
class FloorCost:
    """floor(b, contexts) from `bench/floors.py` for the built model and drafter.

    Attention is linear in the summed context; the target's weights are those B*(b+1)
    rows touch (routed experts expected to be touched by uniform routing, the floor's own
    assumption); the drafter's part is per request at the mean context. Per-(b, batch)
    weight parts are cached: the parameters are walked once per shape.
    """

    model: object
    drafter: object
    ceilings: object
    _weights: dict = field(default_factory=dict)
    _drafter: dict = field(default_factory=dict)

    def __call__(self, budget: int, contexts: Sequence[int]) -> float:
        from treeflash.bench import floors

        batch, rows = len(contexts), budget + 1
        layers = len(self.model.model.layers)
        attn = floors.attention_part(self.model, sum(contexts), rows).scaled(layers)
        key = (budget, batch)
        if key not in self._weights:
            self._weights[key] = self._weight_part(batch * rows)
        mean_ctx = sum(contexts) // max(batch, 1)
        bucket = -(-mean_ctx // 256) * 256  # the drafter's part walks its parameters: per 256 tokens
        if bucket not in self._drafter:
            if len(self._drafter) > 4096:
                self._drafter.clear()
            self._drafter[bucket] = floors.drafter_part(self.drafter, bucket, 1.0)
        drafter = self._drafter[bucket].scaled(batch)
        c = self.ceilings
        return c.floor_s(attn.bytes, attn.flops) + c.floor_s(*self._weights[key]) + c.floor_s(
            drafter.bytes, drafter.flops)

    def _weight_part(self, rows: int) -> tuple[float, float]:
        from treeflash.bench import floors

        part = floors.head_part(self.model, rows)
        for layer in self.model.model.layers:
            part = part + floors.layer_weight_part(layer, rows, _touched(layer, rows))
        return part.bytes, part.flops


def _touched(layer, rows: int) -> float | None:
    """Expected distinct local experts hit by `rows` rows routing top-k of E uniformly."""
    mlp = layer.mlp
    if not hasattr(mlp, "routed_weights"):
        return None
    cfg = mlp.gate.cfg
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    local = mlp.routed_weights()[0].shape[0]
    return local * (1.0 - (1.0 - k / e) ** rows)
