"""The overlapped step's device-side pieces (speculative/decoder.py, on CUDA by default): the
drafter's append of a step's accepted rows masked to a count only the device knows, and the
next step's tree queued before the host has read this step's (`PendingDraft`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeflash.speculative.tree import DraftTree


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
        return len(reqs) == len(self.reqs) and all(a is b for a, b in zip(reqs, self.reqs, strict=True))


def append_accepted(drafter, draft_graphs, caches: list, feats: torch.Tensor, start: torch.Tensor,
                    first: torch.Tensor, counts: torch.Tensor) -> None:
    """Each request's append of its accepted rows to its drafter cache, queued on the device:
    a fixed block of feats [B, D+1, F] from start [B] into the slots first [layers, B] reserved,
    masked to counts [B] (accepted + 1, on the device). draft_graphs: the batch-1 draft graphs
    when the engine runs one request (their append replays), else None (the drafter's)."""
    for i, cache in enumerate(caches):
        args = (cache, feats[i], start[i:i + 1], first[:, i], counts[i:i + 1])
        if draft_graphs is not None and draft_graphs.handles([cache]):
            draft_graphs.extend_masked(*args)
        else:
            drafter.extend_static(*args)
