"""TP 2 over an fp8_e4m3 KV cache equals TP 1 over it: the followers build the same rows
(INIT carries the row format), greedy tokens with and without DDTree speculation."""

from __future__ import annotations

import pytest
import torch

from helpers.tp import MAX_TOKENS, prompts
from treeflash import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def fp8_tp1(target):
    llm = LLM(target, device="cpu", dtype="float32", page_size=8, kv_cache_dtype="fp8_e4m3")
    ps = prompts()
    return ps, [o.token_ids for o in llm.generate(ps, GREEDY)]


def test_tp2_fp8_equals_tp1_fp8(target, drafter_path, fp8_tp1):
    ps, expected = fp8_tp1
    for drafter in (None, drafter_path):
        llm = LLM(target, drafter, device="cpu", dtype="float32", page_size=8, tp=2,
                  kv_cache_dtype="fp8_e4m3", spec="ddtree" if drafter else "off", tree_budget=16)
        try:
            assert llm.pool.kv.dtype == torch.uint8
            assert [o.token_ids for o in llm.generate(ps, GREEDY)] == expected
        finally:
            llm.close()
        assert all(p.exitcode == 0 for p in llm.engine.executor.ctx.followers)
