"""Sampling parameters and the one place logits become token choices.

`process_logits` turns target logits into the distribution a request samples from
(temperature, then top-k, then top-p). Plain decoding and the speculative walk both draw
from it, which is what makes speculative sampling reproduce the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treeflash import kernels

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):  # torch.Generator's range
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_LEN:
                raise ValueError(f"each stop string must be a non-empty str of <= {MAX_STOP_LEN} chars, got {s!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] float32 after temperature, top-k, top-p."""
    x = logits.float() / max(params.temperature, 1e-6)
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def choose_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of logits [K, V]: argmax when greedy, else a draw from process_logits."""
    if params.greedy:
        return logits.argmax(-1)
    probs = process_logits(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# Rows of a small vocabulary: one Triton program a row (kernels.argmax) beats torch's reduction,
# which took ~16 us for a 32-node verify of the shipped pair (H200, 2026-12-03); one row of a
# 163k vocabulary (Kimi-K2 decode) keeps torch's reduction, which spreads the row over the chip.
_ROW_ARGMAX_MAX_VOCAB = 16384


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), through `kernels.argmax` where that is faster (same result and ties)."""
    rows = logits.numel() // max(logits.shape[-1], 1)
    if logits.is_cuda and rows >= 2 and logits.shape[-1] <= _ROW_ARGMAX_MAX_VOCAB:
        return kernels.argmax(logits)
    return logits.argmax(-1)


def choose_tokens_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token per row of logits [B, ..., V] for B requests, on the device, no host sync.

    Greedy requests are one argmax over the whole batch. Each sampling request draws from
    its own generator with the same call `choose_tokens` makes (torch.multinomial over its
    rows in order), so a seeded request gives the same tokens whatever its batch-mates.
    """
    if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(params)} requests")
    out = greedy_tokens(logits)  # [B, ...]
    for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        rows = logits[i].reshape(-1, logits.shape[-1])
        probs = process_logits(rows, p)
        out[i] = torch.multinomial(probs, 1, generator=gen).view(out[i].shape)
    return out
