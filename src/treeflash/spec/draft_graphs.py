"""The draft half of a speculative step (drafter proposal + tree build) as one CUDA graph.

Measured on the H200 (benchmarks/results/h200-20261202, issue 7): with the target's verify
forward replayed from a graph, a batch-1 ddtree step of the kimi-k2-tp8 preset still spent
~20 ms outside it, in ~hundreds of small eager launches at 7-14 us of host time each; the
drafter's five layers and the per-depth tree build are most of them. Both have shapes fixed
by (budget, block size, vocabulary) once the drafter reads its cache at full capacity
(`DFlashDrafter.propose(static=True)`: unused slots carry position -1 and are masked), so
they are captured once per (mode, budget, cache buffers) and replayed each step.

Batch 1 only (the latency case; a batch gathers its caches into a padded copy whose shape
changes every step). A full-attention layer's cache grows by doubling: its new buffer is a
new key, so the graph is captured again then (log2 of the context times per request), and
the previous one is dropped. Mode "eager" runs the same static path without capture (CPU,
tests). The speed-up is not yet measured on a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from treeflash.spec.build import build_tree
from treeflash.spec.tree import DraftTree

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    roots: torch.Tensor  # [1] static input: the bonus token
    start: torch.Tensor  # [1] static input: its position
    graph: object | None = None
    tree: DraftTree | None = None
    replays: int = 0


class DraftGraphs:
    def __init__(self, drafter, mode: str):
        if mode not in ("cuda", "eager"):
            raise ValueError(f"draft graph mode must be 'cuda' or 'eager', got {mode!r}")
        self.drafter, self.mode = drafter, mode
        self.entries: dict[tuple, _Entry] = {}
        self.captures = 0
        self.failure: str | None = None  # why capture failed; the decoder then proposes eagerly
        self.mempool = torch.cuda.graph_pool_handle() if mode == "cuda" else None

    def handles(self, caches) -> bool:
        """One request, a drafter that can propose over fixed shapes, and no failed capture."""
        return (self.failure is None and len(caches) == 1
                and getattr(self.drafter, "supports_static_propose", False))

    def run(self, spec_mode: str, caches, roots: torch.Tensor, start: torch.Tensor, budget: int) -> DraftTree:
        """The step's tree; its tensors are static buffers, valid until the next call."""
        cache = caches[0]
        # Every buffer the graph reads, by address: a later cache may reuse some freed blocks
        # of an earlier one, and a graph must never read a buffer it was not captured with.
        key = (spec_mode, budget, tuple((kv.k.data_ptr(), kv.v.data_ptr(), kv.pos.data_ptr(), kv.capacity)
                                        for kv in cache.layers))
        entry = self.entries.get(key)
        if entry is None:  # new buffers (another request, or a grown cache): drop the stale graphs
            self.entries = {k: e for k, e in self.entries.items() if k[:2] != key[:2]}
            entry = self.entries[key] = _Entry(torch.zeros_like(roots), torch.zeros_like(start))
        entry.roots.copy_(roots)
        entry.start.copy_(start)
        entry.replays += 1  # runs served from this entry (eager: computed; cuda: replayed)
        if self.mode == "eager":
            return self._compute(entry, cache, spec_mode, budget)
        if entry.graph is None:
            try:
                self._capture(entry, cache, spec_mode, budget)
            except Exception as e:  # noqa: BLE001 - never lose the request to a capture problem
                self.failure = f"{type(e).__name__}: {e}"
                self.entries.clear()
                log.warning("draft graph capture failed, proposing eagerly from now on: %s", self.failure)
                return self._compute(entry, cache, spec_mode, budget)
        else:
            entry.graph.replay()
        return entry.tree

    def release(self) -> None:
        self.entries.clear()

    def _compute(self, entry: _Entry, cache, spec_mode: str, budget: int) -> DraftTree:
        logits = self.drafter.propose([cache], entry.roots, entry.start, static=True)
        return build_tree(spec_mode, logits.float(), entry.roots, entry.start, budget)

    def _capture(self, entry: _Entry, cache, spec_mode: str, budget: int) -> None:
        """Warm up on a side stream (kernels compile, lru caches fill), capture, replay."""
        dev = entry.roots.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._compute(entry, cache, spec_mode, budget)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            entry.tree = self._compute(entry, cache, spec_mode, budget)
        entry.graph = graph
        self.captures += 1
        graph.replay()
