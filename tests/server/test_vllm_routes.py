"""The routes and habits a vLLM client relies on: /version, /tokenize and /detokenize with vLLM's
shapes (checked against the `tokenizers` library), requests without "model" served by the only
model, and what `serve` says at startup and in its stats lines (issue 43, items 7 and 9)."""

from __future__ import annotations

import logging

import httpx
import pytest
from tokenizers import Tokenizer

import treeflash

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_tok(ckpt):
    return Tokenizer.from_file(str(ckpt / "tokenizer.json"))


def test_version(url):
    r = httpx.get(url + "/version")
    assert r.status_code == 200 and r.json() == {"version": treeflash.__version__}


def test_tokenize_a_prompt_as_vllm(url, hf_tok):
    text = "def f(x): return x + 1"
    r = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = hf_tok.encode(text, add_special_tokens=True).ids
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == 512
    assert body["token_strs"] == [hf_tok.id_to_token(t) for t in want]
    plain = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == hf_tok.encode(text, add_special_tokens=False).ids and plain["token_strs"] is None


def test_tokenize_messages_counts_what_the_chat_route_sends(url, client):
    messages = [{"role": "user", "content": "hello world"}]
    counted = httpx.post(url + "/tokenize", json={"messages": messages}).json()["count"]
    done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert counted == done.usage.prompt_tokens


def test_detokenize_round_trips(url, hf_tok):
    ids = hf_tok.encode("hello world", add_special_tokens=False).ids
    r = httpx.post(url + "/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": hf_tok.decode(ids, skip_special_tokens=False)}


@pytest.mark.parametrize("route, body, status, words", [
    ("/detokenize", {"tokens": [10_000]}, 400, "outside the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "does not exist"),
    ("/tokenize", {}, 400, "either prompt or messages"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, "either prompt or messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "y"}], "add_special_tokens": True}, 400,
     "special tokens their chat template writes"),
])
def test_utility_routes_refuse_bad_requests(url, route, body, status, words):
    r = httpx.post(url + route, json=body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


def test_a_request_without_model_gets_the_only_model(url, ref_llm):
    from treeflash import SamplingParams

    r = httpx.post(url + "/v1/completions", json={"prompt": "def f", "max_tokens": 5, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny"
    assert body["choices"][0]["text"] == ref_llm.generate("def f", SamplingParams(max_tokens=5))[0].text
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2}, timeout=60)
    assert chat.status_code == 200 and chat.json()["model"] == "tiny"
    other = httpx.post(url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert other.status_code == 404


def test_startup_line_says_what_was_loaded(ckpt, tmp_path):
    import socket

    from helpers.drafter import write_drafter
    from helpers.server import make_llm
    from treeflash.cli import make_parser
    from treeflash.server.cli import startup_line

    drafter = write_drafter(tmp_path / "d", hidden_size=64, vocab_size=96, num_target_layers=2,
                            target_layer_ids=(0, 1), block_size=4, mask_token_id=95)
    llm = make_llm(ckpt, drafter=drafter, tree_budget=6)
    args = make_parser().parse_args(["serve", "--model", str(ckpt), "--drafter", str(drafter)])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        line = startup_line(llm, args, str(drafter), sock)
        port = sock.getsockname()[1]
    pool_tokens = llm.pool.num_pages * llm.pool.page_size
    for part in (str(ckpt), str(drafter), "ddtree (budget 6)", "on cpu", "float32",
                 f"KV cache {pool_tokens} tokens", "max_model_len 512", f"at http://127.0.0.1:{port}"):
        assert part in line, (part, line)


def test_stats_line_on_cpu_does_not_speak_of_a_gpu(caplog):
    from treeflash.server.metrics import ServerMetrics, StatLogger

    metrics = ServerMetrics("tiny")
    loggers = {device: StatLogger(metrics, device) for device in ("cpu", "cuda")}
    metrics.totals.prompt_tokens += 10  # an interval with work, so that a line is logged
    with caplog.at_level(logging.INFO):
        lines = {device: logger.log()[0] for device, logger in loggers.items()}
    assert "KV cache usage" in lines["cpu"] and "GPU" not in lines["cpu"]
    assert "GPU KV cache usage" in lines["cuda"]  # vLLM's wording, where it is true
