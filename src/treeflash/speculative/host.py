"""Host-side pieces of the speculative step: its inputs copied to the device from pinned memory
(`InputCopy`), the device-to-host copy into pinned memory that lets the device run ahead, what
the host reads out of it (`read_rows`), the optional per-phase wall timer (bench sweep's
breakdown) and the clock that turns a step's wall time into the seconds the sizing prices."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


class StepClock(Protocol):
    """What an auto step's seconds are, for the sizing (bench sweep: a preset's step
    extrapolated to the real model's layers). The step calls start() before its forwards and
    seconds(wall) after them: only that step's device work may count, whoever drives it (the
    sweep's warm-up steps had counted every replay since the sweep's last mark: results/
    h100-20261207-spec-cost-3, auto pinned at the drafter's depth on the kimi presets)."""

    def start(self) -> None: ...

    def seconds(self, wall: float) -> float: ...


@dataclass
class HostCopy:
    """A device tensor on its way into pinned host memory. The device may run work queued
    behind the copy meanwhile; a copy into pageable memory (.tolist() of the device
    tensor) would wait for that work too."""

    values: torch.Tensor
    done: torch.cuda.Event | None = None

    @staticmethod
    def start(src: torch.Tensor, buffers: dict) -> HostCopy:
        """Queue src's copy into a pinned buffer from `buffers` (one per shape, reused: the
        host has read the last copy out of it before the next is queued)."""
        if src.device.type != "cuda":
            return HostCopy(src)
        buf = buffers.get(src.shape)
        if buf is None:
            buf = buffers[src.shape] = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        buf.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(src.device))
        return HostCopy(buf, done)

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.values


class InputCopy:
    """The step's small inputs, rows of longs [rows, batch], to the device in one copy. From
    pinned memory the copy is truly asynchronous (from pageable memory it would wait for the
    stream, i.e. for the previous step's drafter append, before the host goes on). Into one
    device buffer per shape: the draft graph reads start and roots where they are."""

    def __init__(self):
        self._host: dict[tuple[int, int], torch.Tensor] = {}  # (rows, batch) -> pinned buffer
        self._dev: dict[torch.Size, torch.Tensor] = {}  # its device copy, one buffer per shape

    def copy(self, rows: list, device: torch.device) -> torch.Tensor:
        """rows (lists of ints, one per request each) as a [rows, batch] long tensor on `device`."""
        host = self._pinned(len(rows), len(rows[0]), device)
        host.copy_(torch.tensor(rows, dtype=torch.long))
        dev = self._dev.get(host.shape)
        if dev is None:
            dev = self._dev[host.shape] = torch.empty(host.shape, dtype=torch.long, device=device)
        dev.copy_(host, non_blocking=True)
        return dev

    def _pinned(self, rows: int, batch: int, device: torch.device) -> torch.Tensor:
        """[rows, batch] host buffer: pinned on CUDA. Reused every step: the previous step's
        copy out of it finished before its host copy."""
        buf = self._host.get((rows, batch))
        if buf is None:
            pin = device.type == "cuda"
            buf = self._host[rows, batch] = torch.empty(rows, batch, dtype=torch.long, pin_memory=pin)
        return buf


@dataclass
class PhaseTimer:
    """Wall time per phase of a step (synchronising the device when enabled)."""

    enabled: bool = False
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def mark(self, device: torch.device) -> float:
        if self.enabled and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def add(self, phase: str, t0: float, device: torch.device) -> float:
        t1 = self.mark(device)
        if self.enabled:
            self.seconds[phase] += t1 - t0
        return t1


@dataclass
class HostRow:
    """What the host learns about one request after a step."""

    tokens: list[int]  # accepted drafts then the bonus, -1 pads
    accepted: int
    drafted: int
    depth: int


def read_rows(arr: np.ndarray, nodes: int, auto: bool) -> tuple[list[HostRow], tuple | None]:
    """The step's copy [B, W] (decoder.SpecDecoder._tail's packed, less the touched and logged
    columns): a HostRow per request; under the auto budget also (depths [B, nodes], scores
    float32 [B, nodes], the walk's path [B, max depth + 1], accepted [B]) for the sizing."""
    w = (arr.shape[1] - 3) if not auto else (arr.shape[1] - 3 - 2 * nodes) // 2
    rows = [HostRow(r[:w], r[w], r[w + 1], r[w + 2]) for r in arr[:, : w + 3].tolist()]
    if not auto:
        return rows, None
    o = w + 3
    depths, path = arr[:, o:o + nodes].copy(), arr[:, o + nodes:o + nodes + w].copy()
    scores = arr[:, o + nodes + w:o + 2 * nodes + w].astype(np.int32).view(np.float32)
    return rows, (depths, scores, path, arr[:, w].copy())
