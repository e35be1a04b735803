"""How the engine hands out KV pages: what it refuses, queues and gives back under churn."""

from __future__ import annotations

import pytest

from helpers.hf_checkpoints import write_checkpoint
from treeflash import LLM, SamplingParams
from treeflash.kvcache.defrag import is_contiguous


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "m")


def test_graph_scratch_pages_count_against_a_request(ckpt):
    """Graphs hold scratch pages for good: a request needing the whole pool could never be
    admitted, so it must be refused at once instead of waiting in the queue forever."""
    llm = LLM(ckpt, device="cpu", dtype="float32", page_size=8, kv_cache_tokens=16,
              max_model_len=256, cuda_graphs=True)  # CPU: the same static buffers, run eagerly
    pool, engine = llm.pool, llm.engine
    usable = pool.num_free_pages  # a fresh engine: all but the scratch pages
    assert usable < pool.num_pages
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    too_long = [5] * (pool.num_pages * pool.page_size - engine.verify_width - 4)
    with pytest.raises(ValueError, match=f"pool has only {usable} for requests"):
        engine.validate(too_long, params)
    fits = [5] * (usable * pool.page_size - engine.verify_width - 4)
    assert len(llm.generate(fits, params)[0].token_ids) == 4
    assert pool.num_free_pages == usable


def test_interrupted_generate_frees_its_requests(ckpt):
    """Ctrl-C (or a failed step) inside generate aborts its requests: their pages come back
    and they do not run on inside the next generate."""
    llm = LLM(ckpt, device="cpu", dtype="float32", page_size=4, max_model_len=256)
    engine, free = llm.engine, llm.pool.num_free_pages
    step, calls = engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted_step
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5] * 9, [6] * 21], params)
    assert not engine.has_unfinished() and llm.pool.num_free_pages == free
    engine.step = step
    assert len(llm.generate([7] * 3, params)[0].token_ids) == 20
    assert llm.pool.num_free_pages == free


@pytest.mark.slow
def test_request_admitted_in_pieces_is_made_contiguous(ckpt):
    """D arrives when no free run fits it and gets two pieces; once B finishes next to one of
    them, the engine moves D into one run between steps, and its output is unchanged."""
    llm = LLM(ckpt, device="cpu", dtype="float32", page_size=4, kv_cache_tokens=96, max_model_len=64)
    engine, pool = llm.engine, llm.pool
    greedy = {n: SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 8, 11, 23)}
    # pages (prompt + max_tokens + 1 tokens): A 4 [0, 4), B 6 [4, 10), C 8 [10, 18); 6 left
    a, b, c = (engine.add_request([5 + i] * n, greedy[m]) for i, (n, m) in enumerate([(10, 2), (12, 8), (20, 11)]))
    while not a.finished:
        engine.step()
    d_prompt = [9, 3, 7, 7, 2, 8, 4, 6]
    d = engine.add_request(d_prompt, greedy[23])  # 8 pages: the 6 at the end + 2 of A's 4
    engine.step()
    assert not is_contiguous(d.pages)
    while not b.finished:
        engine.step()
    assert not d.finished and is_contiguous(d.pages)  # moved into B's pages and A's other 2
    while engine.has_unfinished():
        engine.step()
    assert pool.num_free_pages == pool.num_pages
    assert d.output_ids == llm.generate(d_prompt, greedy[23])[0].token_ids
    assert c.output_ids == llm.generate([7] * 20, greedy[11])[0].token_ids
