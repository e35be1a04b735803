"""The draft half of a speculative step as CUDA graphs: proposal + tree build (one graph),
and the append of the accepted rows to the drafter's cache (one graph per accepted length;
the overlapped step's masked append, one graph for every length: speculative/decoder.py).

Measured on the H200 (benchmarks/results/h200-20261202-first-sweep, issue 7): with the target's verify
forward replayed from a graph, a batch-1 ddtree step of the kimi-k2-tp8 preset still spent
~20 ms outside it, in ~hundreds of small eager launches at 7-14 us of host time each; the
drafter's five layers and the per-depth tree build are most of them. Both have shapes fixed
by (budget, block size, vocabulary) once the drafter reads its cache at full capacity
(`DFlashDrafter.propose(static=True)`: unused slots carry position -1 and are masked), so
they are captured once per (mode, budget, cache buffers) and replayed each step.

Batch 1 only (the latency case; a batch gathers its caches into a padded copy whose shape
changes every step). A full-attention layer's cache grows by doubling: its new buffer is a
new key, so the graph is captured again then (log2 of the context times), and kept: the
drafter pools finished requests' buffers (KVBufferPool), so later requests growing along
the same capacities replay the graphs already captured (on the H200, 2026-12-02, before the
pool, every request of the shipped pair captured ~24 graphs again, and ddtree ran no faster
than spec off). Mode "eager" runs the same static path without capture (CPU,
tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch

from treeflash.graph_capture import GraphPool, buffers_key, note_capture, timed_capture
from treeflash.graph_capture import same_buffers as _same
from treeflash.kernels.tree_build import TreeOut
from treeflash.runtime import DEFAULT, RuntimeOptions
from treeflash.speculative.build import build_tree
from treeflash.speculative.tree import DraftTree

log = logging.getLogger(__name__)

# Graphs kept per buffer set: the drafter's cache buffers are pooled across requests
# (models/drafter.py KVBufferPool), so the next request meets the same buffers at each
# capacity and replays these instead of capturing again. Oldest dropped beyond the bound.
MAX_ENTRIES = 32
MAX_EXTEND_ENTRIES = 256


def evict_oldest(entries: dict, bound: int) -> None:
    while len(entries) >= bound:
        entries.pop(next(iter(entries)))


@dataclass
class _Entry:
    roots: torch.Tensor  # [1] static input: the bonus token
    start: torch.Tensor  # [1] static input: its position
    out: TreeOut | None = None  # where the build writes the tree (build_tree's out)
    graph: object | None = None
    tree: DraftTree | None = None
    replays: int = 0


@dataclass
class _ExtendEntry:
    features: torch.Tensor  # [T, taps*hidden] static input
    slots: torch.Tensor  # [1 + layers]: start, then each layer's first slot (one copy fills both)
    start: torch.Tensor  # [1] = slots[:1]
    first: torch.Tensor  # [layers] = slots[1:]
    count: torch.Tensor  # [1] rows kept (extend_masked; extend keeps all T)
    graph: object | None = None
    uses: int = 0


class DraftGraphs:
    def __init__(self, drafter, mode: str, options: RuntimeOptions = DEFAULT):
        if mode not in ("cuda", "eager"):
            raise ValueError(f"draft graph mode must be 'cuda' or 'eager', got {mode!r}")
        self.drafter, self.mode, self.options = drafter, mode, options
        self.entries: dict[tuple, _Entry] = {}
        self.extend_entries: dict[tuple, _ExtendEntry] = {}
        self.captures = 0
        self.failure: str | None = None  # why capture failed; the decoder then proposes eagerly
        self.mempool: GraphPool | None = None  # made at the first capture

    def handles(self, caches) -> bool:
        """One request, a drafter that can propose over fixed shapes, and no failed capture."""
        return (self.failure is None and len(caches) == 1
                and getattr(self.drafter, "supports_static_propose", False))

    def run(self, spec_mode: str, caches, roots: torch.Tensor, start: torch.Tensor, budget: int,
            out: TreeOut | None = None) -> DraftTree:
        """The step's tree; its tensors are static buffers, valid until the next call.

        roots / start: read where they are when they are the tensors this entry was made with
        (the decoder's step inputs sit in one device buffer), else copied into those. out:
        the tree's tokens, positions, mask and the int32 prefix lengths go into these buffers
        (the verify forward's static inputs: no copy between the two graphs)."""
        cache = caches[0]
        outs = () if out is None else tuple(t for t in vars(out).values() if t is not None)
        key = (spec_mode, budget, self._buffers(cache), buffers_key(*outs))
        entry = self.entries.get(key)
        if entry is None:  # new buffers (a grown cache, or a request whose pool buffers are new)
            evict_oldest(self.entries, MAX_ENTRIES)
            # the entry holds these tensors: while it lives no other tensor takes their address
            entry = self.entries[key] = _Entry(roots, start, out=out)
            note_capture()
        for mine, given in ((entry.roots, roots), (entry.start, start)):
            if not _same(mine, given):
                mine.copy_(given)
        entry.replays += 1  # runs served from this entry (eager: computed; cuda: replayed)
        if self.mode == "eager":
            return self._keep(entry, self._compute(entry, cache, spec_mode, budget))
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

    def extend(self, cache, features: torch.Tensor, start: int, static: bool = False) -> None:
        """Append the step's accepted rows (features [T, taps*hidden] at start + 0..T-1, start
        the host's count) to the drafter cache: one graph per T (at most block size) and cache
        buffers, captured the second time that key is seen (a rare T stays eager); the host
        keeps n / head."""
        t = features.shape[0]
        firsts = cache.reserve(t)  # full layers grow here, on the host
        if any(kv.window is not None and 0 < kv.capacity <= t for kv in cache.layers):
            self.drafter.extend(cache, features, torch.arange(start, start + t, device=features.device))
            return  # a ring smaller than the step: the plain append handles that case
        if static:  # the tail graph's output, the same tensor every replay: read in place, keyed
            # on its address (a copy into a buffer of the entry's own was one more launch a step)
            entry = self._extend_entry(("extend", t, self._buffers(cache), buffers_key(features)), features,
                                       len(firsts), adopt=True)
        else:
            entry = self._extend_entry(("extend", t, self._buffers(cache)), features, len(firsts))
            entry.features.copy_(features)
        # start from the host too: one host-to-device copy, no device copy of the step's start
        entry.slots.copy_(torch.tensor([start, *firsts], dtype=torch.long), non_blocking=True)
        self._run_extend(entry, lambda: self.drafter.extend_static(cache, entry.features, entry.start, entry.first))
        cache.advance(t)

    def extend_masked(self, cache, features: torch.Tensor, start: torch.Tensor, first: torch.Tensor,
                      count: torch.Tensor) -> None:
        """Append the first `count` of a block's rows (features [R, taps*hidden] at start +
        0..R-1; start [1], first [layers] the slots cache.reserve(R) gave and count [1], all on
        the device): one graph per cache buffers for every count, so the overlapped step can
        queue it before the host knows count (speculative/decoder.py). The host advances the cache's
        counts (cache.advance) once it has learned count."""
        entry = self._extend_entry(("extend_masked", features.shape[0], self._buffers(cache)), features,
                                   first.shape[0])
        entry.features.copy_(features)
        entry.start.copy_(start.reshape(1))
        entry.count.copy_(count.reshape(1))
        entry.first.copy_(first)
        self._run_extend(entry, lambda: self.drafter.extend_static(cache, entry.features, entry.start,
                                                                   entry.first, entry.count))

    def _extend_entry(self, key: tuple, features: torch.Tensor, layers: int, adopt: bool = False) -> _ExtendEntry:
        """adopt: the entry reads `features` itself (the key holds its address; the entry keeps
        it alive, so no other tensor can take that address while the graph may read it)."""
        entry = self.extend_entries.get(key)
        if entry is None:
            evict_oldest(self.extend_entries, MAX_EXTEND_ENTRIES)
            dev = features.device
            slots = torch.zeros(1 + layers, dtype=torch.long, device=dev)
            entry = self.extend_entries[key] = _ExtendEntry(
                features if adopt else torch.empty_like(features), slots, slots[:1], slots[1:],
                torch.zeros(1, dtype=torch.long, device=dev))
        return entry

    def _run_extend(self, entry: _ExtendEntry, fn) -> None:
        """fn(), an append over the entry's static inputs: eagerly (eager mode, the key's first
        use, after a failed capture), else from its graph, captured at the second use (the
        first ran eagerly: its warm-up) and replayed from then on."""
        entry.uses += 1
        if entry.uses == 2:
            note_capture()
        if self.mode == "eager" or entry.uses < 2 or self.failure is not None:
            fn()
            return
        if entry.graph is None:
            try:
                with timed_capture(entry.start.device):
                    entry.graph = self._capture_fn(fn, entry.start.device)
            except Exception as e:  # noqa: BLE001 - never lose the request to a capture problem
                self.failure = f"{type(e).__name__}: {e}"
                self.entries.clear()
                self.extend_entries.clear()
                log.warning("draft graph capture failed, running the draft step eagerly: %s", self.failure)
                fn()  # nothing ran during the failed capture
                return
        entry.graph.replay()

    @staticmethod
    def _buffers(cache) -> tuple:
        # Every buffer a graph reads or writes, by address: a later cache may reuse some freed
        # blocks of an earlier one, and a graph must never touch a buffer it was not captured with.
        return tuple((kv.k.data_ptr(), kv.v.data_ptr(), kv.pos.data_ptr(), kv.capacity) for kv in cache.layers)

    def _capture_fn(self, fn, dev):
        """Capture fn() into a CUDA graph; fn must have run eagerly before (the warm-up)."""
        if self.mempool is None:  # graphs here are dropped and captured again: an anchored pool
            self.mempool = GraphPool(dev)
        graph = self.mempool.capture(fn, dev)
        self.captures += 1
        return graph

    @staticmethod
    def _keep(entry: _Entry, tree: DraftTree) -> DraftTree:
        """Eager mode: the tree in the entry's first tensors, where a replay would write it
        (the tail graph keys on their addresses: speculative/tail_graphs.py)."""
        if entry.tree is None:
            entry.tree = tree
        else:
            for f in fields(tree):
                value = getattr(tree, f.name)
                if isinstance(value, torch.Tensor) and not _same(getattr(entry.tree, f.name), value):
                    getattr(entry.tree, f.name).copy_(value)
        return entry.tree

    def release(self) -> None:
        self.entries.clear()
        self.extend_entries.clear()

    def _compute(self, entry: _Entry, cache, spec_mode: str, budget: int) -> DraftTree:
        logits = self.drafter.propose([cache], entry.roots, entry.start, static=True)
        # No .float(): kernels.topk_logprobs computes in float32 from any float dtype (a cast
        # here was one more launch in the graph, same values)
        return build_tree(spec_mode, logits, entry.roots, entry.start, budget, out=entry.out, options=self.options)

    def _capture(self, entry: _Entry, cache, spec_mode: str, budget: int) -> None:
        """Warm up on a side stream (kernels compile, lru caches fill), capture, replay."""
        dev = entry.roots.device

        def body():
            entry.tree = self._compute(entry, cache, spec_mode, budget)

        with timed_capture(dev):
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._compute(entry, cache, spec_mode, budget)
            torch.cuda.current_stream(dev).wait_stream(side)
            entry.graph = self._capture_fn(body, dev)
        entry.graph.replay()
