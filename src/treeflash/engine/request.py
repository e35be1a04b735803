"""A request's state as it moves through the engine, and what it returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from treeflash.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose latent KV is committed in `pages`
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""
    text_final: bool = False  # text was cut at a stop string
    generator: torch.Generator | None = None
    spec_state: Any = None  # the speculative decoder's per-request state (drafter cache, bonus)
    # Tapped hidden states of the prompt chunks computed so far: the drafter's context, handed
    # over (and dropped) when the last chunk is done.
    prefill_features: list[torch.Tensor] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    arrival_time: float = 0.0
    first_token_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepOutput:
    """New tokens of one request after one engine step (what the server streams)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
