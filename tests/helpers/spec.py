"""Shared pieces of the speculative-engine tests: the test vocabulary and random prompts."""

from __future__ import annotations

import torch

VOCAB = 96


def prompts(n: int = 3, seed: int = 0) -> list[list[int]]:
    """n random prompts of 1..29 token ids (never the mask id VOCAB-1)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB - 1, (int(torch.randint(1, 30, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


class SyntheticCost:
    """A `costs.StepCostModel` stand-in for the tree sizing: seconds = plain(n_plain) +
    spec(n_spec, budget) (0 for an empty group), whatever the machine measures (a shared CPU's
    step times swing 10x); records what it was asked to observe."""

    def __init__(self, plain, spec):
        self.plain_s, self.spec_s = plain, spec
        self.observed: list = []
        self.theta = (0.0, 0.0, 1.0)

    def predict(self, shape) -> float:
        return self.predict_of(len(shape.plain), sum(shape.plain), len(shape.spec), sum(shape.spec), shape.budget)

    def predict_of(self, n_plain, sum_plain, n_spec, sum_spec, budget) -> float:
        s = self.plain_s(n_plain) if n_plain else 0.0
        return s + (self.spec_s(n_spec, budget) if n_spec else 0.0)

    def observe(self, shape, seconds) -> None:
        self.observed.append((shape, seconds))

    def priced(self, key) -> bool:
        return True

    def age(self, key) -> float:
        return 0.0  # every budget's price is current (the rule's re-pricing has nothing to do)

    def observe_touch(self, rows, touched) -> None:
        pass
