"""What the tree sizing learns from each speculative step's one copy, absorbed in batches.

A step's copy carries, for every request of its tree group, the depth and path score of each
node the tree builder kept (nodes 1..M, rank order) and the walk's path. Only the first
`verified` nodes were verified (a scoring step builds the widest bucket's tree and verifies a
prefix of it: DDTree's tree of b nodes is the first b nodes of any bigger one). The decoder
hands each step's arrays over as a `WalkRecord`; the sizing keeps them and absorbs them when it
next decides (speculative/budget.py), in one vectorised pass over all steps since: per-step Python on
the host is what the shipped pair's 0.4-0.6 ms steps cannot hide (the first GPU run,
results/h100-20261207-spec-cost: auto's steps 0.6-0.9 ms against fixed 15's 0.51 ms).

From the verified nodes the calibration table learns P(accepted | depth, score)
(speculative/calibration.py). From every built node it predicts each bucket's expected accepted drafts
(the cumulative calibrated acceptance of the first b nodes), so buckets wider than the verified
tree are predicted from the drafter's own scores, never probed by verifying them. Per request
it keeps a smoothed prediction per bucket (`curve`) and decayed sums of what the walks accepted
and what was predicted for the same verified buckets: their ratio corrects a drafter confident
and wrong on this request (whatever the table says for the others).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from treeflash.speculative.calibration import DepthCalibration

SMOOTHING = 0.5  # weight of an absorb's new predictions in a request's curve
REQUEST_DECAY = 0.8  # a request's accepted / predicted sums, per step: a memory of ~5 steps
KAPPA = 0.25  # pseudo-count pulling a request's accepted / predicted ratio to 1 before data
PROFILE_DECAY = 0.98  # the engine-wide mean gain per bucket, per request-absorb


@dataclass
class RequestSizing:
    """One request's view, per bucket: its smoothed predicted gain (nan: never scored that wide)
    and the decayed sums of what its walks accepted and what was predicted for the same trees."""

    curve: np.ndarray
    actual: np.ndarray
    predicted: np.ndarray
    steps: int = 0  # tree steps absorbed
    off: bool = False  # its last step was plain
    # its latest walk took a path as deep as the verified tree went (and shallower than the
    # drafter's depth): deeper nodes might have been taken too, which no verified node can show
    saturated: bool = False
    widened: bool = False  # a wide (scoring) build has covered it
    last_budget: int = 0

    @staticmethod
    def fresh(buckets: int) -> RequestSizing:
        return RequestSizing(np.full(buckets, np.nan), np.zeros(buckets), np.zeros(buckets))

    @property
    def scored(self) -> bool:
        return not bool(np.isnan(self.curve).all())


@dataclass
class WalkRecord:
    """One speculative step of `states` (its tree group, batch order): depths / scores [B, M] of
    built nodes 1..M (rank order), path [B, W] the walk's accepted node per depth (root first, 0
    pads), nodes 1..verified verified."""

    states: list
    depths: np.ndarray
    scores: np.ndarray
    path: np.ndarray
    verified: int


@dataclass
class Learner:
    """The calibration table, the engine-wide profile and the records not absorbed yet."""

    buckets: tuple[int, ...]
    max_depth: int
    calibration: DepthCalibration = field(init=False)
    profile: np.ndarray = field(init=False)  # [2, buckets]: decayed sum of gains, weight
    pending: list[WalkRecord] = field(default_factory=list)
    absorbed: int = 0  # records absorbed so far

    def __post_init__(self):
        self.calibration = DepthCalibration(self.max_depth)
        self.profile = np.zeros((2, len(self.buckets)))
        self._b = np.array(self.buckets)
        self._cols = self._b - 1
        # each node's bucket segment: nodes cols[k-1] + 1 .. cols[k] are segment k (path_bounded)
        self._segment = np.searchsorted(self._cols, np.arange(self.buckets[-1]))
        # the last absorb's states, their gains and which of them are scored (`gains`)
        self._fresh: tuple[list, np.ndarray, np.ndarray] | None = None
        self._node = np.arange(self.buckets[-1])
        self._age_weights: dict[int, np.ndarray] = {}  # records absorbed at once -> `_age_weight`

    def absorb(self) -> list:
        """Learn from every pending record; returns the states they touched."""
        records, self.pending = self.pending, []
        if not records:
            return []
        depths, scores, width, seen, taken, rec = _stack(records, self.buckets[-1])
        cal = self.calibration
        cells = cal.cells(depths, scores)  # once: observe and predict share it
        deepest = self._observe(records, cells, depths, seen, taken)
        p = cal.predict_cells(cells)  # (a node not built: its cell is one of depth 0's)
        if min(r.depths.shape[1] for r in records) < len(self._node):
            p = np.where(self._node < width[:, None], p, 0.0)
        act = np.cumsum(taken, 1)[:, self._cols]  # [R, buckets] accepted drafts among each bucket's nodes
        states, owner = _owners(records)
        self._update_states(states, owner, self._sums(p, depths, act, width, seen, self._age_weight(len(records))[rec]))
        for u, n, d in zip(owner.tolist(), act[:, -1].tolist(), deepest.tolist(), strict=True):
            states[u].saturated = n >= d and 0 < d < self.max_depth  # rows oldest first: the newest stays
        g = self._fresh[1]
        self.profile *= PROFILE_DECAY ** len(states)
        self.profile[0] += g.sum(0)
        self.profile[1] += len(states)
        self.absorbed += len(records)
        return states

    def _observe(self, records, cells, depths, seen, taken) -> np.ndarray:
        """The calibration counts the verified nodes; returns each row's verified tree's depth [R].
        The steps of a held decision all verify its budget: their first nodes, by slicing."""
        steps = len(records)
        counts = {r.verified for r in records}
        if len(counts) == 1:
            v = counts.pop()
            self.calibration.observe_cells(cells[:, :v].ravel(), taken[:, :v].ravel(), steps=steps)
            return depths[:, :v].max(1) if v else np.zeros(len(depths), dtype=np.int64)
        verified = self._node < seen[:, None]
        self.calibration.observe_cells(cells[verified], taken[verified], steps=steps)
        return np.where(verified, depths, 0).max(1)

    def gains(self, states) -> tuple[np.ndarray, np.ndarray]:
        """`gains_of(states)` and which states are scored ([n] bool), reusing the last absorb's
        when it was of these very states (in this order): a decision absorbs, then prices the
        same batch, and only an absorb changes them."""
        fresh = self._fresh
        if fresh is not None and len(fresh[0]) == len(states) and all(
                a is b for a, b in zip(fresh[0], states, strict=True)):
            return fresh[1].copy(), fresh[2]
        return gains_of(states, self.max_depth), np.array([s.scored for s in states], dtype=bool)

    def _sums(self, p, depths, act, width, seen, weight) -> np.ndarray:
        """[R, 4, buckets] what each row adds to its request: the prediction and 1 per bucket its
        build covered, the accepted drafts and the prediction, times the row's `weight` (its
        age's decay), per bucket its walk verified; 0 elsewhere."""
        sums = np.empty((len(p), 4, len(self.buckets)))
        pred = path_bounded(p, depths, self._segment, self.max_depth)
        built = self._b <= width[:, None]
        checked = weight[:, None] * (self._b <= seen[:, None])
        np.multiply(pred, built, out=sums[:, 0])
        sums[:, 1] = built
        np.multiply(act, checked, out=sums[:, 2])
        np.multiply(pred, checked, out=sums[:, 3])
        return sums

    def _age_weight(self, steps: int) -> np.ndarray:
        """[steps] the decay of each of `steps` records' rows by age: the newest weighs 1."""
        w = self._age_weights.get(steps)
        if w is None:
            w = self._age_weights[steps] = REQUEST_DECAY ** np.arange(steps - 1, -1, -1, dtype=np.float64)
        return w

    def _update_states(self, states, owner, sums) -> None:
        """Each request's curve, accepted and predicted sums from its rows' `sums`; the gains of
        the new values are kept for the decision (`gains`). A few requests (a batch of one) row
        by row in Python floats, the same operations: numpy calls on [1, 6] arrays cost more
        than their arithmetic."""
        n = len(states)
        total = _sum_by(sums, owner, n)  # [n, 4, nb]: prediction and count, accepted and predicted
        steps = np.bincount(owner, minlength=n)
        keep = REQUEST_DECAY ** steps
        if n > FEW_ROWS:
            return self._update_many(states, total, steps, keep)
        cap, rows, scored = float(self.max_depth), [], []
        for st, (tot, cnt, acc, prd), k, m in zip(states, total.tolist(), keep.tolist(), steps.tolist(), strict=True):
            curve = [(t / c if old != old else SMOOTHING * (t / c) + (1 - SMOOTHING) * old) if c > 0 else old
                     for old, t, c in zip(st.curve.tolist(), tot, cnt, strict=True)]
            actual = [k * a + x for a, x in zip(st.actual.tolist(), acc, strict=True)]
            predicted = [k * a + x for a, x in zip(st.predicted.tolist(), prd, strict=True)]
            st.curve, st.actual, st.predicted = np.array(curve), np.array(actual), np.array(predicted)
            st.steps += m
            rows.append(_gains_row(curve, actual, predicted, cap))
            scored.append(not all(map(math.isnan, curve)))
        self._fresh = (states, np.array(rows).reshape(n, len(self.buckets)), np.array(scored, dtype=bool))

    def _update_many(self, states, total, steps, keep) -> None:
        """`_update_states` of many requests, as arrays."""
        n, nb = len(states), len(self.buckets)
        new = total[:, 1] > 0
        mean = np.divide(total[:, 0], total[:, 1], out=np.zeros((n, nb)), where=new)
        old = np.array([(st.curve, st.actual, st.predicted) for st in states])  # [n, 3, nb]
        curve = np.where(new, np.where(np.isnan(old[:, 0]), mean, SMOOTHING * mean + (1 - SMOOTHING) * old[:, 0]),
                         old[:, 0])
        sums_of = keep[:, None, None] * old[:, 1:] + total[:, 2:]  # actual, predicted
        actual, predicted = sums_of[:, 0], sums_of[:, 1]
        for u, st in enumerate(states):
            st.curve, st.actual, st.predicted = curve[u], actual[u], predicted[u]
            st.steps += int(steps[u])
        self._fresh = (states, _gains(curve, actual, predicted, self.max_depth), ~np.isnan(curve).all(1))

    def typical(self) -> np.ndarray | None:
        """The engine-wide mean gain per bucket (a request without scores of its own), None before any."""
        if self.profile[1, 0] <= 0:
            return None
        return self.profile[0] / self.profile[1]


