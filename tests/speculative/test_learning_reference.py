"""The tree sizing's learning (speculative/learning.py, speculative/calibration.py) against a
straightforward implementation kept here: absorb's vectorised passes (bincount path bounds, flat
table cells, the refit of only the rising depths, gains in Python floats for a few requests) must
give what the per-node formulas give, to float64 rounding, on random record streams."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import isotonic_regression

from treeflash.speculative import learning as L
from treeflash.speculative.budget import BUCKETS
from treeflash.speculative.calibration import EDGES, DepthCalibration, _prior

DEPTH = 7
TOL = 1e-12


def ref_path_bounded(p, depths, cols, max_depth):
    """Per cut, per depth, the sum of the depth's nodes' p over an [R, M, depth] one-hot."""
    r, m = p.shape
    per = np.zeros((r, m, max_depth + 1))
    per[np.arange(r)[:, None], np.arange(m)[None, :], np.clip(depths, 0, max_depth)] = p
    by_depth = np.cumsum(per, 1)[:, cols, 1:]
    return np.minimum.accumulate(np.minimum(by_depth, 1.0), axis=2).sum(2)


def ref_gains(states, max_depth):
    """`gains_of` written bucket by bucket for one request at a time."""
    out = np.zeros((len(states), len(BUCKETS)))
    for i, s in enumerate(states):
        ratio, g = 1.0, 0.0
        for b in range(len(BUCKETS)):
            if s.predicted[b] > 0:
                ratio = (s.actual[b] + L.KAPPA) / (s.predicted[b] + L.KAPPA)
            if not np.isnan(s.curve[b] * ratio):
                g = s.curve[b] * ratio
            out[i, b] = min(max(g, out[i, b - 1] if b else g), max_depth)
    return out


class RefLearner:
    """Learner.absorb record by record, node by node, the table refit by scipy's isotonic
    regression of every depth."""

    def __init__(self, max_depth):
        self.d, nb = max_depth, len(EDGES) + 1
        self.seen, self.acc = np.zeros((max_depth + 1, nb)), np.zeros((max_depth + 1, nb))
        self.prior = _prior(EDGES)
        self.profile = np.zeros((2, len(BUCKETS)))
        self.states: dict[int, L.RequestSizing] = {}

    def table(self):
        w = self.seen + 1.0
        raw = (self.acc + self.prior) / w
        return np.stack([isotonic_regression(raw[d], weights=w[d], increasing=False).x for d in range(self.d + 1)])

    def absorb(self, records):
        self.seen *= 0.995 ** len(records)  # the counts decay once a step, then every verified node counts
        self.acc *= 0.995 ** len(records)
        for r in records:
            for i in range(len(r.states)):
                taken = set(r.path[i].tolist()) - {0}
                for n in range(r.verified):
                    cell = r.depths[i, n], np.searchsorted(EDGES, -r.scores[i, n], side="right")
                    self.seen[cell] += 1
                    self.acc[cell] += (n + 1) in taken
        table, cols, touched = self.table(), [b - 1 for b in BUCKETS], []
        per_state: dict[int, list] = {}
        for age, r in enumerate(reversed(records)):
            for i, s in enumerate(r.states):
                m = r.depths.shape[1]
                p = np.zeros((1, BUCKETS[-1]))
                bins = np.searchsorted(EDGES, -r.scores[i], side="right")
                p[0, :m] = table[r.depths[i], bins]
                depths = np.zeros((1, BUCKETS[-1]), dtype=np.int64)
                depths[0, :m] = r.depths[i]
                pred = ref_path_bounded(p, depths, cols, self.d)[0]
                taken = np.zeros(BUCKETS[-1] + 1, dtype=bool)
                taken[r.path[i]] = True
                act = np.cumsum(taken[1:])[cols]
                per_state.setdefault(id(s), []).append((age, pred, act, m, r.verified, s))
        for r in records:
            for s in r.states:
                if id(s) not in {id(t) for t in touched}:
                    touched.append(s)
        for s in touched:
            rows = per_state[id(s)]
            total, count = np.zeros(len(BUCKETS)), np.zeros(len(BUCKETS))
            acc, prd = np.zeros(len(BUCKETS)), np.zeros(len(BUCKETS))
            for age, pred, act, m, v, _ in rows:
                for k, b in enumerate(BUCKETS):
                    if b <= m:
                        total[k] += pred[k]
                        count[k] += 1
                    if b <= v:
                        acc[k] += act[k] * L.REQUEST_DECAY ** age
                        prd[k] += pred[k] * L.REQUEST_DECAY ** age
            mean = np.where(count > 0, total / np.maximum(count, 1), 0.0)
            old = s.curve
            blend = np.where(np.isnan(old), mean, L.SMOOTHING * mean + (1 - L.SMOOTHING) * old)
            s.curve = np.where(count > 0, blend, old)
            keep = L.REQUEST_DECAY ** len(rows)
            s.actual, s.predicted = keep * s.actual + acc, keep * s.predicted + prd
            s.steps += len(rows)
        for r in records:  # the newest row's saturation stays
            for i, s in enumerate(r.states):
                taken = set(r.path[i].tolist()) - {0}
                deepest = int(r.depths[i, :r.verified].max()) if r.verified else 0
                s.saturated = len(taken) >= deepest and 0 < deepest < self.d
        g = ref_gains(touched, self.d)
        self.profile *= L.PROFILE_DECAY ** len(touched)
        self.profile[0] += g.sum(0)
        self.profile[1] += len(touched)
        return touched


def _record(g, states, width, verified):
    b = len(states)
    depths = np.sort(g.integers(1, DEPTH + 1, (b, width)), 1)
    scores = np.sort(-g.exponential(2.0, (b, width)), 1)[:, ::-1].astype(np.float32)
    path = np.zeros((b, DEPTH + 1), dtype=np.int64)
    for i in range(b):  # distinct verified nodes, a prefix of the path's depths
        k = int(g.integers(0, min(verified, DEPTH) + 1))
        path[i, 1:k + 1] = np.sort(g.choice(np.arange(1, verified + 1), k, replace=False))
    return L.WalkRecord(list(states), depths, scores, path, verified)


def _at(states, s):
    return next(i for i, t in enumerate(states) if t is s)


def test_path_bounded_is_the_one_hot_formula():
    g = np.random.default_rng(0)
    cols = np.array([b - 1 for b in BUCKETS])
    segment = np.searchsorted(cols, np.arange(BUCKETS[-1]))
    for _ in range(100):
        r = int(g.integers(1, 12))
        depths = g.integers(0, DEPTH + 3, (r, BUCKETS[-1]))  # above the drafter's depth: capped
        p = g.random((r, BUCKETS[-1])) * g.random()
        np.testing.assert_allclose(L.path_bounded(p, depths, segment, DEPTH),
                                   ref_path_bounded(p, depths, cols, DEPTH), rtol=0, atol=TOL)


@pytest.mark.parametrize("pool", [1, 3, 11])  # 11: more than FEW_ROWS, gains by numpy
def test_absorb_is_the_node_by_node_learning(pool):
    g = np.random.default_rng(pool)
    fast, ref = L.Learner(BUCKETS, DEPTH), RefLearner(DEPTH)
    mine = [L.RequestSizing.fresh(len(BUCKETS)) for _ in range(pool)]
    theirs = [L.RequestSizing.fresh(len(BUCKETS)) for _ in range(pool)]
    for _ in range(25):
        mr, tr = [], []
        for _ in range(int(g.integers(1, 6))):
            pick = g.permutation(pool)[:int(g.integers(1, pool + 1))]
            width = int(g.choice(BUCKETS))
            rec = _record(g, [mine[i] for i in pick], width, int(g.choice([b for b in BUCKETS if b <= width])))
            mr.append(rec)
            tr.append(L.WalkRecord([theirs[i] for i in pick], rec.depths, rec.scores, rec.path, rec.verified))
        fast.pending = mr
        got = fast.absorb()
        ref.absorb(tr)
        np.testing.assert_allclose(fast.calibration.table, ref.table(), rtol=0, atol=TOL)
        np.testing.assert_allclose(fast.profile, ref.profile, rtol=0, atol=TOL)
        for a, b in zip(mine, theirs, strict=True):
            for x, y in ((a.curve, b.curve), (a.actual, b.actual), (a.predicted, b.predicted)):
                np.testing.assert_allclose(x, y, rtol=0, atol=TOL)
            assert (a.steps, a.saturated) == (b.steps, b.saturated)
        np.testing.assert_allclose(fast.gains(got)[0], ref_gains([theirs[_at(mine, s)] for s in got], DEPTH),
                                   rtol=0, atol=TOL)
        np.testing.assert_allclose(fast.gains(mine)[0], ref_gains(theirs, DEPTH), rtol=0, atol=TOL)


@pytest.mark.parametrize("rising", [0, 1, 3, 6])  # up to FEW_RISING depths row by row, more at once
def test_the_refit_of_only_the_rising_depths_is_the_isotonic_regression_of_all(rising):
    g = np.random.default_rng(rising)
    cal = DepthCalibration(DEPTH)
    cal.seen = g.integers(0, 50, cal.seen.shape).astype(np.float64)
    target = np.linspace(0.9, 0.06, cal.seen.shape[1]) * g.uniform(0.5, 1.0, (DEPTH + 1, 1))  # non-increasing
    target[g.choice(DEPTH + 1, rising, replace=False), 4] = 0.99  # rises after bin 3
    cal.accepted = target * (cal.seen + 1.0) - cal.prior
    raw = (cal.accepted + cal.prior) / (cal.seen + 1.0)
    assert (raw[:, 1:] > raw[:, :-1]).any(1).sum() == rising
    want = np.stack([isotonic_regression(raw[d], weights=cal.seen[d] + 1.0, increasing=False).x
                     for d in range(DEPTH + 1)])
    np.testing.assert_allclose(cal.table, want, rtol=0, atol=TOL)
