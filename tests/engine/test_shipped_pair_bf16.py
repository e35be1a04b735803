"""The engine's own speculative path on the shipped pair keeps its acceptance in bf16.

Lossless verification hides a drafter that got worse: the tokens stay right, only acceptance
falls. Such a bug shipped for one commit on 2026-12-03 (rotary angles computed as a bf16 product in
a bf16 model): on the H200 the pair's acceptance fell 3.39 -> 2.33, and every fp32 test passed.
Here, on 2 held-out prompts x 64 tokens (positions past 512), DDTree-31 acceptance was 3.51 in
fp32 and 3.61 in bf16 on this project's CPU; the buggy commit gave 2.31 in bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treeflash import LLM, SamplingParams

pytestmark = pytest.mark.slow

ASSETS = Path(__file__).resolve().parents[2] / "src" / "treeflash" / "assets"


def _acceptance(dtype: str) -> float:
    prompts = [p["text"] for p in json.loads((ASSETS / "heldout_prompts.json").read_text())["prompts"][:2]]
    llm = LLM(spec="ddtree", tree_budget=31, device="cpu", dtype=dtype, seed=0)
    outs = [llm.generate([p], SamplingParams(max_tokens=64, ignore_eos=True))[0] for p in prompts]
    spec = [o.metrics["speculative_decoding"] for o in outs]
    return 1 + sum(m["num_accepted_draft_tokens"] for m in spec) / sum(m["num_spec_steps"] for m in spec)


def test_bf16_acceptance_matches_fp32():
    fp32, bf16 = _acceptance("float32"), _acceptance("bfloat16")
    assert fp32 > 3.0, fp32  # the shipped drafter on these prompts (3.51 measured)
    assert bf16 >= 0.9 * fp32, f"bf16 {bf16:.2f} vs fp32 {fp32:.2f}: a bf16-only loss of acceptance"
