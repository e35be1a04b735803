"""Speculation is lossless over an INT4 target in Kimi K2.6's published layout: greedy output
with DFlash / DDTree equals plain greedy, with random, oracle (full acceptance) and real-format
drafters (the real one taps the target's last layer too)."""

from __future__ import annotations

import pytest

from helpers.drafter import write_drafter
from helpers.k26_checkpoints import write_k26_checkpoint
from helpers.spec import VOCAB, prompts
from treeflash import LLM, SamplingParams
from treeflash.speculative.testing_drafters import OracleDrafter, RandomDrafter

pytest.importorskip("compressed_tensors")
TOKENS = 16


@pytest.fixture(scope="module")
def k26(tmp_path_factory):
    return write_k26_checkpoint(tmp_path_factory.mktemp("k26s") / "m", initializer_range=0.3)


@pytest.fixture(scope="module")
def plain(k26):
    llm = LLM(k26, device="cpu", dtype="float32", page_size=8)
    assert llm.model.model.layers[1].mlp.expert_format == "int4"
    ps = prompts()
    return ps, [o.token_ids for o in llm.generate(ps, SamplingParams(max_tokens=TOKENS, ignore_eos=True))]


@pytest.mark.slow
@pytest.mark.parametrize("spec, budget", [("dflash", None), ("ddtree", 16)])
@pytest.mark.parametrize("kind", ["random", "oracle", "real"])
def test_greedy_is_lossless_over_int4_experts(k26, plain, tmp_path, kind, spec, budget):
    ps, expected = plain
    seqs = [p + e for p, e in zip(ps, expected)]
    drafter = {
        "random": lambda: RandomDrafter(VOCAB, 8, seed=1, target_layer_ids=(0, 2)),
        "oracle": lambda: OracleDrafter(VOCAB, 8, sequences=seqs, target_layer_ids=(1,)),
        "real": lambda: write_drafter(tmp_path / "d", hidden_size=64, vocab_size=VOCAB, num_target_layers=3,
                                      target_layer_ids=(0, 2), block_size=8, mask_token_id=VOCAB - 1,
                                      layer_types=("sliding_attention", "full_attention"), sliding_window=5),
    }[kind]()
    llm = LLM(k26, drafter, spec=spec, tree_budget=budget, device="cpu", dtype="float32", page_size=8)
    outs = llm.generate(ps, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    accepted = [a for o in outs for a in o.metrics["speculative_decoding"]["per_step_accepted"]]
    if kind == "oracle":  # full acceptance: drafts really were verified against INT4 experts
        assert max(accepted) == 7
