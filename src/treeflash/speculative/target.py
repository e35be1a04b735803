"""What the speculative step needs of the target it runs on: `SpecTarget`, a structural type
(engine/engine.py `Engine` is one), and of the engine step it serves: `StepBatch`. The step
reaches nothing else of the engine: no executor, pool or model object, no request list of its
own, so a test or another host can hand it anything with these members."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class StepBatch:
    """The engine step's requests past prefill, in order (under the auto budget the next step is
    planned for all of them), and whether the engine runs them alone (`solo`: no request in
    prefill beside them; the batch-1 draft graphs apply only then)."""

    reqs: list
    solo: bool


class SpecTarget(Protocol):
    device: torch.device
    spec_listeners: list[Callable]  # each called (request, drafted, accepted, budget) per step

    def forward(self, reqs: list, input_ids: torch.Tensor, positions: torch.Tensor,
                prefix_lens: torch.Tensor | Sequence[int], tree_mask: torch.Tensor | None = None,
                taps: Sequence[int] = (), graphable: bool = False,
                commit_later: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows' latents written after each request's prefix, under `tree_mask` (a verify's
        ancestor mask, None for a chain or a decode row); (hidden [B, N, H], tapped features)."""
        ...

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        ...

    def commit(self, reqs: list, prefix_lens: torch.Tensor, accept_idx: torch.Tensor,
               num_rows: torch.Tensor) -> None:
        """Keep the accepted verify rows in sequential slots after each prefix."""
        ...

    @property
    def verify_graphs(self):
        """The verify forward's CUDA graphs (engine/graphs.py VerifyGraphs), or None."""
        ...

    def moe_expert_counts(self) -> list[torch.Tensor]:
        ...

    def step_costs(self, drafter):
        """The auto budget's default `costs.StepCostModel` for this target and `drafter`."""
        ...
