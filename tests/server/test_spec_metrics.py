"""Speculative decoding behind the server: lossless output, per-request metrics, counters, log."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.server import make_llm, metric, running_server
from treeflash import SamplingParams
from treeflash.speculative.testing_drafters import OracleDrafter

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 33, 2, 41]


@pytest.fixture(scope="module")
def spec_server(ckpt, ref_llm):
    expected = ref_llm.generate(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    # Replays the target's own greedy continuation: every draft is accepted.
    drafter = OracleDrafter(96, 4, sequences=[PROMPT + expected], target_layer_ids=(0, 1))
    llm = make_llm(ckpt, drafter=drafter, spec="ddtree", tree_budget=6)
    with running_server(llm, per_request_spec_decode_metrics="detailed") as (url, app, _):
        yield url, app, expected


BODY = {
    "model": "tiny",
    "prompt": PROMPT,
    "max_tokens": 30,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
}


def test_lossless_and_per_request_metrics(spec_server):
    url, _, expected = spec_server
    r = httpx.post(url + "/v1/completions", json=BODY, timeout=60).json()
    assert r["choices"][0]["token_ids"] == expected
    spec = r["metrics"]["speculative_decoding"]
    assert spec["spec_mode"] == "ddtree" and spec["tree_budget"] == 6
    assert spec["mean_acceptance_length"] >= 3.0  # block of 4: up to 3 drafts + the bonus
    assert (
        sum(spec["acceptance_histogram"])
        == spec["num_spec_steps"]
        == len(spec["per_step_accepted"])
    )


def test_stream_carries_metrics_on_the_usage_chunk(spec_server):
    url, _, expected = spec_server
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        frames = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: {")]
    ids = [t for f in frames for c in f["choices"] for t in c["token_ids"]]
    assert ids == expected
    last = frames[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 30
    assert last["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] > 0


def test_metrics_are_null_when_n_above_one(spec_server):
    url, _, _ = spec_server
    r = httpx.post(url + "/v1/completions", json={**BODY, "n": 2}, timeout=60).json()
    assert r["metrics"] == {"speculative_decoding": None}


def test_prometheus_counters_match_the_requests(spec_server):
    url, app, _ = spec_server
    drafts0 = metric(url, "treeflash:spec_decode_num_drafts_total")
    accepted0 = metric(url, "treeflash:spec_decode_num_accepted_tokens_total")
    pos0 = metric(url, "treeflash:spec_decode_num_accepted_tokens_per_pos_total")
    spec = httpx.post(url + "/v1/completions", json=BODY, timeout=60).json()["metrics"][
        "speculative_decoding"
    ]
    assert metric(url, "treeflash:spec_decode_num_drafts_total") - drafts0 == spec["num_spec_steps"]
    accepted = metric(url, "treeflash:spec_decode_num_accepted_tokens_total") - accepted0
    assert accepted == spec["num_accepted_draft_tokens"]
    # Summed over positions, per-position counts equal accepted tokens (a walk from the root).
    assert metric(url, "treeflash:spec_decode_num_accepted_tokens_per_pos_total") - pos0 == accepted
    text = httpx.get(url + "/metrics").text
    assert (
        'treeflash:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}'
        in text
    )
    lines = app.state.treeflash.stat_logger.log()
    assert any(ln.startswith("Engine 000: Avg prompt throughput:") for ln in lines)
    spec_line = next(
        ln for ln in lines if ln.startswith("SpecDecoding metrics: Mean acceptance length:")
    )
    assert (
        "Per-position acceptance rate:" in spec_line and "Avg Draft acceptance rate:" in spec_line
    )
