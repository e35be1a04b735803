"""Shared pieces of the speculative-engine tests: the test vocabulary and random prompts."""

from __future__ import annotations

import torch

VOCAB = 96


def prompts(n: int = 3, seed: int = 0) -> list[list[int]]:
    """n random prompts of 1..29 token ids (never the mask id VOCAB-1)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB - 1, (int(torch.randint(1, 30, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]