def gains_of(states, max_depth: int) -> np.ndarray:
    """[n, buckets] expected accepted drafts of each request's next tree at each bucket: its
    curve (calibrated predictions from its latest scores) times its accepted / predicted ratio
    at that bucket (above its widest verified bucket: that one's ratio), flat above its widest
    scored bucket (no optimism: a wider tree is predicted only from scores), non-decreasing,
    capped at the drafter's depth; 0 where nothing is known."""
    return _gains(np.stack([s.curve for s in states]), np.stack([s.actual for s in states]),
                  np.stack([s.predicted for s in states]), max_depth)


def _gains(curve: np.ndarray, actual: np.ndarray, predicted: np.ndarray, max_depth: int) -> np.ndarray:
    """`gains_of` of requests' curve, actual and predicted [n, buckets]; a few requests row by
    row in Python floats (the same operations: a decision's numpy calls on [1, 6] arrays cost
    more than their arithmetic)."""
    if len(curve) > FEW_ROWS:
        seen = predicted > 0
        ratio = np.where(seen, (actual + KAPPA) / (predicted + KAPPA), np.nan)
        ratio = _ffill(ratio, 1.0)
        g = _ffill(curve * ratio, 0.0)
        return np.minimum(np.maximum.accumulate(g, axis=1), float(max_depth))
    cap = float(max_depth)
    rows = [_gains_row(*row, cap) for row in zip(curve.tolist(), actual.tolist(), predicted.tolist(), strict=True)]
    return np.array(rows).reshape(curve.shape)


