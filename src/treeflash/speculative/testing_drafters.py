"""Test-only drafters with the DFlashDrafter interface (new_cache / extend / propose).

OracleDrafter replays a known target continuation (full acceptance), RandomDrafter
proposes seeded noise (little acceptance), AdversarialDrafter mixes the truth with
decoys, exact ties, -inf logits, the mask token and the bonus itself, so the tree must
branch and the walk must take siblings, and WrongDrafter is sure of a token the target never
picks (the incident's drafter: confident, commit length 1.00; `right` of its sequences, and
every sequence from context `right_from` on, are proposed as the oracle would). None of them
reads the features it is given; losslessness must hold whatever they propose.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MARGIN = 40.0  # logit gap that makes a token's probability 1 to within exp(-40)


@dataclass
class ReplayCache:
    """A test drafter's per-request state: the known sequence (if any) and a generator."""

    seq: torch.Tensor | None  # [S] long: prompt + the target's continuation
    generator: torch.Generator
    seq_len: int = 0


class _TestDrafter(ABC):
    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        seed: int = 0,
        sequences: Sequence[Sequence[int]] = (),
        mask_token_id: int | None = None,
        target_layer_ids: Sequence[int] = (0,),
        device: str | torch.device = "cpu",
    ):
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        self.vocab_size, self.block_size, self.seed = vocab_size, block_size, seed
        self.mask_token_id = vocab_size - 1 if mask_token_id is None else mask_token_id
        self.target_layer_ids = tuple(target_layer_ids)
        self.device = torch.device(device)
        self.sequences = [list(s) for s in sequences]
        self._n_caches = 0

    def new_cache(self, prompt_ids: Sequence[int] | None = None) -> ReplayCache:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self._n_caches)
        self._n_caches += 1
        return ReplayCache(self._find(prompt_ids), g)

    def _find(self, prompt_ids: Sequence[int] | None) -> torch.Tensor | None:
        if prompt_ids is None or not self.sequences:
            return None
        p = list(prompt_ids)
        for s in self.sequences:
            if s[: len(p)] == p:
                return torch.tensor(s, dtype=torch.long, device=self.device)
        raise ValueError(f"no known continuation starts with prompt {p[:8]}...")

    def extend(
        self, cache: ReplayCache, features: torch.Tensor, positions: torch.Tensor | None = None
    ) -> None:
        if positions is not None and positions.shape[0] != features.shape[0]:
            raise ValueError("features and positions disagree on T")
        cache.seq_len += features.shape[0]

    def propose(
        self,
        caches: Sequence[ReplayCache],
        bonus: torch.Tensor,
        start_pos: torch.Tensor,
        block_size: int | None = None,
    ) -> torch.Tensor:
        bs = block_size or self.block_size
        starts, bonuses = start_pos.tolist(), bonus.tolist()
        rows = [
            self._logits(c, s, b, bs - 1) for c, s, b in zip(caches, starts, bonuses, strict=True)
        ]
        return torch.stack(rows).to(self.device)  # [B, bs-1, V]

    def _truth(self, cache: ReplayCache, start: int, depth: int) -> list[int | None]:
        """Known tokens at positions start+1 .. start+depth (None where unknown)."""
        if cache.seq is None:
            return [None] * depth
        seq = cache.seq.tolist()
        return [seq[p] if p < len(seq) else None for p in range(start + 1, start + depth + 1)]

    @abstractmethod
    def _logits(self, cache: ReplayCache, start: int, bonus: int, depth: int) -> torch.Tensor:
        """Logits [depth, V] for block slots 1..depth of one request."""


class OracleDrafter(_TestDrafter):
    """Puts all mass on the known continuation (`sequences`: prompt + target greedy output)."""

    def _logits(self, cache, start, bonus, depth):
        out = torch.zeros(depth, self.vocab_size)
        for d, tok in enumerate(self._truth(cache, start, depth)):
            out[d, 0 if tok is None else tok] = MARGIN
        return out


class RandomDrafter(_TestDrafter):
    """Seeded Gaussian logits (scale 3), independent of the context."""

    def _logits(self, cache, start, bonus, depth):
        return 3.0 * torch.randn(depth, self.vocab_size, generator=cache.generator)


class AdversarialDrafter(_TestDrafter):
    """Right for a random number of depths, then the truth demoted behind a decoy (so only a
    tree branch can follow it), with exact ties, -inf logits, the mask token and the bonus
    as decoys, and sometimes the truth again at rank 0 deeper down."""

    def _logits(self, cache, start, bonus, depth):
        g = cache.generator
        rnd = lambda n: int(torch.randint(n, (1,), generator=g))
        out = torch.randn(depth, self.vocab_size, generator=g)
        out[:, torch.rand(self.vocab_size, generator=g) < 0.3] = float("-inf")
        right_until = rnd(depth + 1)
        for d, tok in enumerate(self._truth(cache, start, depth)):
            decoy = [self.mask_token_id, bonus, rnd(self.vocab_size)][rnd(3)]
            top = out[d].max().clamp(min=0) + 5.0
            if tok is None or (d >= right_until and rnd(3) == 0):
                out[d, decoy] = top  # plain wrong
            elif d < right_until or decoy == tok:
                out[d, tok] = top
            elif rnd(2):
                out[d, decoy], out[d, tok] = top, top  # exact tie: either may rank first
            else:
                out[d, decoy], out[d, tok] = top, top - 0.5  # the truth is a sibling
        return out


class WrongDrafter(_TestDrafter):
    """Certain, and wrong at every depth: each slot puts all its mass on a token other than
    the known one (and the known one impossible), so the walk accepts nothing. Sequences whose
    index is in `right` are proposed as OracleDrafter proposes them (a batch mixing both), and so
    is every block from context `right_from` on (a drafter wrong for a while, then right again)."""

    def __init__(self, *args, right: Sequence[int] = (), right_from: int | None = None, **kw):
        super().__init__(*args, **kw)
        self.right = {i for i in right}
        self.right_from = right_from

    def _logits(self, cache, start, bonus, depth):
        out = torch.zeros(depth, self.vocab_size)
        seq = None if cache.seq is None else cache.seq.tolist()
        good = seq is not None and any(i in self.right and s == seq for i, s in enumerate(self.sequences))
        good |= seq is not None and self.right_from is not None and start >= self.right_from
        for d, tok in enumerate(self._truth(cache, start, depth)):
            tok = 0 if tok is None else tok
            if good:
                out[d, tok] = MARGIN
            else:
                out[d, (tok + 1) % self.vocab_size] = MARGIN
                out[d, tok] = float("-inf")
        return out
