"""Shared fixtures for the tensor-parallel tests: one tiny checkpoint whose 4 heads and 8
experts split over 2 and 4 ranks, its TP=1 greedy outputs, and a real DFlash drafter."""

from __future__ import annotations

import pytest
import torch

from helpers.drafter import write_drafter
from helpers.hf_checkpoints import write_checkpoint
from helpers.tp import MAX_TOKENS, VOCAB, prompts
from treeflash import LLM, SamplingParams


@pytest.fixture(scope="session")
def target(tmp_path_factory):
    """q_lora exercises the sharded q_b_proj; random biases the rank-0-only o_proj bias."""
    from safetensors.torch import load_file, save_file

    path = write_checkpoint(tmp_path_factory.mktemp("tp") / "m", initializer_range=0.3, q_lora_rank=24,
                            attention_bias=True)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if name.endswith(".bias"):
            t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def drafter_path(tmp_path_factory):
    return write_drafter(tmp_path_factory.mktemp("tpd") / "dr", hidden_size=64, vocab_size=VOCAB,
                         num_target_layers=3, target_layer_ids=(0, 2), block_size=6,
                         mask_token_id=VOCAB - 1,
                         layer_types=("sliding_attention", "full_attention"), sliding_window=5)


@pytest.fixture(scope="session")
def reference(target):
    """TP=1: greedy outputs, and logits of the first prompt + its continuation."""
    llm = LLM(target, device="cpu", dtype="float32", page_size=8)
    ps = prompts()
    outs = [o.token_ids for o in llm.generate(ps, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    return ps, outs, llm.score(ps[0] + outs[0])


@pytest.fixture(autouse=True)
def no_hang():
    """A test that blocks in a collective cannot be interrupted from Python: after 120 s dump
    every thread's stack and end the run (pytest-timeout's signal method cannot reach it)."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
