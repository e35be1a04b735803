"""Which slice of the model a rank holds, and the one collective the model itself calls.

`Parallel` is passed by value into the model and the loader. Ranks 0..tp-1 split the
attention heads, the dense MLP's intermediate dim and the shared experts' intermediate
dim evenly. Routed experts are split two ways at once: `ep` groups of ranks each own
E/ep whole experts (expert parallel), and inside a group the moe_tp = tp/ep ranks split
every owned expert's intermediate dim (tensor parallel). ep=1 is pure TP, ep=tp pure EP.
Embedding, norms, routers, the latent projections (q_a, kv_a) and lm_head are replicated.
Decode context parallelism (dcp N, dividing tp): groups of N consecutive ranks deal each
request's latent cache among themselves (`models/dcp.py`); dcp 1 replicates it on every rank.
It sits below both models/ (which take a `Parallel`) and parallel/ (which starts the group).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from treeflash.config import ModelConfig


class CollectiveError(RuntimeError):
    """A collective failed: a peer is gone or did not answer in time. The group is broken, but
    not by what this rank computed, so a follower says it lost the group instead of reporting
    an error of its own (gloo and NCCL raise a plain RuntimeError for a dead peer)."""


@contextlib.contextmanager
def collective():
    """Turn a RuntimeError out of torch.distributed inside the block into `CollectiveError`."""
    try:
        yield
    except (CollectiveError, torch.OutOfMemoryError):  # running out of memory is this rank's own
        raise
    except RuntimeError as e:
        raise CollectiveError(str(e)) from e


@dataclass(frozen=True)
class Parallel:
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    # torch.distributed ProcessGroup for the all-reduces; None: a single process.
    group: object | None = None
    dcp_size: int = 1
    # this rank's DCP group (ranks dcp_size * (tp_rank // dcp_size) ..): the queries' all-gather
    # and the partials' all-to-all; None with dcp_size > 1: the group modelled in one process
    dcp_group: object | None = None

    def __post_init__(self):
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad tensor-parallel rank {self.tp_rank} of {self.tp_size}")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"ep={self.ep_size} must divide tp={self.tp_size}")
        # (tp 1 with dcp > 1: one rank of a DCP group modelled in one process, `models/dcp.py`)
        if self.dcp_size < 1 or (self.tp_size > 1 and self.tp_size % self.dcp_size):
            raise ValueError(f"dcp={self.dcp_size} must divide tp={self.tp_size}")

    @property
    def dcp_rank(self) -> int:
        return self.tp_rank % self.dcp_size

    def dcp_ranks(self) -> list[int]:
        """The tp ranks of this rank's DCP group."""
        first = self.tp_rank - self.dcp_rank
        return list(range(first, first + self.dcp_size))

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp_size

    @property
    def sharded(self) -> bool:
        return self.tp_size > 1

    def local_heads(self, cfg: ModelConfig) -> int:
        return cfg.num_attention_heads // self.tp_size

    def local_experts(self, cfg: ModelConfig) -> int:
        return cfg.n_routed_experts // self.ep_size

    def expert_offset(self, cfg: ModelConfig) -> int:
        return self.ep_rank * self.local_experts(cfg)

    def validate(self, cfg: ModelConfig) -> None:
        """Raise ValueError naming the first dimension that does not split evenly."""
        checks = [
            ("num_attention_heads", cfg.num_attention_heads, self.tp_size, "tp"),
            ("intermediate_size", cfg.intermediate_size, self.tp_size, "tp"),
        ]
        if cfg.n_routed_experts:
            checks += [
                ("n_routed_experts", cfg.n_routed_experts, self.ep_size, "ep"),
                ("moe_intermediate_size", cfg.moe_intermediate_size, self.moe_tp_size, "tp/ep"),
                ("moe_intermediate_size * n_shared_experts",
                 cfg.moe_intermediate_size * cfg.n_shared_experts, self.tp_size, "tp"),
            ]
        elif self.ep_size > 1:
            raise ValueError(f"ep={self.ep_size} needs a model with routed experts")
        for name, value, parts, flag in checks:
            if value % parts:
                raise ValueError(f"{name}={value} does not split evenly over {flag}={parts}")
        group, part = cfg.int4_group_size, cfg.moe_intermediate_size // self.moe_tp_size
        if group and part % group:
            raise ValueError(f"moe_intermediate_size={cfg.moe_intermediate_size} over tp/ep={self.moe_tp_size} "
                             f"gives {part} a rank, not a multiple of the INT4 group size {group}: an INT4 "
                             "down_proj's input dim splits only in whole groups")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results in place (every rank gets the same tensor)."""
        if self.group is None:
            return x
        import torch.distributed as dist

        try:  # as `collective()`, inline: this runs twice a layer per step
            dist.all_reduce(x, group=self.group)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            raise CollectiveError(str(e)) from e
        return x


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when n splits into `parts` equal parts."""
    size = n // parts
    return index * size, (index + 1) * size
