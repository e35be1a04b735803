"""The auto tree budget's plain steps (speculative/budget.py's "off"): a decode step without a
tree for the requests no tree pays for. A tapped step holds the tap layers' features until the
drafter's cache takes them in, in one call, before the request's next tree (`catch_up`); an
untapped one (a plain spell far from its next tree) is spec off's own forward, and its
position is a gap in the drafter's cache."""

from __future__ import annotations

import torch

from treeflash.sampling import choose_tokens_batch
from treeflash.speculative.target import SpecTarget

# plain steps whose tapped features a request holds at most before its drafter cache takes them
# in (each step's are a [batch, taps x hidden] tensor: ~4.6 MB a step at Kimi K2's 64 x 5 x 7168);
# one append of 32 rows costs about what one of 16 does (the drafter reads its weights once)
CATCH_UP_EVERY = 32


def catch_up(drafter, states) -> None:
    """Append the features of a request's tapped plain steps to its drafter cache before its
    next tree (a request decoding plainly costs no drafter work a step): one call per run of
    consecutive positions (untapped steps between two runs leave a gap; an append's positions
    must be consecutive)."""
    for s in states:
        if s.behind:
            for first, rows in _runs(s.behind):
                feats = torch.cat([f[row:row + 1] for f, row, _ in rows])  # [T, F]
                drafter.extend(s.cache, feats, torch.arange(first, first + feats.shape[0], device=feats.device))
            s.behind.clear()


def _runs(behind: list) -> list[tuple[int, list]]:
    """(first position, entries) of each run of consecutive positions, in order."""
    runs: list[tuple[int, list]] = []
    for entry in behind:
        pos = entry[2]
        if runs and runs[-1][0] + len(runs[-1][1]) == pos:
            runs[-1][1].append(entry)
        else:
            runs.append((pos, [entry]))
    return runs


def plain_step(target: SpecTarget, drafter, reqs, taps: tuple[int, ...]) -> list[list[int]]:
    """One decode step without a tree for these requests (the auto budget's "off"), as
    Engine._decode runs it (taps empty: the very same forward), with the tap layers' features
    kept for the catch-up; one read."""
    states = [r.spec_state for r in reqs]
    host = torch.tensor([[s.bonus, r.num_cached] for r, s in zip(reqs, states, strict=True)], dtype=torch.long)
    ids, positions = host.to(target.device, non_blocking=True).split(1, dim=1)  # [B, 1] each
    if taps:
        hidden, tapped = target.forward(reqs, ids, positions, positions[:, 0], taps=taps, graphable=True)
    else:
        hidden, tapped = target.forward(reqs, ids, positions, positions[:, 0], graphable=True)
    logits = target.logits(hidden[:, 0], float32=False)
    tokens = choose_tokens_batch(logits, [r.params for r in reqs], [r.generator for r in reqs])
    # [B, F]: a graph's static output, overwritten by the next forward
    feats = tapped[:, 0].clone() if taps else None
    new = tokens.tolist()
    for i, (req, state) in enumerate(zip(reqs, states, strict=True)):
        if feats is not None:
            state.behind.append((feats, i, req.num_cached))
        req.num_cached += 1
        state.bonus = new[i]
        state.metrics.record_plain()
        for listener in target.spec_listeners:
            listener(req, 0, 0, 0)
    if feats is not None:
        catch_up(drafter, [s for s in states if len(s.behind) >= CATCH_UP_EVERY])  # bounds what is held
    return [[t] for t in new]
