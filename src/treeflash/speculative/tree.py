"""DraftTree: the hand-off between tree building, the target's verify pass and the walk.

Node 0 of every tree is the root (the previous bonus token, already committed as output
but not yet in the target's cache). Nodes are ordered parents-before-children; a node's
position is start + depth, so siblings share a position. Trees of a batch are padded to
a common width N; padding nodes have `valid` False, parent -1 and see only themselves.
`scores` (DDTree's builds) holds each node's path log-probability under the drafter's
marginals, the surrogate the nodes are ranked by: what the tree sizing calibrates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [B, N] long; column 0 = root
    parents: torch.Tensor  # [B, N] long; -1 for the root and for padding
    depths: torch.Tensor  # [B, N] long; root 0
    positions: torch.Tensor  # [B, N] long; start + depth
    ancestor_mask: torch.Tensor  # [B, N, N] bool; [b, i, j] = j is i or an ancestor of i
    valid: torch.Tensor  # [B, N] bool
    max_depth: int  # host-side bound on depths (block_size - 1), no sync needed
    is_chain: bool = False  # every tree is a single path: causal mask suffices
    scores: torch.Tensor | None = None  # [B, N] float32 path log-prob; root 0, padding -inf

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        """N: verify rows per request, root included."""
        return self.tokens.shape[1]

    @property
    def num_nodes(self) -> torch.Tensor:
        """[B] draft nodes per tree, root excluded."""
        return self.valid.sum(-1) - 1

    def request(self, b: int) -> DraftTree:
        """Tree b alone, padding dropped (host sync; for tests and debugging)."""
        n = int(self.valid[b].sum())
        sl = slice(b, b + 1)
        return DraftTree(
            self.tokens[sl, :n],
            self.parents[sl, :n],
            self.depths[sl, :n],
            self.positions[sl, :n],
            self.ancestor_mask[sl, :n, :n],
            self.valid[sl, :n],
            self.max_depth,
            self.is_chain,
            None if self.scores is None else self.scores[sl, :n],
        )

    def prefix(self, n: int, views: bool = True) -> DraftTree:
        """The first n nodes of every tree (root included): a tree again, since parents come
        before children, and the tree a build of n - 1 nodes would make (DDTree keeps the best
        prefixes in rank order). views: slices of this tree's tensors (the caller copies them
        where it needs them whole), else contiguous copies. One node under the root is a chain."""
        def cut(t: torch.Tensor | None, square: bool = False) -> torch.Tensor | None:
            if t is None:
                return None
            t = t[:, :n, :n] if square else t[:, :n]
            return t if views else t.contiguous()

        return DraftTree(cut(self.tokens), cut(self.parents), cut(self.depths), cut(self.positions),
                         cut(self.ancestor_mask, square=True), cut(self.valid), self.max_depth,
                         self.is_chain or n <= 2, cut(self.scores))

    @staticmethod
    def cat(trees: Sequence[DraftTree]) -> DraftTree:
        """Stack trees (each [b_i, N_i]) into one batch padded to max N_i."""
        n = max(t.width for t in trees)
        parts = [_pad(t, n) for t in trees]
        scored = all(p.scores is not None for p in parts)
        return DraftTree(
            *(torch.cat([getattr(p, f) for p in parts]) for f in _FIELDS),
            max_depth=max(t.max_depth for t in trees),
            is_chain=all(t.is_chain for t in trees),
            scores=torch.cat([p.scores for p in parts]) if scored else None,
        )

    def check(self) -> None:
        """Raise AssertionError if the structural invariants do not hold (host sync)."""
        n = self.tokens.shape[1]
        idx = torch.arange(n, device=self.tokens.device)
        p = self.parents
        real = self.valid[:, 1:]
        assert bool(self.valid[:, 0].all()), "every tree needs a root"
        assert bool((p[:, 0] == -1).all()), "root has no parent"
        assert bool(((p[:, 1:] >= 0) & (p[:, 1:] < idx[1:]) | ~real).all()), "parents first"
        parent_depth = self.depths.gather(1, p.clamp(min=0))
        assert bool(((self.depths[:, 1:] == parent_depth[:, 1:] + 1) | ~real).all()), "depths"
        assert bool((self.depths <= self.max_depth).all()), "max_depth"
        start = self.positions[:, :1]
        assert bool(((self.positions == start + self.depths) | ~self.valid).all()), "positions"
        assert torch.equal(self.ancestor_mask, ancestor_mask(p)), "ancestor mask"
        pair = self.valid[:, :, None] & self.valid[:, None, :] & (p >= 0)[:, :, None]
        pair &= ~torch.eye(n, dtype=torch.bool, device=p.device)
        twins = pair & (p[:, :, None] == p[:, None, :])
        twins &= self.tokens[:, :, None] == self.tokens[:, None, :]
        assert not bool(twins.any()), "siblings must have distinct tokens"


_FIELDS = ("tokens", "parents", "depths", "positions", "ancestor_mask", "valid")


def ancestor_mask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """[B, N] parent indices (-1 = none) -> [B, N, N] bool: j is i or one of its ancestors.

    Pointer doubling: after k rounds each row holds ancestors within 2^k steps, so
    ceil(log2(N)) rounds (or log2 of the depth bound) suffice; all on device.
    """
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n)
    has = parents >= 0
    hop = torch.where(has, parents, torch.arange(n, device=parents.device))  # self-loop at roots
    mask = eye | (torch.nn.functional.one_hot(hop, n).bool() & has[..., None])
    depth = n if max_depth is None else max_depth + 1
    rounds = max(1, (depth - 1).bit_length())
    for _ in range(rounds):
        # i sees whatever its 2^k-th ancestor sees.
        mask = mask | mask.gather(1, hop[..., None].expand(b, n, n))
        hop = hop.gather(1, hop)
    return mask


def _pad(t: DraftTree, n: int) -> DraftTree:
    extra = n - t.width
    if extra == 0:
        return t
    b, dev = t.batch_size, t.tokens.device
    fill = lambda x, v: torch.cat([x, x.new_full((b, extra), v)], dim=1)
    start = t.positions[:, :1]
    mask = torch.zeros(b, n, n, dtype=torch.bool, device=dev)
    mask[:, : t.width, : t.width] = t.ancestor_mask
    mask[:, torch.arange(t.width, n), torch.arange(t.width, n)] = True  # padding sees itself
    return DraftTree(
        fill(t.tokens, 0),
        fill(t.parents, -1),
        fill(t.depths, 0),
        torch.cat([t.positions, start.expand(b, extra)], dim=1),
        mask,
        fill(t.valid, False),
        t.max_depth,
        t.is_chain,
        None if t.scores is None else fill(t.scores, float("-inf")),
    )
