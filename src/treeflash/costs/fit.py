"""The prediction the tree sizing prices each budget with (`StepCostModel`): the floor's parts
with whole 64-row tiles and the distinct experts the router's counts measured (`ExpertTouch`),
fitted online to the step times the engine measures."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from treeflash.costs.ceilings import Ceilings
from treeflash.costs.floor import ModelCosts, MoESizes, distinct_experts


@dataclass
class ExpertTouch:
    """Distinct routed experts per MoE layer that T rows touch, from the router's counts.

    Real routing is not uniform (a batch's rows share experts), so E (1 - (1 - k/E)^T) is an
    upper estimate; each measurement keeps a decayed ratio measured / uniform for its T, and a
    T never measured borrows the ratio of the nearest measured T (log scale), 1.0 before any."""

    decay: float = 0.9
    ratios: dict[int, list[float]] = field(default_factory=dict)  # rows -> [weighted sum, weight]

    def observe(self, rows: int, touched_per_layer: Sequence[float], sizes: Sequence[MoESizes]) -> None:
        """touched_per_layer: distinct experts (of all E, the router's counts) per MoE layer."""
        if rows < 1 or not touched_per_layer or len(touched_per_layer) != len(sizes):
            return
        expected = sum(distinct_experts(rows, m.k, m.experts) for m in sizes)
        if expected <= 0:
            return
        ratio = min(1.5, sum(touched_per_layer) / expected)
        s = self.ratios.setdefault(rows, [0.0, 0.0])
        s[0] = self.decay * s[0] + ratio
        s[1] = self.decay * s[1] + 1.0

    def ratio(self, rows: float) -> float:
        if not self.ratios:
            return 1.0
        near = min(self.ratios, key=lambda r: (abs(math.log2(r / max(rows, 1e-9))), r))
        s = self.ratios[near]
        return s[0] / s[1]

    def __call__(self, rows: float, m: MoESizes) -> float:
        return self.ratio(rows) * m.local * distinct_experts(rows, m.k, m.experts) / m.experts


# ---- the online fit -------------------------------------------------------------------------
@dataclass
class StepShape:
    """One engine step as the cost model sees it: requests decoded plainly, and requests
    verifying trees of `budget` nodes (budget 0: none)."""

    plain: tuple[int, ...]  # contexts of the plain requests
    spec: tuple[int, ...]  # contexts of the speculative ones
    budget: int

    @property
    def key(self) -> int:
        """The residual's key: the budget, 0 for a plain step."""
        return self.budget if self.spec else 0


OUTLIER = 4.0  # a step this many times its budget's median recent step is not a sample ...
OUTLIER_RUN = 3  # ... unless it is the third such in a row


class StepCostModel:
    """Seconds of a step = (F_plain [plain rows] + F_spec [a tree] + rho x floor parts) x the
    step's budget residual.

    floor parts: `ModelCosts.parts` with whole tiles and the measured distinct experts; F and
    rho: a least-squares fit of relative errors (as if each step were measured to ~10%) over the
    last `window` measured steps, with priors rho ~ 1 +- 0.5 (so steps whose floor is a sliver
    of their time, launch-bound ones, leave rho at 1 and split into F = measured - floor: they
    cost the same at every budget; bandwidth-bound ones fit rho) and F_plain ~ F_spec (a kind
    never measured costs what the other's fixed part costs: a plain step is the verify forward
    without the drafter, and pricing it at its floor alone would turn every request off); the
    residual: the median measured / fitted of that budget's last 5 steps (1.0 before any).
    A budget's first step is no sample (its eager first runs, compiles outside a capture).
    The sizing prices every candidate every step on the host, between the step's queued work
    and its one read: the fit is redone after every sample while there are few, then every
    REFIT_EVERY samples (a budget's first samples count at once), and predictions are cached by
    (requests, summed context to ~1.5%, budget) per group until then."""

    REFIT_EVERY = 8

    def __init__(self, costs: ModelCosts, ceilings: Ceilings, window: int = 64, rho_sigma: float = 0.5,
                 rel_sigma: float = 0.1):
        self.costs, self.ceilings = costs, ceilings
        self.touch = ExpertTouch()
        self.samples: deque = deque(maxlen=window)  # (has_plain, has_spec, floor_s, seconds)
        self.residuals: dict[int, deque] = {}  # budget (0: plain) -> its last 5 samples
        self._residual_ctx: dict[int, int] = {}  # budget -> the summed context of its newest sample
        self._outliers: dict[int, int] = {}  # budget -> its samples refused in a row (OUTLIER)
        self.observed = 0  # samples taken, every budget
        self._sampled_at: dict[int, int] = {}  # budget -> `observed` at its newest sample
        self.seen: set[int] = set()
        self.rho_weight = (rel_sigma / rho_sigma) ** 2  # the prior's weight in relative-error units
        self._theta: tuple[float, float, float] | None = None
        self._floors: dict[tuple, float] = {}  # floor_parts_s by shape (contexts to ~1.5%)
        self._residual: dict[int, float] = {}  # residual(key) under the current fit
        self._preds: dict[tuple, float] = {}  # predict() by shape, until the next refit
        self._dirty = 0  # samples since the last fit

    def floor_parts_s(self, shape: StepShape) -> float:
        """rho's feature: the floor of the step's groups, tiles and measured experts included."""
        return self._floor(len(shape.plain), sum(shape.plain), len(shape.spec), sum(shape.spec), shape.budget)

    def _floor(self, n_p: int, s_p: float, n_s: int, s_s: float, budget: int) -> float:
        """Cached by (requests, summed context to ~1.5%, budget) per group: the sizing prices
        every candidate every step, and contexts move by a few tokens a step."""
        key = (n_p, _q(s_p), n_s, _q(s_s), budget)
        s = self._floors.get(key)
        if s is None:
            if len(self._floors) > 4096:
                self._floors.clear()
            s = 0.0
            for rows, n, ctx in ((1, n_p, s_p), (budget + 1, n_s, s_s)):
                if n:
                    s += self.costs.floor_of(self.ceilings, rows, n, ctx, self.touch, tiles=True)
            self._floors[key] = s
        return s

    def observe_touch(self, rows: int, touched_per_layer: Sequence[float]) -> None:
        """The router's distinct experts per MoE layer for a forward of `rows` rows (the steps
        already measured keep the floors they were measured against)."""
        self.touch.observe(rows, touched_per_layer, self.costs.moe_sizes)
        self._floors.clear()
        self._preds.clear()

    def observe(self, shape: StepShape, seconds: float) -> None:
        key = shape.key
        if key not in self.seen:
            self.seen.add(key)
            return
        sample = (bool(shape.plain), bool(shape.spec), self.floor_parts_s(shape), seconds)
        own = self.residuals.setdefault(key, deque(maxlen=5))
        ctx, last = sum(shape.plain) + sum(shape.spec), self._residual_ctx.get(key)
        if own and last is not None and not 0.5 <= (ctx + 1) / (last + 1) <= 2.0:
            # at twice or half the context of the budget's last sample, its older samples price
            # another regime (a launch-bound residual is no ratio of the floor's): the H100 run at
            # 5ce2afd priced budget 3 at 30k from its steps at 1k and held 31, 0.76x budget 3
            own.clear()
            self._residual.pop(key, None)
            self._preds.clear()
        self._residual_ctx[key] = ctx
        if len(own) >= 2 and seconds > OUTLIER * statistics.median(s[3] for s in own):
            # a compile, an allocation, a page-table capture inside the step: no price of the budget
            # (the H100 run at 5ce2afd: one 1589 ms step among 5 ms ones at acceptance 3 led auto to
            # 14 plain steps); OUTLIER_RUN in a row are a new regime, priced afresh
            self._outliers[key] = self._outliers.get(key, 0) + 1
            if self._outliers[key] < OUTLIER_RUN:
                return
            own.clear()
            self._residual.pop(key, None)
            self._preds.clear()
        self._outliers[key] = 0
        self.samples.append(sample)
        own.append(sample)
        self.observed += 1
        self._sampled_at[key] = self.observed
        self._dirty += 1
        if self._theta is None or self._dirty >= (1 if len(self.samples) < 16 else self.REFIT_EVERY):
            self._theta, self._dirty = None, 0
            self._residual.clear()
            self._preds.clear()
        elif len(own) <= 3:  # a budget's first samples: priced by them at once
            self._residual.pop(key, None)
            self._preds.clear()

    @property
    def theta(self) -> tuple[float, float, float]:
        """(F_plain, F_spec, rho), refitted after new samples."""
        if self._theta is None:
            self._theta = self._fit()
        return self._theta

    def _fit(self) -> tuple[float, float, float]:
        # normal equations of sum_i ((y_i - a_i . theta) / y_i)^2 + prior, theta = (F_p, F_s, rho)
        a = [[0.0] * 3 for _ in range(3)]
        b = [0.0] * 3
        ref = statistics.median(s[3] for s in self.samples) if self.samples else 1.0
        for has_p, has_s, floor, y in self.samples:
            x = (float(has_p), float(has_s), floor)
            w = 1.0 / max(y, 1e-12) ** 2
            for i in range(3):
                b[i] += w * x[i] * y
                for j in range(3):
                    a[i][j] += w * x[i] * x[j]
        lam_f = 1e-4 / ref**2  # F: nearly free, defined (0) before any step
        lam_c = 0.5 / ref**2  # F_plain ~ F_spec: half a step's weight, data of both kinds outweighs it
        a[0][0] += lam_f + lam_c
        a[1][1] += lam_f + lam_c
        a[0][1] -= lam_c
        a[1][0] -= lam_c
        a[2][2] += self.rho_weight
        b[2] += self.rho_weight
        f_p, f_s, rho = _solve3(a, b)
        return max(f_p, 0.0), max(f_s, 0.0), max(rho, 0.05)

    def _fitted(self, has_plain: bool, has_spec: bool, floor: float) -> float:
        f_p, f_s, rho = self.theta
        return f_p * has_plain + f_s * has_spec + rho * floor

    def residual(self, key: int) -> float:
        """Median measured / fitted of the budget's last steps (under the current fit), 1.0 before any."""
        r = self._residual.get(key)
        if r is None:
            samples = self.residuals.get(key)
            r = statistics.median(y / max(self._fitted(p, q, f), 1e-12) for p, q, f, y in samples) if samples else 1.0
            self._residual[key] = r
        return r

    def _linear(self, n_p: int, s_p: float, n_s: int, s_s: float, budget: int) -> float:
        floor = self._floor(n_p, s_p, n_s, s_s, budget)
        return self._fitted(n_p > 0, n_s > 0, floor) * self.residual(budget if n_s else 0)

    def predict(self, shape: StepShape) -> float:
        """Seconds of a step of this shape. A step with a tree is never priced below the same
        requests' plain step, nor below a smaller budget's step, where those were measured (a
        wider tree does not verify faster: what measured otherwise was noise, or a borrowed
        ratio, which on the H200, 2026-12-03, priced 63 under 15's measured time)."""
        return self.predict_of(len(shape.plain), sum(shape.plain), len(shape.spec), sum(shape.spec), shape.budget)

    def predict_of(self, n_p: int, s_p: float, n_s: int, s_s: float, budget: int) -> float:
        """predict() of n_p plain requests whose contexts sum to s_p and n_s with trees of `budget`
        nodes whose contexts sum to s_s."""
        key = (n_p, _q(s_p), n_s, _q(s_s), budget if n_s else 0)
        seconds = self._preds.get(key)
        if seconds is not None:
            return seconds
        seconds = self._linear(n_p, s_p, n_s, s_s, budget)
        if n_s:
            if self.priced(0):
                seconds = max(seconds, self._linear(n_p + n_s, s_p + s_s, 0, 0.0, 0))
            for smaller in self.residuals:
                if 0 < smaller < budget:
                    seconds = max(seconds, self._linear(n_p, s_p, n_s, s_s, smaller))
        if len(self._preds) > 4096:
            self._preds.clear()
        self._preds[key] = seconds
        return seconds

    def priced(self, key: int) -> bool:
        return bool(self.residuals.get(key))

    def age(self, key: int) -> float:
        """Samples taken (any budget) since the budget's newest one; inf if it has none."""
        at = self._sampled_at.get(key)
        return float("inf") if at is None or not self.residuals.get(key) else float(self.observed - at)


def _q(x: float) -> int:
    return int(round(64 * math.log1p(x)))


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float]:
    """a x = b for a 3x3 system (Gaussian elimination with partial pivoting)."""
    m = [row[:] + [rhs] for row, rhs in zip(a, b, strict=True)]
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-300:
            return 0.0, 0.0, 1.0
        for r in range(3):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    return tuple(m[i][3] / m[i][i] for i in range(3))
