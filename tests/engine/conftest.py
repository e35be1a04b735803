"""Fixtures shared by the speculative-engine tests: a tiny target, a real-format drafter, and
the target's own greedy continuations (what every speculative run must reproduce)."""

from __future__ import annotations

import pytest

from helpers.drafter import write_drafter
from helpers.hf_checkpoints import write_checkpoint
from helpers.spec import VOCAB, prompts
from treeflash import LLM, SamplingParams


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("t") / "m", initializer_range=0.3)


@pytest.fixture(scope="module")
def drafter_path(tmp_path_factory):
    return write_drafter(tmp_path_factory.mktemp("d") / "dr", hidden_size=64, vocab_size=VOCAB,
                         num_target_layers=3, target_layer_ids=(0, 2), block_size=6,
                         mask_token_id=VOCAB - 1,
                         layer_types=("sliding_attention", "full_attention"), sliding_window=5)


@pytest.fixture(scope="module")
def reference(target):
    """Greedy outputs without speculation (24 tokens) for `prompts()`."""
    llm = LLM(target, device="cpu", dtype="float32", page_size=8)
    ps = prompts()
    return ps, [o.token_ids for o in llm.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))]
