"""CUDA graphs for the step's target forward (decode and tree verify), over static buffers.

A graph is captured per key (batch bucket, rows per request, tree mask or causal, taps,
page-table width bucket) the first time that shape runs, and replayed afterwards. Every
input lives in a static buffer that each call overwrites in place: token ids, positions
(start + depth: a tree's RoPE positions must be written, never baked in at capture),
page table, prefix lengths and the ancestor mask. Requests are padded up to the batch
bucket with rows that write their latents into scratch pages this object reserves at
construction and read nothing else, so a padded row can never touch a real request's KV.
A batch read through the pool's coarse view (`engine.executor.PagedKV`, factor > 1) has graphs
of its own (the factor is in the key): another page size is another kernel.

mode "cuda" captures and replays (CUDA only); mode "eager" runs the very same static-
buffer path without capture, on any device: the CPU tests cover the plumbing (padding,
scratch pages, in-place writes, buckets) that the GPU then replays.

Not for tensor parallelism yet: followers would run unpadded shapes and the all-reduces
would disagree. Padding rows are routed by the MoE like real ones (they count in the
routing statistics and may touch extra experts): buckets are fine-grained at small batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treeflash import kernels
from treeflash.graph_capture import note_capture, same_buffers, timed_capture
from treeflash.kvcache.coarse import coarsen
from treeflash.models.mla import AttnBatch

GRAPH_MODES = ("cuda", "eager")


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ... up to (and including) max_batch."""
    out, b = [1, 2, 3], 4
    while b < max_batch:
        out += [b, b * 3 // 2]
        b *= 2
    return tuple(sorted({x for x in out if x < max_batch} | {max_batch}))


def bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"batch {n} exceeds the largest graph bucket {buckets[-1]}")


