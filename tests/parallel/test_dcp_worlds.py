"""DCP outside test_dcp.py's module-scoped TP 4 groups (a process holds one group at a time): the
bench rig and doctor on a TP 2 x DCP 2 group, and a TP 8 x DCP 8 world (both slow: 35-70 s on 2 cores)."""

from __future__ import annotations

import pytest
import torch

from helpers.tp import VOCAB, dcp_engine, run_engine
from treeflash import LLM, SamplingParams
from treeflash.speculative.testing_drafters import RandomDrafter


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
    line = next(x for x in out.splitlines() if "kv_capacity" in x)
    assert "the longest request under DCP 2:" in line and "(2x one GPU's" in line, line
    assert rc in (0, 1)


@pytest.mark.slow
def test_tp8_dcp8_equals_one_rank(tmp_path):
    """A TP 8 world (8 heads, one a rank) with every rank's cache share its own: DCP 8."""
    from helpers.hf_checkpoints import write_checkpoint
    from helpers.tp import prompts

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
        assert run_engine(dcp_engine(llm, drafter, "ddtree", 8), ps, max_tokens=12) == expected
    finally:
        llm.close()


def test_dcp2_over_fp8_kv_equals_one_rank_over_it(target, drafter_path):
    """TP 2 x DCP 2 over an fp8_e4m3 cache: each rank's share in fp8 rows (written, settled and
    committed as whole rows), the same greedy tokens as one rank over the same rows, with DDTree."""
    from helpers.tp import prompts

    ps = prompts(2)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    one = LLM(target, drafter_path, device="cpu", dtype="float32", page_size=8, kv_cache_dtype="fp8_e4m3",
              spec="ddtree", tree_budget=8)
    expected = [o.token_ids for o in one.generate(ps, params)]
    llm = LLM(target, drafter_path, device="cpu", dtype="float32", page_size=2, prefill_chunk=8, tp=2, dcp=2,
              kv_cache_dtype="fp8_e4m3", spec="ddtree", tree_budget=8)
    try:
        assert llm.pool.kv.dtype == torch.uint8 and llm.pool.dcp == 2
        assert [o.token_ids for o in llm.generate(ps, params)] == expected
    finally:
        llm.close()
