"""The greedy tail of a batch-1 speculative step as one CUDA graph: lm_head -> argmax ->
walk -> kv_commit -> the accepted rows' features -> the packed int64 row the host copies.

With the draft and verify halves replayed from graphs, what ran between them eagerly was
~46 kernel launches and ~13 memcpys a step at 5-10 us of host time each (the shipped
pair on the H200, benchmarks/results/h200-20261202-after-fixes/embedded). Its inputs
are all static already: the verify forward's hidden states and taps (engine/graphs.py,
the same tensors every replay of a key), that forward's page table and prefix lengths
(the commit reads those, `VerifyGraphs.commit`), and the draft graph's tree
(speculative/draft_graphs.py). A graph is keyed by the address, shape, stride and dtype of every
tensor it reads, so it replays only while the step's inputs sit where it was captured.

Captured at the second use of a key, with no warm-up run: the first use ran the same
function eagerly (kernels compiled, host-side caches such as `candidate_bounds`
filled), and kv_commit must run exactly once a step (a second run would move rows already
moved), so capture runs nothing and the replay right after it is the step's one run.
Greedy only: a sampling request draws from its own torch.Generator, which a graph would
need registered with it; those steps stay eager. Mode "eager" runs the same function over
the same static inputs without capture (CPU, tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from treeflash.graph_capture import GraphPool, note_capture, timed_capture
from treeflash.speculative.draft_graphs import evict_oldest

log = logging.getLogger(__name__)

# Keys change when the drafter's full-attention cache grows (a new tree buffer) or the
# verify's page-table bucket does; oldest dropped beyond this bound.
MAX_ENTRIES = 32

TailOut = tuple[torch.Tensor, torch.Tensor]  # (packed [1, W] long, feats [1, D+1, taps*hidden])


@dataclass
class _Entry:
    out: TailOut | None = None  # the graph's static outputs
    graph: object | None = None
    uses: int = 0
    replays: int = 0


class TailGraphs:
    def __init__(self, mode: str):
        if mode not in ("cuda", "eager"):
            raise ValueError(f"tail graph mode must be 'cuda' or 'eager', got {mode!r}")
        self.mode = mode
        self.entries: dict[tuple, _Entry] = {}
        self.captures = 0
        self.failure: str | None = None  # why capture failed; the decoder's tail is eager from then on
        self.mempool: GraphPool | None = None  # its own: draft graphs' intermediates must not alias its inputs
        # whether the last run's outputs are a graph's static tensors (the same every replay of
        # its key), which the drafter's append may then read in place (speculative/draft_graphs.py)
        self.last_static = False

    def run(self, key: tuple, fn: Callable[[], TailOut], device: torch.device) -> TailOut:
        """fn()'s outputs: computed (first use of key, eager mode) or replayed (static
        tensors, valid until the next call). fn must read no tensor missing from key."""
        entry = self.entries.get(key)
        if entry is None:
            evict_oldest(self.entries, MAX_ENTRIES)
            entry = self.entries[key] = _Entry()
        entry.uses += 1
        if entry.uses == 2:
            note_capture()
        self.last_static = False
        if self.mode == "eager" or entry.uses < 2 or self.failure is not None:
            return fn()
        if entry.graph is None:
            try:
                self._capture(entry, fn, device)
            except Exception as e:  # noqa: BLE001 - never lose the request to a capture problem
                self.failure = f"{type(e).__name__}: {e}"
                self.entries.clear()
                log.warning("tail graph capture failed, walking and committing eagerly from now on: %s",
                            self.failure)
                return fn()  # nothing ran during the failed capture: the step's one run
        entry.graph.replay()
        entry.replays += 1
        self.last_static = True
        return entry.out

    def _capture(self, entry: _Entry, fn: Callable[[], TailOut], device: torch.device) -> None:
        def body():
            entry.out = fn()

        if self.mempool is None:
            self.mempool = GraphPool(device)
        with timed_capture(device):
            entry.graph = self.mempool.capture(body, device)
        self.captures += 1

    def release(self) -> None:
        self.entries.clear()
