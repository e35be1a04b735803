"""Executors run the target over the KV pool: locally, or on every rank of a TP group.

The engine never calls the model directly. It hands the executor a step's tensors (token
ids, positions, page tables, prefix lengths, mask) and asks for hidden states and taps;
after a verify it asks for the accepted rows to be committed. A distributed executor
broadcasts the same tensors to its follower ranks, which run their shard of the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from treeflash import kernels
from treeflash.kvcache import KVPool
from treeflash.models.mla import AttnBatch
from treeflash.models.target import TargetModel


class LocalExecutor:
    """One process, one device: the model and the pool live here."""

    def __init__(self, model: TargetModel, pool: KVPool, attention_impl: str | None = None):
        self.model, self.pool, self.attention_impl = model, pool, attention_impl
        self.device = pool.kv.device
        self._table_key: tuple | None = None
        self._table: torch.Tensor | None = None
        self.graphs = None  # engine.graphs.VerifyGraphs once enable_graphs() is called

    def enable_graphs(self, mode: str, *, max_rows: int, max_batch: int) -> None:
        """Run graphable forwards (decode, verify) over static buffers: replayed CUDA graphs
        (mode "cuda") or the same buffers eagerly (mode "eager", any device)."""
        if type(self) is not LocalExecutor:
            raise ValueError("CUDA graphs are not supported with tensor parallelism yet (tp must be 1)")
        from treeflash.engine.graphs import VerifyGraphs

        self.graphs = VerifyGraphs(self.model, self.pool, self.attention_impl, mode,
                                   max_rows=max_rows, max_batch=max_batch)

    def check(self) -> None:
        """Raise if a step's results cannot be trusted. One process has nothing to check; the
        distributed executor raises here when the group broke during the step."""

    def page_table(self, page_lists: Sequence[list[int]]) -> torch.Tensor:
        """[B, max_pages] int32 on the device, rebuilt only when the batch or any pages changed.

        Pages are reserved at admission, so steady decode reuses one table: no host-built
        tensor per step (a 256k-token request at page size 1 is 256k entries).
        """
        key = (self.pool.version, tuple(id(p) for p in page_lists))
        if key != self._table_key:
            self._table = self.pool.page_table(list(page_lists), self.device)
            self._table_key = key
        return self._table

    def forward(
        self,
        page_lists: Sequence[list[int]],
        input_ids: torch.Tensor,  # [B, N]
        positions: torch.Tensor,  # [B, N]
        prefix_lens: torch.Tensor | Sequence[int],  # [B]; a device tensor costs no copy
        tree_mask: torch.Tensor | None = None,  # [B, N, N]
        taps: Sequence[int] = (),
        graphable: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """graphable: the caller's shapes repeat step after step (decode, verify), so the
        static-buffer path may serve it when graphs are enabled."""
        b, n = input_ids.shape
        if graphable and self.graphs is not None and self.graphs.handles(b, n):
            # a device tensor of prefix lengths goes in as it is: the static buffer's copy_
            # converts it to int32 (a separate cast was one more launch a step)
            prefix = prefix_lens if isinstance(prefix_lens, torch.Tensor) else self.prefix_tensor(prefix_lens)
            return self.graphs.forward(self.page_table(page_lists), input_ids.to(self.device),
                                       positions.to(self.device), prefix.to(self.device), tree_mask, taps)
        batch = AttnBatch(
            page_table=self.page_table(page_lists),
            prefix_lens=self.prefix_tensor(prefix_lens),
            tree_mask=tree_mask,
            impl=self.attention_impl,
        )
        return self.model(input_ids.to(self.device), positions.to(self.device), self.pool.kv, batch, taps)

    def prefix_tensor(self, prefix_lens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """[B] int32 on the device (a host list is one small host-to-device copy, no sync)."""
        if isinstance(prefix_lens, torch.Tensor):
            return prefix_lens.to(self.device, torch.int32).contiguous()
        return torch.tensor(list(prefix_lens), dtype=torch.int32).to(self.device, non_blocking=True)

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        return self.model.logits(hidden, float32)

    def commit(
        self,
        page_lists: Sequence[list[int]],
        prefix_lens: torch.Tensor,  # [B]
        accept_idx: torch.Tensor,  # [B, M] node indices, root first
        num_rows: torch.Tensor,  # [B] rows to keep (accepted drafts + root)
    ) -> None:
        kernels.kv_commit(self.pool.kv, self.page_table(page_lists), prefix_lens.to(torch.int32),
                          accept_idx, num_rows, impl=self.attention_impl)
