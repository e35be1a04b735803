"""The drafter's path probabilities, calibrated: P(the walk accepts a node | its depth, its score).

DDTree ranks a tree's nodes by their path log-probability under the drafter's marginals
(`DraftTree.scores`). That is the drafter's own claim, and a drafter can be overconfident
(one trained on short contexts, at 128k) or plain wrong (an integration bug gives commit
length 1.00 with confident proposals). Here each node a walk verified is counted in a table
[depth, score bin] as seen and, if the walk took it, as accepted; the calibrated acceptance
of a bin is the accepted fraction, pulled towards the drafter's claim by a small prior and made
non-increasing in the score bin (pool-adjacent-violators over the bins of each depth). Counts
decay so the table follows the context as it grows.

A node's acceptance does not depend on the tree it was verified in (the target's token after a
node depends only on the node's path), so nodes of trees of any budget calibrate one table.
"""

from __future__ import annotations

import numpy as np

# Bin edges in -log p (path probability p): fine near 1, where the accept/reject decision of
# the first nodes lives, coarse in the tail (p < 1e-3 nodes are never worth verifying).
EDGES = np.array([0.01, 0.03, 0.07, 0.15, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.5, 6.5, 9.0])


# a refit fits only the depths whose raw acceptance rises somewhere (the others are their own
# fit); up to this many row by row (`nonincreasing`), more at once (`nonincreasing_rows`)
FEW_RISING = 3


def _prior(edges: np.ndarray) -> np.ndarray:
    """The drafter's claim per bin: exp(-mid) of the bin's -log p range."""
    lo = np.concatenate([[0.0], edges])
    hi = np.concatenate([edges, [edges[-1] * 1.5]])
    return np.exp(-(lo + hi) / 2)


_LOWER: dict[int, np.ndarray] = {}  # bins -> [j, k, 1] the ranges j..k that are empty (k < j)


def nonincreasing_rows(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`nonincreasing` of every row of y [R, K] (weights w [R, K], positive) at once: the fit at
    bin i is min over j <= i of max over k >= i of the weighted mean of bins j..k (the min-max
    formula of isotonic regression), [K, K, R] arrays in a few numpy calls: the table's refit of
    more than FEW_RISING rising depths. The max over k >= i is taken by doubling (log2 K
    maximums): numpy's maximum.accumulate over a short axis was half of it."""
    r, k = y.shape
    lower = _LOWER.get(k)
    if lower is None:
        lower = _LOWER[k] = (np.arange(k)[None, :] < np.arange(k)[:, None])[:, :, None]
    cw, cy = np.zeros((k + 1, r)), np.zeros((k + 1, r))
    np.cumsum(w.T, 0, out=cw[1:])
    np.cumsum((w * y).T, 0, out=cy[1:])
    den = cw[None, 1:] - cw[:-1, None]  # [j, k, R]
    np.copyto(den, 1.0, where=lower)
    best = cy[None, 1:] - cy[:-1, None]
    best /= den  # the mean of bins j..k (k >= j; below, never read at i >= j)
    shift = 1
    while shift < k:  # best[j, i] = max over k >= i of the mean of j..k
        np.maximum(best[:, :-shift], best[:, shift:], out=best[:, :-shift])
        shift *= 2
    np.copyto(best, np.inf, where=lower)
    return best.min(0).T  # [R, i]: over starts j <= i


def nonincreasing(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-increasing fit of y (pool adjacent violators)."""
    return np.array(_pooled(y.tolist(), w.tolist()))


def _pooled(y: list, w: list) -> list:
    """`nonincreasing` in Python floats."""
    vals, weights, sizes = [], [], []
    for v, u in zip(y, w, strict=True):
        size = 1
        while vals and vals[-1] < v:  # pool with the block before
            u1 = weights.pop()
            v = (vals.pop() * u1 + v * u) / (u1 + u)
            u += u1
            size += sizes.pop()
        vals.append(v)
        weights.append(u)
        sizes.append(size)
    out: list = []
    for v, size in zip(vals, sizes, strict=True):
        out += [v] * size
    return out


class DepthCalibration:
    """Acceptance per (depth, score bin), learned from walks. Depth 0 (the root) is unused."""

    def __init__(self, max_depth: int, prior_weight: float = 1.0, decay: float = 0.995,
                 refit_every: int = 1, edges: np.ndarray = EDGES):
        # refit_every: observations (steps) between two refits. The sizing absorbs its walks in
        # one call a decision (speculative/learning.py), so each call refits: at 8, a drafter
        # wrong at depth 1 whose only tree steps were its probes kept depth 1 at the prior's
        # 0.4-0.8 for tens of steps, and a probe's prediction took budget 3 at acceptance 0.
        self.edges = edges
        bins = len(edges) + 1
        self.seen = np.zeros((max_depth + 1, bins))
        self.accepted = np.zeros((max_depth + 1, bins))
        self.prior = np.broadcast_to(_prior(edges), (max_depth + 1, bins))
        self.prior_weight, self.decay, self.refit_every = prior_weight, decay, refit_every
        self.observations = 0
        self._table: np.ndarray | None = None

    def bins(self, scores: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.edges, -scores, side="right")

    def cells(self, depths: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """Each node's cell of the flattened [depth, bin] table (`observe_cells`, `predict_cells`)."""
        return depths * self.seen.shape[1] + self.bins(scores)

    def observe(self, depths: np.ndarray, scores: np.ndarray, accepted: np.ndarray, steps: int = 1) -> None:
        """The verified nodes of `steps` steps (flat arrays: depth >= 1, path log-prob, taken by
        the walk); the counts decay once a step."""
        self.observe_cells(self.cells(depths, scores), accepted, steps)

    def observe_cells(self, cells: np.ndarray, accepted: np.ndarray, steps: int = 1) -> None:
        """`observe` of nodes given by their `cells`."""
        self.seen *= self.decay ** steps
        self.accepted *= self.decay ** steps
        np.add.at(self.seen.reshape(-1), cells, 1.0)
        np.add.at(self.accepted.reshape(-1), cells, accepted)  # (bools add as 0.0 / 1.0)
        before = self.observations
        self.observations += steps
        if self._table is not None and self.observations // self.refit_every != before // self.refit_every:
            self._table = None

    @property
    def table(self) -> np.ndarray:
        """[depth, bin] calibrated acceptance (refitted every `refit_every` observations). The
        refit runs at every decision of the tree sizing (speculative/budget.py), where 1-2 of the
        16 depths rise (the bench of 400 steps at depth 15): a depth already non-increasing is
        its own fit, the few others are pooled row by row in Python, cheaper there than the
        ~20 numpy calls of fitting all rows at once."""
        if self._table is None:
            w = self.seen + self.prior_weight
            raw = (self.accepted + self.prior_weight * self.prior) / w
            rising = sorted(set(np.nonzero(raw[:, 1:] > raw[:, :-1])[0].tolist()))
            if len(rising) > FEW_RISING:
                raw[rising] = nonincreasing_rows(raw[rising], w[rising])
            for d in rising if len(rising) <= FEW_RISING else ():
                raw[d] = _pooled(raw[d].tolist(), w[d].tolist())
            self._table = raw
        return self._table

    def predict(self, depths: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """Calibrated acceptance of nodes (any shape; depths and scores alike)."""
        return self.table[depths, self.bins(scores)]

    def predict_cells(self, cells: np.ndarray) -> np.ndarray:
        """`predict` of nodes given by their `cells`."""
        return self.table.reshape(-1)[cells]