def _gains_row(curve: list, actual: list, predicted: list, cap: float) -> list:
    """`_gains` of one request in Python floats."""
    ratio, g, top, row = 1.0, 0.0, -np.inf, []
    for c, a, p in zip(curve, actual, predicted, strict=True):
        r = (a + KAPPA) / (p + KAPPA) if p > 0 else np.nan
        if r == r:  # a verified bucket's ratio; else the last one to its left's (1 before any)
            ratio = r
        x = c * ratio
        if x == x:  # a scored bucket's gain; else the last one to its left's (0 before any)
            g = x
        if g > top or not row:
            top = g
        row.append(min(top, cap))
    return row


FEW_ROWS = 8  # `_gains` and `_update_states` of up to this many requests in Python floats


def path_bounded(p: np.ndarray, depths: np.ndarray, segment: np.ndarray, max_depth: int) -> np.ndarray:
    """[R, S] expected accepted drafts of each row's tree cut at the end of each node segment
    (segment [M]: node m's, non-decreasing from 0; a bucket b's cut is its first b nodes):
    per depth, the sum of its nodes' calibrated acceptance p [R, M], capped at 1 and at the
    depth above's (the walk takes at most one node a depth, and a node only below a taken one).
    Calibration learns a depth only from verified nodes: with depth 1 never accepted, the
    unverified deeper nodes of a wide build kept the prior's ~1 and a one-node probe predicted
    0.7 drafts at budget 3, 1.2 at 7, at acceptance 0 (tests/bench/test_sweep_auto_extrapolated.py).
    One bincount of the nodes per (row, segment, depth) and a cumulative sum over the segments:
    an [R, M, depth] one-hot summed over nodes was a sixth of a decision's host time."""
    r, m = p.shape
    s, d = int(segment[-1]) + 1, max_depth + 1
    key = (r, m, d, segment.tobytes())
    base = _CELLS.get(key)
    if base is None:
        if len(_CELLS) > 64:  # row counts seen: as many as the batch sizes and records between decisions
            _CELLS.clear()
        base = _CELLS[key] = (segment[:m] * r + np.arange(r)[:, None]) * d  # [R, M]: (segment, row, depth 0)
    cell = np.minimum(depths, max_depth) + base  # (node depths are >= 0)
    per = np.bincount(cell.ravel(), weights=p.ravel(), minlength=s * r * d).reshape(s, r, d)
    by_depth = np.cumsum(per, 0)[:, :, 1:]  # [S, R, D]: depths 1..D of each cut
    return np.minimum.accumulate(np.minimum(by_depth, 1.0), axis=2).sum(2).T


