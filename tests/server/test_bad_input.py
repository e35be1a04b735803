"""Every bad request gets a clear OpenAI-shaped 4xx, and the server keeps serving."""

from __future__ import annotations

import socket
from urllib.parse import urlparse

import httpx
import openai
import pytest

from helpers.server import MAX_BODY_BYTES, MAX_MODEL_LEN, make_llm, running_server

pytestmark = pytest.mark.slow

OK = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _c(**kw):
    return {"path": "/v1/completions", "json": {**OK, **kw}}


def _chat(**kw):
    return {"path": "/v1/chat/completions", "json": {**CHAT, **kw}}


CASES = {
    "malformed_json": (
        {"path": "/v1/completions", "content": b'{"model": "tiny", "prompt": '},
        400,
        "not valid JSON",
    ),
    "json_not_object": ({"path": "/v1/completions", "content": b"[1, 2]"}, 400, "JSON object"),
    "nan": (
        {"path": "/v1/completions", "content": b'{"model":"tiny","prompt":"x","temperature":NaN}'},
        400,
        "NaN",
    ),
    "invalid_utf8": (
        {"path": "/v1/completions", "content": b'{"model":"tiny","prompt":"\xff\xfe"}'},
        400,
        "UTF-8",
    ),
    "lone_surrogate": (
        {"path": "/v1/completions", "content": b'{"model":"tiny","prompt":"\\ud800"}'},
        400,
        "surrogate",
    ),
    "max_tokens_string": (_c(max_tokens="5"), 400, "max_tokens"),
    "max_tokens_bool": (_c(max_tokens=True), 400, "max_tokens"),
    "prompt_number": (_c(prompt=5), 400, "prompt"),
    # (a request without "model" gets the only model, as in vLLM: test_vllm_routes.py)
    "model_not_a_string": (_c(model=5), 400, "model"),
    "unknown_model": (_c(model="gpt-4"), 404, "does not exist"),
    "empty_prompt": (_c(prompt=""), 400, "empty"),
    "empty_prompt_list": (_c(prompt=[]), 400, "empty"),
    "prompt_over_context": (_c(prompt=[5] * 600), 400, "maximum context length is 512 tokens"),
    "prompt_plus_max_tokens": (
        _c(prompt=[5] * 10, max_tokens=600),
        400,
        "610 tokens (10 in the prompt",
    ),
    "max_tokens_zero": (_c(max_tokens=0), 400, "max_tokens"),
    "max_tokens_negative": (_c(max_tokens=-186), 400, "max_tokens"),
    "max_tokens_huge": (_c(max_tokens=10**15), 400, "maximum context length"),
    "temperature_negative": (_c(temperature=-0.5), 400, "temperature"),
    "top_p_zero": (_c(top_p=0.0), 400, "top_p"),
    "top_p_above_one": (_c(top_p=1.5), 400, "top_p"),
    "n_over_cap": (_c(n=9), 400, "n must be between 1 and 8"),
    "n_zero": (_c(n=0), 400, "n must be"),
    "best_of_below_n": (_c(n=2, best_of=1), 400, "best_of must be at least n (2)"),
    "stream_options_without_stream": (
        _chat(stream_options={"include_usage": True}),
        400,
        "stream_options is only allowed when stream is true",
    ),
    "too_many_stops": (_c(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    "stop_too_long": (_c(stop=["x" * 300]), 400, "stop"),
    "stop_empty": (_c(stop=[""]), 400, "stop"),
    "token_id_over_vocab": (_c(prompt=[5, 96, 3]), 400, "outside the vocabulary"),
    "token_id_negative": (_c(prompt=[5, -1]), 400, "outside the vocabulary"),
    "seed_huge": (_c(seed=2**70), 400, "seed"),
    "logprobs_unsupported": (_c(logprobs=2), 400, "logprobs"),
    # vLLM / SGLang extensions (extra_body) that would change the output: refused, not ignored
    "min_p_unsupported": (_c(min_p=0.1), 400, "min_p"),
    "repetition_penalty_unsupported": (_chat(repetition_penalty=1.3), 400, "repetition_penalty"),
    "stop_token_ids_unsupported": (_c(stop_token_ids=[3]), 400, "stop_token_ids"),
    "guided_json_unsupported": (_chat(guided_json={"type": "object"}), 400, "guided_json"),
    "sglang_regex_unsupported": (_c(regex="[0-9]+"), 400, "regex"),
    "too_many_prompts": (_c(prompt=["a"] * 65), 400, "at most 64 prompts"),
    "chat_no_messages": (_chat(messages=[]), 400, "messages"),
    "chat_bad_role": (_chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    "chat_image_part": (
        _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        400,
        "messages",
    ),
    "chat_tools": (_chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    "chat_over_context": (_chat(max_tokens=1000), 400, "maximum context length"),
    "unknown_route": ({"path": "/v1/nope", "json": {}}, 404, "Not Found"),
    "oversized_body": (
        {"path": "/v1/completions", "content": b"x" * (MAX_BODY_BYTES + 1)},
        413,
        "exceeds the limit",
    ),
}


def _still_serving(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json=OK, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("name", list(CASES))
def test_bad_request_is_refused_and_server_keeps_serving(url, name):
    req, status, words = CASES[name]
    r = httpx.post(url + req["path"], json=req.get("json"), content=req.get("content"), timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"], err
    _still_serving(url)


def test_neutral_sampling_extensions_are_accepted(url):
    # what SGLang / vLLM clients send by default must not be refused: only "off" values
    neutral = {"presence_penalty": 0.0, "frequency_penalty": 0, "min_p": 0.0, "repetition_penalty": 1.0,
               "min_tokens": 0, "stop_token_ids": [], "include_stop_str_in_output": False, "regex": None}
    for req in (_c(**neutral), _chat(**neutral)):
        r = httpx.post(url + req["path"], json=req["json"], timeout=30)
        assert r.status_code == 200, r.text


def test_error_names_the_parameter(url):
    err = httpx.post(url + "/v1/completions", json={**OK, "temperature": -1}).json()["error"]
    assert (err["param"], err["type"]) == ("temperature", "invalid_request_error")
    err = httpx.post(url + "/v1/completions", json={**OK, "prompt": [5] * 600}).json()["error"]
    assert err["code"] == "context_length_exceeded" and "600" in err["message"]


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny", prompt="x", max_tokens=MAX_MODEL_LEN + 1)


def test_wrong_method_is_405(url):
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    _still_serving(url)


def test_oversized_chunked_body_is_413_while_reading(url):
    def body():
        for _ in range(100):
            yield b"x" * 4096  # 400 KiB, no Content-Length

    r = httpx.post(url + "/v1/completions", content=body(), timeout=30)
    assert r.status_code == 413
    _still_serving(url)


def test_too_many_headers_is_431(url):
    headers = {f"x-h{i}": "v" for i in range(150)}
    r = httpx.post(url + "/v1/completions", json=OK, headers=headers)
    assert r.status_code == 431 and "too many request headers" in r.json()["error"]["message"]
    _still_serving(url)


def _raw_get(url: str, header_value: bytes) -> bytes:
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + header_value + b"\r\n\r\n")
        except OSError:  # the server may close the connection before all is sent
            pass
        try:
            return s.recv(4096)
        except OSError:
            return b""


def test_huge_headers_are_refused(url):
    assert _raw_get(url, b"a" * (64 << 10)).startswith(b"HTTP/1.1 431")  # whole block at once
    reply = _raw_get(url, b"a" * (4 << 20))  # beyond h11's buffer limit: 400 or closed
    assert reply.startswith(b"HTTP/1.1 4") or reply == b""
    _still_serving(url)


def test_api_key_required_and_compared(ckpt):
    llm = make_llm(ckpt)
    with running_server(llm, api_key="s3cret") as (url, _, _):
        assert httpx.get(url + "/health").status_code == 200  # liveness stays open
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for path in ("/v1/models", "/metrics", "/health_generate"):
                r = httpx.get(url + path, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["type"] == "authentication_error"
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt="x", max_tokens=2)
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=2).choices


FUZZ_VALUES = [
    None,
    True,
    False,
    -1,
    0,
    1,
    3,
    1.5,
    -0.0,
    2**70,
    "",
    "x",
    "tiny",
    "\u00e9\u4e2d",
    [],
    [1],
    [5, 96],
    [[1, 2]],
    ["a", 3],
    {},
    {"a": 1},
    {"include_usage": "yes"},
]
FUZZ_FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "ignore_eos",
    "logprobs",
    "echo",
]


def test_fuzzed_bodies_never_500(url):
    """Random values in random fields: every answer is a 2xx or a 4xx, never a crash."""
    import random

    rng = random.Random(0)
    statuses = []
    for i in range(150):
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        for field in rng.sample(FUZZ_FIELDS, rng.randrange(1, 4)):
            body[field] = rng.choice(FUZZ_VALUES)
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 3:
            body["max_tokens"] = 3  # keep accepted requests short
        path = "/v1/chat/completions" if i % 3 == 0 else "/v1/completions"
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
        if r.status_code != 200:
            assert r.json()["error"]["message"]
        statuses.append(r.status_code)
    assert 200 in statuses and 400 in statuses
    _still_serving(url)
