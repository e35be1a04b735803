"""TP 2 / TP 4 / EP 2 (and TP 4 x EP 2) equal TP 1: greedy tokens with and without DDTree
speculation, and the logits within fp32 rounding. One process group per layout; the
speculative engines share its executor (the drafter lives on rank 0 only)."""

from __future__ import annotations

import pytest
import torch

from helpers.tp import MAX_TOKENS, VOCAB
from treeflash import LLM, SamplingParams
from treeflash.engine.engine import Engine
from treeflash.parallel.stats import moe_load
from treeflash.speculative.decoder import make_spec_decoder
from treeflash.speculative.testing_drafters import OracleDrafter, RandomDrafter

pytestmark = pytest.mark.slow

LAYOUTS = [(2, 1), (4, 1), (2, 2), (4, 2)]


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"tp{t}-ep{e}" for t, e in LAYOUTS])
def llm(request, target):
    tp, ep = request.param
    llm = LLM(target, device="cpu", dtype="float32", page_size=8, tp=tp, ep=ep)
    yield llm
    llm.close()
    assert all(p.exitcode == 0 for p in llm.engine.executor.ctx.followers)


def spec_engine(llm, drafter, mode="ddtree", budget=16):
    spec = make_spec_decoder(llm.model, drafter, mode, budget, llm.device, llm.dtype)
    return Engine(llm.model, llm.pool, llm.tokenizer, max_model_len=llm.max_model_len, spec=spec,
                  executor=llm.engine.executor)


def run(engine, ps):
    reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in ps]
    while engine.has_unfinished():
        engine.step()
    return [r.output_ids for r in reqs]


def test_greedy_and_logits_equal_tp1(llm, reference):
    ps, expected, logits = reference
    free = llm.pool.num_free_pages
    outs = llm.generate(ps, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert llm.pool.num_free_pages == free
    got = llm.score(ps[0] + expected[0], chunk_size=7)
    torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind, mode, budget", [
    ("random", "ddtree", 16), ("oracle", "ddtree", 8), ("real", "ddtree", 32), ("real", "dflash", None),
])
def test_speculative_greedy_equals_tp1(llm, reference, drafter_path, kind, mode, budget):
    ps, expected, _ = reference
    seqs = [p + e for p, e in zip(ps, expected)]
    drafter = {
        "random": lambda: RandomDrafter(VOCAB, 6, seed=1, target_layer_ids=(0, 2)),
        "oracle": lambda: OracleDrafter(VOCAB, 6, sequences=seqs, target_layer_ids=(1,)),
        "real": lambda: drafter_path,
    }[kind]()
    free = llm.pool.num_free_pages
    engine = spec_engine(llm, drafter, mode, budget)
    assert run(engine, ps) == expected
    assert llm.pool.num_free_pages == free


def test_moe_load_per_rank(llm, reference):
    ps, _, _ = reference
    llm.score(ps[1])
    load = moe_load(llm.model)
    par = llm.model.parallel
    assert (load["tp"], load["ep"]) == (par.tp_size, par.ep_size)
    n = len(ps[1]) * llm.config.num_experts_per_tok
    for layer in load["layers"]:
        assert sum(layer["tokens_per_expert"]) == n
        assert len(layer["tokens_per_rank"]) == par.tp_size
        # Each EP group's ranks all compute that group's pairs; the groups add up to n.
        assert sum(layer["tokens_per_rank"][:: par.moe_tp_size]) == n
        assert layer["rank_max_over_mean"] >= 1.0
