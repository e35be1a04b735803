"""Warming an engine: every CUDA graph its steps may use, captured before a served or timed step.

A graph is keyed by (batch bucket, rows per request, mask, taps, page-table bucket), and a
speculative step adds its draft and tail graphs (batch 1) per budget and build. Under
tree_budget="auto" a step may verify any bucket, built as itself or wide (a scoring step), or
decode plainly (with the drafter's taps, or without: spec off's forward); and a batch shrinks
through every smaller bucket as its requests finish. A graph met for the first time mid-stream
is captured inside that step (the first GPU run, results/h100-20261207-spec-cost: `bench serve`
at 64 requests and budget 31 spent 12.4 s on 96 tokens a request, auto's timed steps carried
0.3 s captures). So a warm-up runs, for each batch bucket up to the largest batch and each plan
the engine may run, a few steps of throw-away requests of the served prompt length: kernels
compile, graphs are captured (a tail graph at its second use), the cost model prices each plan's
step; the sizing's calibration learns nothing from them (forced plans record no walk).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from treeflash.engine.graphs import batch_buckets
from treeflash.graph_capture import capture_seconds
from treeflash.sampling import SamplingParams

STEPS_PER_PLAN = 3  # a tail graph is captured at its key's second use, replayed from the third
# At batch > 1 no draft or tail graph exists: the first step captures the verify graph and drafts
# eagerly, the second takes the tree the first queued (the overlapped step), and that is every path
# (a third step was a third of `bench serve`'s warm-up at 64 requests for nothing new).
BATCH_STEPS_PER_PLAN = 2


@contextmanager
def forced(spec, plan: tuple[int, int] | None) -> Iterator[None]:
    """Every step of `spec` (a SpecDecoder, or None) runs `plan` = (budget, build) (budget 0:
    plainly) while inside; None: its own plans."""
    if spec is None or plan is None:
        yield
        return
    spec.forced_budget, spec.forced_build = plan
    try:
        yield
    finally:
        spec.forced_budget = spec.forced_build = None


def warm_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch buckets a batch of up to max_batch requests passes through as it shrinks."""
    return tuple(b for b in batch_buckets(max(max_batch, 1)) if b <= max_batch) or (1,)


def warm(engine, prompts: Sequence[Sequence[int]], max_tokens: int, batches: Sequence[int] = (1,),
         plans: Sequence | None = None, steps: int = STEPS_PER_PLAN) -> dict:
    """For each batch size in `batches` and each plan (default: every plan the engine's decoder
    may run, `SpecDecoder.warmup_plans`), admit that many of `prompts` (cycled) with max_tokens
    (the served reservation: the same page-table bucket), run them past prefill, then `steps`
    steps under the plan (the default: BATCH_STEPS_PER_PLAN at batch > 1), and abort them.
    Returns {"seconds", "capture_s", "rounds"}."""
    spec = engine.spec
    if plans is None:
        plans = spec.warmup_plans if spec is not None else (None,)
    t0, c0, rounds = time.perf_counter(), capture_seconds(), 0
    for batch in batches:
        for plan in plans:
            n = steps if batch == 1 or steps != STEPS_PER_PLAN else BATCH_STEPS_PER_PLAN
            _round(engine, [prompts[i % len(prompts)] for i in range(batch)], max_tokens, spec, plan, n)
            rounds += 1
    return {"seconds": time.perf_counter() - t0, "capture_s": capture_seconds() - c0, "rounds": rounds}


def _round(engine, prompts, max_tokens: int, spec, plan, steps: int) -> None:
    """One batch under one plan. The prompts are prefilled together in one step (the engine's
    chunk raised to hold them all), so the plan's steps run the whole batch from its first."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    saved = engine.prefill_chunk
    engine.prefill_chunk = max(saved, sum(len(p) for p in prompts))
    reqs = []
    try:
        with forced(spec, plan):
            reqs = [engine.add_request(list(p), params) for p in prompts]
            while engine.has_unfinished() and not all(r.output_ids or r.finished for r in reqs):
                engine.step()
            for _ in range(steps):
                if not engine.has_unfinished() or any(r.finished for r in reqs):
                    break  # the batch would shrink: its smaller buckets have rounds of their own
                engine.step()
    finally:
        engine.prefill_chunk = saved
        for r in reqs:
            if not r.finished:
                engine.abort(r.request_id)
