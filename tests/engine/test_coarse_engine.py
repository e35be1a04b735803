"""Pages smaller than the verify kernel's 64-row tile (page_size 1: the incident's layout) are
read as 64-row pages when a batch's requests lie in aligned runs (kvcache.coarse): the kernels
get page_size 64, the outputs are those of a page-64 engine, and a batch that cannot be read so
(a short request placed anywhere, the scattered mode, coarse views off) gets the pages as they are."""

from __future__ import annotations

import pytest

from spec_helpers import prompts
from treeflash import LLM, SamplingParams, kernels

GREEDY = SamplingParams(max_tokens=30, ignore_eos=True)


@pytest.fixture
def page_rows(monkeypatch):
    """Rows a page of every KV cache the attention kernel was given, in call order."""
    seen: list[int] = []
    real = kernels.mla_verify_attention

    def spy(q, kv_cache, *a, **kw):
        seen.append(kv_cache.shape[1])
        return real(q, kv_cache, *a, **kw)

    monkeypatch.setattr(kernels, "mla_verify_attention", spy)
    return seen


def long_prompts():
    """Three prompts whose reservations (prompt + 30 + 1) are >= 64 tokens: aligned runs at page 1."""
    return [(p * 64)[:40 + 3 * i] for i, p in enumerate(prompts()[:3])]


def run(target, **kw):
    llm = LLM(target, device="cpu", dtype="float32", **kw)
    return llm, [o.token_ids for o in llm.generate(long_prompts(), GREEDY)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_small_pages_in_aligned_runs_are_read_as_64_row_pages(target, page_rows, page_size):
    _, expected = run(target, page_size=64)
    page_rows.clear()
    llm, got = run(target, page_size=page_size)
    assert got == expected
    assert page_rows and set(page_rows) == {64}, sorted(set(page_rows))
    f = 64 // page_size
    assert llm.pool.coarse_factor == f and llm.pool.allocator.align == f


@pytest.mark.parametrize("how", ["coarse off", "scattered"])
def test_page_1_batches_that_cannot_be_coarse_get_the_pages_as_they_are(target, page_rows, how):
    _, expected = run(target, page_size=64)
    page_rows.clear()
    llm = LLM(target, device="cpu", dtype="float32", page_size=1, scattered_kv=how == "scattered")
    llm.engine.executor.coarse = how != "coarse off"
    assert [o.token_ids for o in llm.generate(long_prompts(), GREEDY)] == expected
    assert set(page_rows) == {1}


def test_a_short_request_makes_its_batch_fine_and_its_own_run_coarse_again(target, page_rows):
    """A request shorter than a coarse page is placed wherever it fits (no gap is left for it),
    so a batch holding it reads the pages as they are; alone, the long ones read coarse again."""
    llm = LLM(target, device="cpu", dtype="float32", page_size=1)
    ref = LLM(target, device="cpu", dtype="float32", page_size=64)
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = llm.engine
    reqs = [engine.add_request(p, GREEDY) for p in long_prompts()[:2]]
    small = engine.add_request([5, 6, 7], short)  # 3 + 4 + 1 = 8 pages: not aligned
    engine.step()  # admits all three
    assert small.pages[0] % 64 != 0 and all(r.pages[0] % 64 == 0 for r in reqs)
    while not small.finished:
        engine.step()
    assert 1 in page_rows  # the batch with the short request
    page_rows.clear()
    while engine.has_unfinished():
        engine.step()
    assert set(page_rows) == {64}  # the two long ones alone
    refs = [o.token_ids for o in ref.generate(long_prompts()[:2], GREEDY)]
    assert [r.output_ids for r in reqs] == refs
    assert small.output_ids == ref.generate([5, 6, 7], short)[0].token_ids


@pytest.mark.parametrize("graphs", [False, True])
def test_speculative_steps_at_page_1_are_lossless_through_the_coarse_view(target, drafter_path, page_rows,
                                                                          graphs):
    """Tree verify, commit of the accepted rows, and (eager) graphs with padding rows in their
    scratch pages: all through the coarse view, and the greedy output is the target's own."""
    _, expected = run(target, page_size=64)
    page_rows.clear()
    llm = LLM(target, drafter_path, spec="ddtree", tree_budget=8, device="cpu", dtype="float32", page_size=1,
              cuda_graphs=graphs, max_running=4)
    out = llm.generate(long_prompts(), GREEDY)
    assert [o.token_ids for o in out] == expected
    assert set(page_rows) == {64}
    if graphs:
        steps = llm.engine.executor.graphs.steps
        assert steps and {k.factor for k in steps} == {64}
        assert llm.pool.num_free_pages == llm.pool.num_pages - len(llm.engine.executor.graphs.scratch_pages)
