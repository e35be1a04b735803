"""Pages smaller than the verify kernel's 64-row tile (page_size 1: the incident's layout) are
read as 64-row pages when a batch's requests lie in aligned runs (kvcache.coarse): the kernels
get page_size 64, the outputs are those of a page-64 engine, and a batch that cannot be read so
(a request placed off the grid under pressure, until the engine moves it; the scattered mode;
coarse views off) gets the pages as they are."""

from __future__ import annotations

import pytest

from helpers.spec import prompts
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


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_small_pages_in_aligned_runs_are_read_as_64_row_pages(target, page_rows, page_size):
    _, expected = run(target, page_size=64)
    page_rows.clear()
    llm, got = run(target, page_size=page_size)
    assert got == expected
    assert page_rows and set(page_rows) == {64}, sorted(set(page_rows))
    f = 64 // page_size
    assert llm.pool.coarse_factor == f and llm.pool.allocator.align == f


@pytest.mark.slow
@pytest.mark.parametrize("how", ["coarse off", "scattered"])
def test_page_1_batches_that_cannot_be_coarse_get_the_pages_as_they_are(target, page_rows, how):
    _, expected = run(target, page_size=64)
    page_rows.clear()
    llm = LLM(target, device="cpu", dtype="float32", page_size=1, scattered_kv=how == "scattered")
    llm.engine.executor.coarse = how != "coarse off"
    assert [o.token_ids for o in llm.generate(long_prompts(), GREEDY)] == expected
    assert set(page_rows) == {1}


@pytest.mark.slow
def test_a_short_request_starts_on_the_grid_and_its_batches_stay_coarse(target, page_rows):
    """A request shorter than a coarse page (3 + 4 + 1 = 8 pages at page 1) is placed at an
    aligned page too, so every batch it joins still reads 64-row pages."""
    llm = LLM(target, device="cpu", dtype="float32", page_size=1)
    ref = LLM(target, device="cpu", dtype="float32", page_size=64)
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = llm.engine
    reqs = [engine.add_request(p, GREEDY) for p in long_prompts()[:2]]
    small = engine.add_request([5, 6, 7], short)
    engine.step()  # admits all three
    assert all(r.pages[0] % 64 == 0 for r in [*reqs, small]) and not engine.fragmented
    while engine.has_unfinished():
        engine.step()
    assert set(page_rows) == {64}
    refs = [o.token_ids for o in ref.generate(long_prompts()[:2], GREEDY)]
    assert [r.output_ids for r in reqs] == refs
    assert small.output_ids == ref.generate([5, 6, 7], short)[0].token_ids


@pytest.mark.slow
def test_a_request_placed_off_the_grid_is_moved_onto_it_and_its_batch_reads_coarse_again(target, page_rows):
    """Under pressure (no free aligned start) a request lands off the grid: the batches it joins
    read page by page. Once an aligned run is free, the engine moves it there between steps, with
    its rows, and the batches read 64-row pages again; the outputs are page 64's."""
    llm = LLM(target, device="cpu", dtype="float32", page_size=1)
    ref = LLM(target, device="cpu", dtype="float32", page_size=64)
    short = SamplingParams(max_tokens=12, ignore_eos=True)
    engine, pool = llm.engine, llm.pool
    reqs = [engine.add_request(p, GREEDY) for p in long_prompts()[:2]]
    engine.step()
    free = pool.allocator.allocate(pool.num_free_pages)
    held = [p for p in free if p % 64 < 32]  # every aligned start is taken; 32-page holes stay
    pool.allocator.free([p for p in free if p % 64 >= 32])
    small = engine.add_request([5, 6, 7], short)
    engine.step()  # admitted off the grid
    assert small.pages[0] % 64 == 32 and small in engine.fragmented
    page_rows.clear()
    engine.step()
    assert set(page_rows) == {1}  # the three together: page by page
    pool.release(held)
    engine.step()  # still page by page; the move comes after it
    assert small.pages[0] % 64 == 0 and not engine.fragmented
    page_rows.clear()
    while engine.has_unfinished():
        engine.step()
    assert set(page_rows) == {64}
    refs = [o.token_ids for o in ref.generate(long_prompts()[:2], GREEDY)]
    assert [r.output_ids for r in reqs] == refs
    assert small.output_ids == ref.generate([5, 6, 7], short)[0].token_ids


@pytest.mark.slow
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
