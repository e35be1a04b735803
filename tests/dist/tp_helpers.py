"""Constants and prompts shared by the tensor-parallel tests."""

from __future__ import annotations

import torch

VOCAB = 96
MAX_TOKENS = 20


def prompts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB - 1, (int(torch.randint(1, 30, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]
