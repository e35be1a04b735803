"""Executors run the target over the KV pool: locally, or on every rank of a TP group.

The engine never calls the model directly. It hands the executor a step's tensors (token
ids, positions, page tables, prefix lengths, mask) and asks for hidden states and taps;
after a verify it asks for the accepted rows to be committed. A distributed executor
broadcasts the same tensors to its follower ranks, which run their shard of the model.

The pool is handed to the kernels as `PagedKV`: the pool tensor and a batch's page table over
it. With pages smaller than the verify kernel's 64-row tile (page_size 1, say), a batch whose
requests all lie in aligned runs is handed over as 64-row coarse pages (`kvcache.coarse`), so
the kernel streams whole tiles by TMA as it does for a page-64 pool; otherwise as the pages are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treeflash.kvcache import KVPool
from treeflash.kvcache.coarse import coarsen
from treeflash.models.dcp import commit_rows
from treeflash.models.mla import AttnBatch
from treeflash.models.target import TargetModel


@dataclass(frozen=True)
class PagedKV:
    """What the kernels read a batch's KV through: kv [num_layers, pages, rows a page, D] (the
    pool, or its coarse view) and table [B, max_pages] int32 over kv's pages."""

    kv: torch.Tensor
    table: torch.Tensor
    factor: int  # pool pages per page of kv (1: the pool as it is)


class LocalExecutor:
    """One process, one device: the model and the pool live here."""

    def __init__(self, model: TargetModel, pool: KVPool, attention_impl: str | None = None):
        self.model, self.pool, self.attention_impl = model, pool, attention_impl
        self.device = pool.kv.device
        self._paged_key: tuple | None = None
        self._paged: PagedKV | None = None
        # read aligned runs of small pages as 64-row pages (off: the page-1 kernels, to compare)
        self.coarse = True
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

    def paged(self, page_lists: Sequence[list[int]]) -> PagedKV:
        """The batch's KV as the kernels read it, rebuilt only when the batch or any pages changed.

        Pages are reserved at admission, so steady decode reuses one table: no host-built
        tensor per step (a 256k-token request at page size 1 is 256k entries).
        """
        key = (self.pool.version, self.coarse, tuple(id(p) for p in page_lists))
        if key != self._paged_key:
            pool, f, lists = self.pool, 1, list(page_lists)
            if self.coarse and pool.coarse_factor is not None:
                coarse = coarsen(lists, pool.page_size, pool.num_pages)
                if coarse is not None:
                    f, lists = pool.coarse_factor, coarse
            self._paged = PagedKV(pool.kv_as(f), pool.page_table(lists, self.device, factor=f), f)
            self._paged_key = key
        return self._paged

    def forward(
        self,
        page_lists: Sequence[list[int]],
        input_ids: torch.Tensor,  # [B, N]
        positions: torch.Tensor,  # [B, N]
        prefix_lens: torch.Tensor | Sequence[int],  # [B]; a device tensor costs no copy
        tree_mask: torch.Tensor | None = None,  # [B, N, N]
        taps: Sequence[int] = (),
        graphable: bool = False,
        commit_later: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """graphable: the caller's shapes repeat step after step (decode, verify), so the
        static-buffer path may serve it when graphs are enabled. commit_later: a verify, whose
        rows `commit` places (under DCP: `models/dcp.py`)."""
        b, n = input_ids.shape
        paged = self.paged(page_lists)
        if graphable and self.graphs is not None and self.graphs.handles(b, n, paged.factor):
            # a device tensor of prefix lengths goes in as it is: the static buffer's copy_
            # converts it to int32 (a separate cast was one more launch a step)
            prefix = prefix_lens if isinstance(prefix_lens, torch.Tensor) else self.prefix_tensor(prefix_lens)
            return self.graphs.forward(paged, input_ids.to(self.device),
                                       positions.to(self.device), prefix.to(self.device), tree_mask, taps)
        batch = AttnBatch(
            page_table=paged.table,
            prefix_lens=self.prefix_tensor(prefix_lens),
            tree_mask=None if tree_mask is None else tree_mask.to(self.device),  # (a host-built tree's)
            impl=self.attention_impl,
            deal_unit=self.pool.page_size,
            commit_later=commit_later,
        )
        return self.model(input_ids.to(self.device), positions.to(self.device), paged.kv, batch, taps)

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
        paged = self.paged(page_lists)
        commit_rows(self.model, paged.kv, paged.table, prefix_lens, accept_idx, num_rows,
                    self.pool.page_size, self.attention_impl)
