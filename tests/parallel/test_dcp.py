"""Decode context parallelism equals one rank: DCP 2 and DCP 4 inside TP 4 (gloo, CPU) give TP 1's
greedy tokens, with and without DDTree / DFlash speculation, its logits within fp32 rounding, with
requests dealt over many pages (page size 2: a 50-token request spans 25 pages), prefilled in
chunks, and one request defragmented mid-way (its pages moved on every rank by MOVE steps)."""

from __future__ import annotations

import pytest
import torch

from helpers.tp import MAX_TOKENS, VOCAB, dcp_engine, run_engine
from treeflash import LLM, SamplingParams
from treeflash.kvcache.defrag import compact
from treeflash.speculative.testing_drafters import RandomDrafter

LAYOUTS = [(4, 2), pytest.param((4, 4), marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=LAYOUTS, ids=["tp4-dcp2", "tp4-dcp4"])
def llm(request, target):
    tp, dcp = request.param
    llm = LLM(target, device="cpu", dtype="float32", page_size=2, prefill_chunk=8, tp=tp, dcp=dcp)
    assert llm.model.parallel.dcp_size == dcp and llm.pool.dcp == dcp
    yield llm
    llm.close()
    assert all(p.exitcode == 0 for p in llm.engine.executor.ctx.followers)


def test_greedy_and_logits_equal_one_rank(llm, reference):
    ps, expected, logits = reference
    free = llm.pool.num_free_pages
    outs = llm.generate(ps, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert llm.pool.num_free_pages == free
    got = llm.score(ps[0] + expected[0], chunk_size=7)
    torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind, mode, budget", [("random", "ddtree", 16), ("real", "ddtree", 8),
                                                ("real", "dflash", None)])
def test_speculative_greedy_equals_one_rank(llm, reference, drafter_path, kind, mode, budget):
    ps, expected, _ = reference
    drafter = RandomDrafter(VOCAB, 6, seed=1, target_layer_ids=(0, 2)) if kind == "random" else drafter_path
    free = llm.pool.num_free_pages
    assert run_engine(dcp_engine(llm, drafter, mode, budget), ps) == expected
    assert llm.pool.num_free_pages == free


def test_defragmented_mid_way_equals_one_rank(llm, reference, drafter_path):
    """A request admitted behind a blocker; after 3 steps the blocker goes and compact moves the
    request's pages down the pool, on rank 0 and (MOVE) on every follower, between two steps."""
    ps, expected, _ = reference
    pool = llm.pool
    blocker = pool.allocator.allocate(7)
    moved = []

    def defrag(steps, reqs):
        if steps == 3:
            pool.release(blocker)
            moved.append(compact(pool, [reqs[0].pages]))

    assert run_engine(dcp_engine(llm, drafter_path, "ddtree", 8), ps[:1], defrag) == expected[:1]
    assert moved and moved[0] > 0

