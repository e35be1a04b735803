"""Prefill across steps: a step computes at most `prefill_chunk` prompt tokens, requests past
their prefill decode meanwhile, the numbers are those of an uninterrupted prefill, and an abort
between two chunks frees the pages at once."""

from __future__ import annotations

import pytest
import torch

from treeflash import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 90, (n,), generator=g).tolist()


@pytest.mark.slow
def test_long_prefill_is_spread_over_steps_and_lossless(target):
    llm = LLM(target, device="cpu", dtype="float32", page_size=8, prefill_chunk=8)
    engine = llm.engine
    short, long = _prompt(5, 0), _prompt(45, 1)  # 45 = 5 chunks of 8 and one of 5
    a = engine.add_request(short, GREEDY)
    engine.step()  # a's whole prompt fits one chunk: its first token comes at once
    assert len(a.output_ids) == 1
    b = engine.add_request(long, GREEDY)
    cached = []
    while not b.output_ids:
        before = b.num_cached
        engine.step()
        cached.append(b.num_cached - before)
    assert cached == [8, 8, 8, 8, 8, 5]  # never more than one chunk a step
    assert len(a.output_ids) == 6  # a decoded once a step meanwhile (and finished)
    while engine.has_unfinished():
        engine.step()
    solo = LLM(target, device="cpu", dtype="float32", page_size=8, prefill_chunk=8)
    assert b.output_ids == solo.generate(long, GREEDY)[0].token_ids
    assert a.output_ids == solo.generate(short, GREEDY)[0].token_ids


def test_step_budget_is_whole_chunks_oldest_first(target):
    """Three 6-token prompts, chunk 8: one prompt a step (a second whole one would pass 8)."""
    llm = LLM(target, device="cpu", dtype="float32", page_size=8, prefill_chunk=8)
    reqs = [llm.engine.add_request(_prompt(6, s), GREEDY) for s in range(3)]
    firsts = []
    for _ in range(3):
        llm.engine.step()
        firsts.append([len(r.output_ids) > 0 for r in reqs])
    assert firsts == [[True, False, False], [True, True, False], [True, True, True]]


def test_abort_between_chunks_frees_the_pages(target):
    llm = LLM(target, device="cpu", dtype="float32", page_size=8, prefill_chunk=8)
    engine, pool = llm.engine, llm.pool
    req = engine.add_request(_prompt(40, 2), GREEDY)
    engine.step()
    assert req.num_cached == 8 and pool.num_free_pages < pool.num_pages
    assert engine.abort(req.request_id)
    assert req.finish_reason == "abort" and req.prefill_features == []
    assert pool.num_free_pages == pool.num_pages and not engine.has_unfinished()


def test_drafter_gets_the_whole_prompts_features(target, drafter_path, monkeypatch):
    """The drafter's context is the tapped features of every prompt position, in order,
    equal to those of the prompt computed in one go on the same chunk grid; and speculation
    stays lossless."""
    llm = LLM(target, drafter_path, spec="ddtree", tree_budget=4, device="cpu",
              dtype="float32", page_size=8, prefill_chunk=4)
    spec, seen = llm.engine.spec, []
    real = spec.on_prefill
    monkeypatch.setattr(spec, "on_prefill",
                        lambda engine, req, feats, first: (seen.append(feats.clone()),
                                                           real(engine, req, feats, first)))
    prompt = _prompt(19, 3)
    out = llm.generate(prompt, GREEDY)[0]
    plain = LLM(target, device="cpu", dtype="float32", page_size=8, prefill_chunk=4)
    assert out.token_ids == plain.generate(prompt, GREEDY)[0].token_ids
    ref = llm.engine.add_request(prompt, GREEDY)  # its pages reserved, never stepped
    llm.pool.grow(ref.pages, len(prompt) + 1)
    with torch.inference_mode():
        rows = list(llm.engine.prefill_rows(ref, prompt, taps=spec.tap_layers))
    assert len(rows) == 5 and len(seen) == 1 and seen[0].shape[0] == len(prompt)
    assert torch.equal(seen[0], torch.cat([tapped for _, tapped in rows]))
    llm.engine.abort(ref.request_id)
