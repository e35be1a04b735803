"""The overlapped step's driver (on CUDA by default): before the host reads a step's copy, the
device gets the drafter's append of the step's accepted rows, masked to a count only the device
knows, and the next step's tree (`PendingDraft`), so the device drafts step i+1 while the host
processes step i. speculative/decoder.py's SpecDecoder owns an `OverlapDriver` and calls it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from treeflash.runtime import DEFAULT, RuntimeOptions
from treeflash.speculative.host import HostCopy, PhaseTimer
from treeflash.speculative.tree import DraftTree

if TYPE_CHECKING:
    from treeflash.speculative.budget import Plan
    from treeflash.speculative.target import SpecTarget, StepBatch

# Tests set this to True or False to run either step whatever the overlap option says.
OVERLAP: bool | None = None


def overlap_enabled(device: torch.device | str = "cuda", options: RuntimeOptions = DEFAULT) -> bool:
    """Whether a SpecDecoder on `device` overlaps its steps: on CUDA by default, the runtime
    option overlap=0 / =1 forces it off / on anywhere. On the CPU the "device" work
    runs in the host's own thread, so there is nothing to overlap, and the masked append's fixed
    block is only more work (the shipped pair on this project's 2-core CPU, one pass each,
    budgets 8 / 16 / 32: 101 / 96 / 106 decode tok/s overlapped against 121 / 107 / 92
    sequential, within this box's drift; sequential kept).
    Lossless on the CPU (tests/engine/test_overlap.py) and on the H200 in float32 (same tokens
    as spec off). Default since 2026-12-03 (results/h200-20261203-overlap-ab,
    shipped pair, bf16, 5 rounds each, same call): ddtree-31 5994 decode tok/s overlapped
    against 5399 sequential (2.88x / 2.68x spec off), ddtree-15 5753 / 5190. An earlier run (2026-12-03) had
    measured no gain (2.07x / 2.12x): then the device's own step was ~1.1 ms and the host's
    share hidden behind it small; with ~70 fewer launches a step the host had become the
    critical path."""
    if OVERLAP is not None:
        return OVERLAP
    if options.overlap is not None:
        return options.overlap
    return torch.device(device).type == "cuda"


@dataclass
class PendingDraft:
    """The next step's tree, queued on the device by the overlapped step before the host
    had processed the step (so before it knew which requests finish)."""

    reqs: list  # the requests it was proposed for, in order
    budget: int
    tree: DraftTree
    build: int = 0  # nodes built (> budget: a scoring build)

    def serves(self, reqs) -> bool:
        """Only the very same requests in the same order may use it: a finished or a newly
        joined request changes every row's place (and, at batch > 1, the padding)."""
        return same_requests(reqs, self.reqs)


def same_requests(a: list, b: list) -> bool:
    """The very same request objects, in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class NextStep(Protocol):
    """What the driver asks of the step that owns it (SpecDecoder): the next step's plan and
    its tree."""

    auto: bool

    def plan_next(self, target: SpecTarget, batch: list) -> Plan: ...

    def draft(self, target: SpecTarget, caches, roots, start, budget: int, *, queued: bool = False,
              build: int | None = None) -> DraftTree: ...


def append_accepted(drafter, draft_graphs, caches: list, feats: torch.Tensor, start: torch.Tensor,
                    first: torch.Tensor, counts: torch.Tensor) -> None:
    """Each request's append of its accepted rows to its drafter cache, queued on the device:
    a fixed block of feats [B, D+1, F] from start [B] into the slots first [layers, B] reserved,
    masked to counts [B] (accepted + 1, on the device). draft_graphs: the batch-1 draft graphs
    when the engine runs one request (their append replays), else None (the drafter's)."""
    if draft_graphs is not None and len(caches) == 1 and draft_graphs.handles(caches):
        draft_graphs.extend_masked(caches[0], feats[0], start[:1], first[:, 0], counts[:1])
    elif hasattr(drafter, "extend_static_batch"):  # fc, norm and k/v GEMM once for the batch
        drafter.extend_static_batch(caches, feats, start, first, counts)
    else:
        for i, cache in enumerate(caches):
            drafter.extend_static(cache, feats[i], start[i:i + 1], first[:, i], counts[i:i + 1])


class OverlapDriver:
    """The overlapped step's device work and the state it leaves for the next step: the tree
    it queued (`pending`) and, under the auto budget, the plan it made for the whole batch
    (`planned`). The next step takes either only if it runs the very same requests; otherwise
    it is dropped, having written nothing but its own output buffers."""

    def __init__(self, drafter, timer: PhaseTimer, step: NextStep):
        self.drafter, self.timer, self.step = drafter, timer, step
        self.pending: PendingDraft | None = None
        self.planned: tuple[list, Plan] | None = None
        self._host_out: dict[torch.Size, torch.Tensor] = {}  # pinned buffers of the copy

    def start_copy(self, packed: torch.Tensor) -> HostCopy:
        """The step's device-to-host copy, queued ahead of the work queue_next adds."""
        return HostCopy.start(packed, self._host_out)

    def take(self, reqs, budget: int, build: int) -> PendingDraft | None:
        """The tree the last step queued, if it serves these requests at this budget and build;
        dropped either way."""
        pending, self.pending = self.pending, None
        if pending is None or (pending.budget, pending.build) != (budget, build) or not pending.serves(reqs):
            return None
        return pending

    def take_plan(self) -> tuple[list, Plan] | None:
        """The (batch, plan) the last step made for the next; dropped."""
        planned, self.planned = self.planned, None
        return planned

    def forget(self, req) -> None:
        """A finished request: what was queued or planned for a batch with it will not run."""
        if self.pending is not None and any(r is req for r in self.pending.reqs):
            self.pending = None
        if self.planned is not None and any(r is req for r in self.planned[0]):
            self.planned = None

    def queue_next(self, target: SpecTarget, reqs, states, packed, feats, start, first, step: StepBatch,
                   draft_graphs=None) -> None:
        """The overlapped step's device work, queued before the host reads `packed`: each
        request's append of its accepted rows (a fixed block masked to the count in packed,
        on the device), then the next step's tree from the bonus tokens and start positions
        that are on the device too, unless a request is sure to finish at this step (max
        tokens: the batch will change and the tree would be dropped). Under the auto budget
        the next step is planned now, for the whole batch (from what the host knows before
        this step's copy), and the tree queued if it gives these very requests a tree.
        draft_graphs: the batch-1 draft graphs when the engine runs one request, else None."""
        dev, t = target.device, self.timer
        t0 = t.mark(dev)
        width = feats.shape[1]  # max depth + 1: packed's token columns, then the accepted count
        accepted = packed[:, width]  # [B]
        counts = accepted + 1
        append_accepted(self.drafter, draft_graphs, [s.cache for s in states], feats, start, first, counts)
        t.add("drafter_extend", t0, dev)
        batch = step.reqs
        if any(len(r.output_ids) + 1 >= r.params.max_tokens for r in batch):
            return
        plan = self.step.plan_next(target, batch)
        if self.step.auto:  # the next step's contexts are not known yet: this step's price it
            self.planned = (list(batch), plan)
        if not same_requests([batch[i] for i in plan.spec], reqs) or any(s.behind for s in states):
            return  # the next tree is for other requests: drafted when its step comes
        roots = packed[:, :width].gather(1, accepted[:, None])[:, 0]
        tree = self.step.draft(target, [s.cache for s in states], roots, start + counts, plan.budget,
                               queued=True, build=plan.build)
        self.pending = PendingDraft(list(reqs), plan.budget, tree, plan.build)