_CELLS: dict = {}  # (rows, nodes, depths, segments) -> path_bounded's [R, M] cell of each node at depth 0


def _ffill(x: np.ndarray, first: float) -> np.ndarray:
    """Each nan replaced by the last non-nan value to its left in its row (`first` if none)."""
    out, nan = x.copy(), np.isnan(x)
    np.copyto(out[:, 0], first, where=nan[:, 0])
    for c in range(1, x.shape[1]):  # a column at a time: a few buckets, any number of rows
        np.copyto(out[:, c], out[:, c - 1], where=nan[:, c])
    return out


def _stack(records: list[WalkRecord], width: int):
    """All records' rows padded to `width` nodes: depths, scores and taken [R, width], each
    row's built and verified node counts [R] and record index [R]. Records of one width (a held
    decision's steps) are concatenated, not copied row block by row block."""
    counts = [len(r.states) for r in records]
    widths = [r.depths.shape[1] for r in records]
    one = len(counts) == sum(counts)  # a request a record (the batch of one)
    rec = np.arange(len(records)) if one else np.repeat(np.arange(len(records)), counts)
    if all(m == width for m in widths):
        depths = np.concatenate([r.depths for r in records]).astype(np.int64, copy=False)
        scores = np.concatenate([r.scores for r in records]).astype(np.float32, copy=False)
    else:
        rows = len(rec)
        depths = np.zeros((rows, width), dtype=np.int64)
        scores = np.full((rows, width), -np.inf, dtype=np.float32)
        r0 = 0
        for r, b, m in zip(records, counts, widths, strict=True):
            depths[r0:r0 + b, :m], scores[r0:r0 + b, :m] = r.depths, r.scores
            r0 += b
    pw = max(r.path.shape[1] for r in records)
    paths = np.concatenate([r.path if r.path.shape[1] == pw else
                            np.pad(r.path, ((0, 0), (0, pw - r.path.shape[1]))) for r in records])
    t = np.zeros((len(rec), width + 1), dtype=bool)
    t[np.arange(len(rec))[:, None], paths] = True  # (pads point at the root, column 0)
    seen = [r.verified for r in records]
    if one:
        return depths, scores, np.array(widths), np.array(seen), t[:, 1:], rec
    return depths, scores, np.array(widths)[rec], np.array(seen)[rec], t[:, 1:], rec


def _sum_by(rows: np.ndarray, owner: np.ndarray, n: int) -> np.ndarray:
    """[n, ...] the sums of rows [R, ...] by owner [R] (in row order, as np.add.at adds them)."""
    if n == 1:
        return rows.sum(0, keepdims=True)
    out = np.zeros((n,) + rows.shape[1:])
    np.add.at(out, owner, rows)
    return out


def _owners(records: list[WalkRecord]) -> tuple[list, np.ndarray]:
    """The distinct states of the records (first-seen order) and each row's index among them."""
    index: dict[int, int] = {}
    states, owner = [], []
    for r in records:
        for s in r.states:
            u = index.get(id(s))
            if u is None:
                u = index[id(s)] = len(states)
                states.append(s)
            owner.append(u)
    return states, np.array(owner, dtype=np.int64)
