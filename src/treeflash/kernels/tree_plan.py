"""The DDTree's candidates at one depth: which (parent beam rank, child rank) pairs can still
enter a tree of `budget` nodes. Host-side and Triton-free, so that the torch build
(speculative/build.py) and the one-launch kernel (kernels/tree_build.py) share one definition."""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=256)
def candidate_pairs(n_parents: int, k: int, budget: int, device: torch.device):
    """(parent rank i, child rank r) with (i+1)(r+1) <= budget, i-major: two [C] tensors."""
    pi, ri = [], []
    for i in range(n_parents):
        for r in range(min(k, budget // (i + 1))):
            pi.append(i)
            ri.append(r)
    return (
        torch.tensor(pi, dtype=torch.long, device=device),
        torch.tensor(ri, dtype=torch.long, device=device),
    )
