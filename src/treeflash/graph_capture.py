"""CUDA-graph plumbing shared by the target's verify graphs (engine/graphs.py) and the drafter's
(speculative/draft_graphs.py, speculative/tail_graphs.py): a memory pool that many graphs can come and go
in, the key of the buffers a graph was captured with, and the host seconds that captures cost.
Torch only, below the models and the speculative step that use it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_CAPTURE_S = [0.0]


@contextmanager
def timed_capture(device: torch.device) -> Iterator[None]:
    """Count the host seconds of a capture (its warm-up runs and Triton compiles included,
    synchronised at the end so their device work is in) in `capture_seconds()`: the adaptive
    budget leaves them out of the step that paid them (speculative/decoder.py)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _CAPTURE_S[0] += time.perf_counter() - t0


def capture_seconds() -> float:
    """Host seconds spent in `timed_capture` blocks so far, in this process."""
    return _CAPTURE_S[0]


_CAPTURES = [0]


def note_capture() -> None:
    """A graph key met at the use that captures it (mode "cuda"), or would (mode "eager": the
    same count on the CPU, where nothing is captured): verify, draft, append and tail graphs."""
    _CAPTURES[0] += 1


def graph_captures() -> int:
    """Graphs captured (or, eager, that would have been) so far, in this process: a served or
    timed step after `LLM.warmup` should add none (engine/warmup.py)."""
    return _CAPTURES[0]


class GraphPool:
    """A private memory pool for many CUDA graphs, kept alive by an anchor graph.

    Each graph captured into a pool holds a use count on it; destroying graphs can bring the
    count to 0 while the pool's blocks are still cached, and the next capture into it then
    trips `it->second->use_count > 0 INTERNAL ASSERT FAILED` in CUDACachingAllocator (seen on
    the H200 with torch 2.11 when the draft graphs dropped a grown cache's graphs and
    captured again). A one-op graph captured first and held as long as the pool keeps the
    count >= 1, so graphs may come and go."""

    def __init__(self, device: torch.device):
        self.handle = torch.cuda.graph_pool_handle()
        self._anchor = torch.cuda.CUDAGraph()
        torch.cuda.current_stream(device).synchronize()
        with torch.cuda.graph(self._anchor, pool=self.handle):
            self._anchor_out = torch.ones(1, device=device) * 2

    def capture(self, fn, device: torch.device) -> torch.cuda.CUDAGraph:
        """fn() captured into a new graph of this pool (nothing runs until a replay); fn must
        have run eagerly before, which is its warm-up (kernels compiled, host caches filled)."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.current_stream(device).synchronize()
        with torch.cuda.graph(graph, pool=self.handle):
            fn()
        return graph


def buffers_key(*tensors: torch.Tensor) -> tuple:
    """What a graph reading `tensors` was captured with: address, shape, stride, dtype."""
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors)


def same_buffers(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """src is dst itself (a producer wrote the static buffer in place): nothing to copy."""
    return buffers_key(dst) == buffers_key(src)
