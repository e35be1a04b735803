"""The auto tree budget's plain steps (speculative/budget.py's "off"): a decode step without a
tree for the requests no tree pays for, their tapped features held until the drafter's cache
takes them in, in one call, before the request's next tree (`catch_up`)."""

from __future__ import annotations

import torch

from treeflash.sampling import choose_tokens_batch
from treeflash.speculative.target import SpecTarget

# plain steps whose tapped features a request holds at most before its drafter cache takes them
# in (each step's are a [batch, taps x hidden] tensor: ~4.6 MB a step at Kimi K2's 64 x 5 x 7168);
# one append of 32 rows costs about what one of 16 does (the drafter reads its weights once)
CATCH_UP_EVERY = 32


def catch_up(drafter, states) -> None:
    """Append the features of a request's plain steps to its drafter cache, in one call,
    before its next tree (a request decoding plainly costs no drafter work a step)."""
    for s in states:
        if s.behind:
            feats = torch.cat([f[row:row + 1] for f, row, _ in s.behind])  # [T, F]
            first = s.behind[0][2]
            drafter.extend(s.cache, feats, torch.arange(first, first + feats.shape[0], device=feats.device))
            s.behind.clear()


def plain_step(target: SpecTarget, drafter, reqs, taps: tuple[int, ...]) -> list[list[int]]:
    """One decode step without a tree for these requests (the auto budget's "off"), as
    Engine._decode runs it, with the tap layers' features kept for the catch-up; one read."""
    states = [r.spec_state for r in reqs]
    host = torch.tensor([[s.bonus, r.num_cached] for r, s in zip(reqs, states, strict=True)], dtype=torch.long)
    ids, positions = host.to(target.device, non_blocking=True).split(1, dim=1)  # [B, 1] each
    hidden, taps = target.forward(reqs, ids, positions, positions[:, 0], taps=taps, graphable=True)
    logits = target.logits(hidden[:, 0], float32=False)
    tokens = choose_tokens_batch(logits, [r.params for r in reqs], [r.generator for r in reqs])
    feats = taps[:, 0].clone()  # [B, F]: a graph's static output, overwritten by the next forward
    new = tokens.tolist()
    for i, (req, state) in enumerate(zip(reqs, states, strict=True)):
        state.behind.append((feats, i, req.num_cached))
        req.num_cached += 1
        state.bonus = new[i]
        state.metrics.record_plain()
        for listener in target.spec_listeners:
            listener(req, 0, 0, 0)
    catch_up(drafter, [s for s in states if len(s.behind) >= CATCH_UP_EVERY])  # bounds what is held
    return [[t] for t in new]