def page_bucket(n: int) -> int:
    """Page-table width rounded up to a power of two (the verify kernel plans its splits on it)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class GraphKey:
    batch: int  # bucket
    rows: int  # rows per request (tree width, 1 for decode)
    masked: bool  # ancestor mask, else causal
    taps: tuple[int, ...]
    pages: int  # page-table width bucket
    factor: int = 1  # pool pages per page of the KV the graph reads (PagedKV.factor)


class StepInputs:
    """The row inputs of every graph of one (batch bucket, rows, masked): token ids, positions,
    prefix lengths and the ancestor mask. Shared by the keys that differ only in taps or
    page-table bucket, so their addresses stay put while a request's context grows: the draft
    graph's tree build writes a batch-1 step's tree straight into them (speculative/draft_graphs.py),
    and `StaticStep.write` then copies nothing (H200, 2026-12-03: 4 copies a step fewer)."""

    def __init__(self, batch: int, rows: int, masked: bool, device: torch.device):
        self.ids = torch.zeros(batch, rows, dtype=torch.long, device=device)
        self.positions = torch.arange(rows, device=device).repeat(batch, 1)
        self.prefix_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        tril = torch.tril(torch.ones(rows, rows, dtype=torch.bool, device=device))
        self.mask = tril.repeat(batch, 1, 1) if masked else None  # padding rows: a chain


class StaticStep:
    """The static input and output buffers of one key, and its graph once captured."""

    def __init__(self, key: GraphKey, device: torch.device, scratch_row: torch.Tensor,
                 inputs: StepInputs | None = None, kv: torch.Tensor | None = None):
        b, n = key.batch, key.rows
        self.key = key
        self.kv = kv  # the pool, or its coarse view (key.factor)
        inputs = inputs or StepInputs(b, n, key.masked, device)
        self.ids, self.positions, self.prefix_lens, self.mask = (
            inputs.ids, inputs.positions, inputs.prefix_lens, inputs.mask)
        self.page_table = scratch_row[:key.pages].repeat(b, 1).contiguous()  # [b, pages]
        self.scratch_row = scratch_row[:key.pages]
        self.table_src: torch.Tensor | None = None  # the table rows 0..B-1 hold (held: never reused)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None
        self.taps: torch.Tensor | None = None
        self.replays = 0
        self.events: tuple | None = None  # (start, end) CUDA events when replays are timed

    def write(self, ids, positions, page_table, prefix_lens, tree_mask) -> None:
        """Copy the live batch into rows 0..B-1 (in place); rows B.. become padding again."""
        b, n = ids.shape
        p = page_table.shape[1]
        for dst, src in ((self.ids, ids), (self.positions, positions), (self.prefix_lens, prefix_lens),
                         (self.mask, tree_mask)):
            if dst is not None and not same_buffers(dst[:b], src):
                dst[:b].copy_(src)  # prefix lengths: copy_ casts to int32
        if page_table is not self.table_src:  # the executor keeps one table while pages stay put:
            self.page_table[:b, :p].copy_(page_table)  # steady steps skip these two launches
            self.page_table[:b, p:] = self.scratch_row[p:]  # never read: inside the reserved pool
            self.table_src = page_table
        if b < self.key.batch:  # padding: scratch pages, prefix 0, positions 0..n-1, chain mask
            self.ids[b:] = 0
            self.positions[b:] = torch.arange(n, device=self.ids.device)
            self.page_table[b:] = self.scratch_row  # (rows a table of more requests held: see table_src)
            self.prefix_lens[b:] = 0
            if self.mask is not None:
                self.mask[b:] = torch.tril(torch.ones(n, n, dtype=torch.bool, device=self.ids.device))


class VerifyGraphs:
    """Static-buffer forwards of the target, keyed by shape; see the module docstring."""

    def __init__(self, model, pool, attention_impl: str | None, mode: str, *, max_rows: int,
                 max_batch: int):
        if mode not in GRAPH_MODES:
            raise ValueError(f"graph mode must be one of {GRAPH_MODES}, got {mode!r}")
        if mode == "cuda" and pool.kv.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model, self.pool, self.impl, self.mode = model, pool, attention_impl, mode
        self.device = pool.kv.device
        self.max_rows = max_rows
        self.buckets = batch_buckets(max_batch)
        # Scratch pages for padding rows: enough for max_rows positions from position 0, and
        # whole aligned coarse pages where the pool has a coarse view, so that padding rows of
        # coarse graphs have pages too. _scratch: their page-table row by factor.
        self.scratch_pages: list[int] = []
        f = pool.coarse_factor
        pool.grow(self.scratch_pages, max_rows if f is None else -(-max_rows // (f * pool.page_size)) * f
                  * pool.page_size)
        self._scratch = {1: torch.tensor(self.scratch_pages, dtype=torch.int32, device=self.device)}
        coarse = None if f is None else coarsen([self.scratch_pages], pool.page_size, pool.num_pages)
        if coarse is not None:
            self._scratch[f] = torch.tensor(coarse[0], dtype=torch.int32, device=self.device)
        self.steps: dict[GraphKey, StaticStep] = {}
        self.inputs: dict[tuple[int, int, bool], StepInputs] = {}  # (batch bucket, rows, masked)
        self.mempool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        # Benchmarks set time_replays: each replay is bracketed by CUDA events (no sync);
        # last_replay_s() reads the last one's device time, replays_s() the sum of those since
        # mark_replays() (a step may replay two keys: its plain and its tree requests), once
        # the caller has synchronised (or waited for work queued after them).
        self.time_replays = False
        self._last_events: tuple | None = None
        self._timed: list[tuple] = []
        self.last_step: StaticStep | None = None  # the last forward's (see served())

    def handles(self, batch: int, rows: int, factor: int = 1) -> bool:
        return rows <= self.max_rows and batch <= self.buckets[-1] and factor in self._scratch

    def static_inputs(self, batch: int, rows: int, masked: bool) -> StepInputs:
        """The input buffers every graph of (batch's bucket, rows, masked) reads: a producer
        may write a step's inputs there (rows 0..batch-1) and pass those very tensors to
        forward(), which then copies nothing."""
        key = (bucket(batch, self.buckets), rows, masked)
        inputs = self.inputs.get(key)
        if inputs is None:
            inputs = self.inputs[key] = StepInputs(key[0], rows, masked, self.device)
        return inputs

    def release(self) -> None:
        """Give the scratch pages back and drop every graph."""
        self.steps.clear()
        if self.scratch_pages:
            self.pool.release(self.scratch_pages)

    def _scratch_row(self, pages: int, factor: int = 1) -> torch.Tensor:
        """A page-table row of `pages` entries inside the scratch pages (repeating the last)."""
        s = self._scratch[factor]
        idx = torch.arange(pages, device=self.device).clamp(max=s.shape[0] - 1)
        return s[idx]

    def forward(self, paged, input_ids: torch.Tensor, positions: torch.Tensor,
                prefix_lens: torch.Tensor, tree_mask: torch.Tensor | None, taps: Sequence[int]):
        """(hidden [B, N, hidden], taps or None) for the live batch: views into the static
        outputs, valid until the next call. paged: the batch's `engine.executor.PagedKV`."""
        b, n = input_ids.shape
        self._last_events = None
        key = GraphKey(bucket(b, self.buckets), n, tree_mask is not None, tuple(taps),
                       page_bucket(paged.table.shape[1]), paged.factor)
        step = self.steps.get(key)
        if step is None:
            inputs = self.static_inputs(b, n, tree_mask is not None)
            step = self.steps[key] = StaticStep(key, self.device, self._scratch_row(key.pages, key.factor),
                                                inputs, paged.kv)
            note_capture()
        step.write(input_ids, positions, paged.table, prefix_lens, tree_mask)  # copy_ casts to int32
        self.last_step = step
        if self.mode == "eager":
            self._run_in_place(step)
        elif step.graph is None:
            self._capture(step)
        elif self.time_replays:
            if step.events is None:
                step.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            step.events[0].record()
            step.graph.replay()
            step.events[1].record()
            self._last_events = step.events
            self._timed.append(step.events)
            step.replays += 1
        else:
            step.graph.replay()
            step.replays += 1
        taps_out = None if step.taps is None else step.taps[:b]
        return step.hidden[:b], taps_out

    def last_replay_s(self) -> float | None:
        """Device seconds of the last timed replay (None if the last call was not one);
        the caller must have synchronised since."""
        ev, self._last_events = self._last_events, None
        return None if ev is None else ev[0].elapsed_time(ev[1]) / 1e3

    def mark_replays(self) -> None:
        self._timed = []

    def replays_s(self) -> float:
        """Device seconds of the timed replays since mark_replays() (each key's events are
        reused by its next replay: read them before the key replays again)."""
        return sum(a.elapsed_time(b) for a, b in self._timed) / 1e3

    def served(self, hidden: torch.Tensor) -> StaticStep | None:
        """The static step whose output `hidden` views (the last forward's), else None."""
        step = self.last_step
        if step is None or step.hidden is None or hidden.data_ptr() != step.hidden.data_ptr():
            return None
        return step

    def commit(self, step: StaticStep, accept_idx: torch.Tensor, num_rows: torch.Tensor) -> None:
        """`kernels.kv_commit` of the live rows over the page table and prefix lengths `step`'s
        forward ran with: static buffers, so a CUDA graph may capture it (speculative/tail_graphs.py).
        accept_idx [B, M] node indices, root first; num_rows [B] rows to keep."""
        b = accept_idx.shape[0]
        kernels.kv_commit(step.kv, step.page_table[:b], step.prefix_lens[:b], accept_idx, num_rows,
                          impl=self.impl)

    def _run_in_place(self, step: StaticStep) -> None:
        """Eager mode: compute, then leave the outputs in the first run's tensors, where a
        replay would write them (callers may key graphs of their own on those addresses)."""
        hidden, taps = step.hidden, step.taps
        self._run(step)
        if hidden is not None:
            step.hidden = hidden.copy_(step.hidden)
            step.taps = None if taps is None else taps.copy_(step.taps)

    def _run(self, step: StaticStep) -> None:
        batch = AttnBatch(step.page_table, step.prefix_lens, step.mask, self.impl)
        step.hidden, step.taps = self.model(step.ids, step.positions, step.kv, batch, step.key.taps)

    def _capture(self, step: StaticStep) -> None:
        """Warm up on a side stream (Triton compiles, the allocator settles), capture, replay.

        The warm-up runs are the real computation of this call (they write the same KV
        rows the replay writes again), so the first call's outputs are right either way.
        """
        with timed_capture(self.device):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run(step)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.mempool):
                self._run(step)
        step.graph = graph
        graph.replay()
        step.replays += 1
