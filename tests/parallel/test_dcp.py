"""Decode context parallelism equals one rank: DCP 2 and DCP 4 inside TP 4 (gloo, CPU) give TP 1's
greedy tokens, with and without DDTree / DFlash speculation, its logits within fp32 rounding, with
requests dealt over many pages (page size 2: a 50-token request spans 25 pages), prefilled in
chunks, and one request defragmented mid-way (its pages moved on every rank by MOVE steps)."""

from __future__ import annotations

import pytest
import torch
from tp_helpers import MAX_TOKENS, VOCAB

from treeflash import LLM, SamplingParams
from treeflash.engine.engine import Engine
from treeflash.kvcache.defrag import compact
from treeflash.spec.decoder import make_spec_decoder
from treeflash.spec.testing_drafters import RandomDrafter

LAYOUTS = [(4, 2), pytest.param((4, 4), marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=LAYOUTS, ids=["tp4-dcp2", "tp4-dcp4"])
def llm(request, target):
    tp, dcp = request.param
    llm = LLM(target, device="cpu", dtype="float32", page_size=2, prefill_chunk=8, tp=tp, dcp=dcp)
    assert llm.model.parallel.dcp_size == dcp and llm.pool.dcp == dcp
    yield llm
    llm.close()
    assert all(p.exitcode == 0 for p in llm.engine.executor.ctx.followers)


def engine_for(llm, drafter=None, mode="ddtree", budget=16):
    spec = None if drafter is None else make_spec_decoder(llm.model, drafter, mode, budget, llm.device, llm.dtype)
    return Engine(llm.model, llm.pool, llm.tokenizer, max_model_len=llm.max_model_len, spec=spec,
                  prefill_chunk=8, executor=llm.engine.executor)


def run(engine, ps, on_step=None, max_tokens=MAX_TOKENS):
    reqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in ps]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if on_step is not None:
            on_step(steps, reqs)
    return [r.output_ids for r in reqs]


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
    assert run(engine_for(llm, drafter, mode, budget), ps) == expected
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

    assert run(engine_for(llm, drafter_path, "ddtree", 8), ps[:1], defrag) == expected[:1]
    assert moved and moved[0] > 0


@pytest.mark.slow
def test_bench_rig_and_doctor_under_dcp2(target, drafter_path, capsys):
    """`bench sweep` / `doctor --tp 2 --dcp 2`: the rig's engines run on the DCP group and decode what
    one process decodes; doctor's kv_capacity counts the pool over both ranks."""
    from treeflash.bench.presets import load_rig
    from treeflash.bench.sweep import RunConfig, decode_run
    from treeflash.cli import main

    rc = RunConfig([40], ["off", "ddtree"], max_tokens=10, fill="prefill", acceptance="drafter", progress=False)
    outs = []
    for tp, dcp in ((1, 1), (2, 2)):
        rig = load_rig(str(target), str(drafter_path), None, torch.device("cpu"), torch.float32, page_size=4,
                       tree_budget=8, tp=tp, dcp=dcp)
        try:
            assert rig.dcp == dcp
            outs.append([decode_run(rig, 40, mode, rc).token_ids for mode in ("off", "ddtree")])
        finally:
            rig.close()
    assert outs[1] == outs[0]
    rc = main(["doctor", "--model", str(target), "--drafter", str(drafter_path), "--tp", "2", "--dcp", "2",
               "--device", "cpu", "--dtype", "float32", "--context", "40", "--page-size", "4", "--tree-budget", "8"])
    out = capsys.readouterr().out
    assert "(tp 2, ep 1, dcp 2)" in out and "crashed" not in out, out
    assert "dcp 2: a rank holds" in out and "2x one rank's" in out, out
    assert rc in (0, 1)


@pytest.mark.slow
def test_tp8_dcp8_equals_one_rank(tmp_path):
    """A TP 8 world (8 heads, one a rank) with every rank's cache share its own: DCP 8."""
    from tp_helpers import prompts

    from hf_checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / "m8", initializer_range=0.3, q_lora_rank=24, num_attention_heads=8,
                            num_key_value_heads=8)
    ps = prompts(2)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    one = LLM(path, device="cpu", dtype="float32", page_size=8)
    expected = [o.token_ids for o in one.generate(ps, params)]
    logits = one.score(ps[0] + expected[0])
    llm = LLM(path, device="cpu", dtype="float32", page_size=1, prefill_chunk=8, tp=8, dcp=8)
    try:
        assert [o.token_ids for o in llm.generate(ps, params)] == expected
        torch.testing.assert_close(llm.score(ps[0] + expected[0], chunk_size=5), logits, rtol=1e-5, atol=1e-4)
        drafter = RandomDrafter(VOCAB, 6, seed=2, target_layer_ids=(0, 2))
        assert run(engine_for(llm, drafter, "ddtree", 8), ps, max_tokens=12) == expected
    finally:
        llm.close()
