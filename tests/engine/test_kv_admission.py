"""How the engine hands out KV pages: what it refuses, queues and gives back under churn."""

from __future__ import annotations

import pytest

from hf_checkpoints import write_checkpoint
from treeflash import LLM, SamplingParams


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
