"""Load and faults: 64 concurrent streams, disconnects, KV exhaustion, a bounded queue."""

from __future__ import annotations

import asyncio
import json
import queue
import random
import re
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from helpers.server import make_llm, metric, running_server, wait_for_pages_back
from treeflash import SamplingParams
from treeflash.parallel.errors import DistributedError
from treeflash.server.protocol import ApiError
from treeflash.server.serving import _next_event

pytestmark = pytest.mark.slow


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 90) for _ in range(rng.randrange(3, 14))] for _ in range(n)]


async def _stream_one(client, prompt, max_tokens):
    ids, text, reasons = [], "", []
    stream = await client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    async for chunk in stream:
        for c in chunk.choices:
            ids += c.token_ids or []
            text += c.text
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return ids, text, reasons


def test_64_concurrent_streams_lose_and_duplicate_nothing(url, ref_llm):
    ps = prompts(64, seed=1)
    refs = ref_llm.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))

    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        return await asyncio.wait_for(
            asyncio.gather(*(_stream_one(client, p, 24) for p in ps)), 150
        )

    results = asyncio.run(run())
    for (ids, text, reasons), ref in zip(results, refs, strict=True):
        assert ids == ref.token_ids
        assert text == ref.text
        assert reasons == ["length"]
    wait_for_pages_back(url)


def test_disconnects_mid_stream_abort_and_free_every_page(url):
    aborted0 = metric(url, "treeflash:num_aborted_requests_total")
    body = {
        "model": "tiny",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }

    async def read_a_little_then_drop(prompt):
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream(
                "POST", url + "/v1/completions", json={**body, "prompt": prompt}
            ) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 3:
                        break  # leaving the block closes the connection mid-stream

    async def run():
        await asyncio.gather(*(read_a_little_then_drop(p) for p in prompts(6, seed=2)))

    asyncio.run(run())
    wait_for_pages_back(url)
    deadline = time.monotonic() + 10
    while metric(url, "treeflash:num_aborted_requests_total") < aborted0 + 6:
        assert time.monotonic() < deadline, "disconnected requests were not aborted"
        time.sleep(0.05)
    r = httpx.post(
        url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3}
    )
    assert r.status_code == 200


def test_non_streaming_disconnect_aborts_too(url):
    aborted0 = metric(url, "treeflash:num_aborted_requests_total")
    body = {
        "model": "tiny",
        "prompt": [5, 6, 7],
        "max_tokens": 450,
        "temperature": 0,
        "ignore_eos": True,
    }
    try:
        httpx.post(url + "/v1/completions", json=body, timeout=0.3)
    except httpx.TimeoutException:
        pass
    wait_for_pages_back(url)
    assert metric(url, "treeflash:num_aborted_requests_total") >= aborted0 + 1


def test_disconnect_while_waiting_for_an_event_is_a_clean_400():
    """A non-streaming handler whose client left ends with the intended ApiError, not an
    InvalidStateError traceback logged as an unhandled 500 on every disconnect."""

    async def run():
        sub = SimpleNamespace(queue=asyncio.Queue())  # no event will come
        gone = asyncio.get_running_loop().create_future()
        gone.set_result(None)
        with pytest.raises(ApiError, match="the client disconnected") as e:
            await _next_event(sub, gone)
        assert e.value.status == 400

    asyncio.run(run())


def test_kv_exhaustion_queues_rejects_and_recovers(ckpt, ref_llm):
    llm = make_llm(ckpt, kv_cache_tokens=256)  # 16 pages of 16 tokens
    assert llm.pool.num_pages == 16
    with running_server(llm, max_queued_requests=64) as (url, app, _):
        # Can never fit: refused at once with both numbers.
        r = httpx.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": [5] * 5, "max_tokens": 300}
        )
        assert r.status_code == 400
        assert "needs 20 KV pages but the pool has only 16" in r.json()["error"]["message"]
        # 4 pages each, 16 in the pool: at most 4 run, the rest queue, and all finish right.
        ps = prompts(8, seed=3)
        refs = ref_llm.generate(ps, SamplingParams(max_tokens=40, ignore_eos=True))

        async def run():
            client = openai.AsyncOpenAI(
                base_url=url + "/v1", api_key="x", max_retries=0, timeout=120
            )
            return await asyncio.gather(*(_stream_one(client, p, 40) for p in ps))

        for (ids, _, _), ref in zip(asyncio.run(run()), refs, strict=True):
            assert ids == ref.token_ids
        wait_for_pages_back(url)
        # A short queue: the overflow gets 503, the rest finish, nothing leaks.
        app.state.treeflash.async_engine.max_queued = 2

        async def flood():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"model": "tiny", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
                return await asyncio.gather(
                    *(
                        c.post(url + "/v1/completions", json={**body, "prompt": p})
                        for p in prompts(12, seed=4)
                    )
                )

        codes = [r.status_code for r in asyncio.run(flood())]
        assert set(codes) == {200, 503}, codes
        wait_for_pages_back(url)
        assert metric(url, "treeflash:num_rejected_requests_total") >= codes.count(503)
        r = httpx.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3}
        )
        assert r.status_code == 200
        # Chat without max_tokens asks for what the 256-token pool can hold, not the context.
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["total_tokens"] <= 256


def test_engine_failure_fails_its_requests_and_the_server_recovers(ckpt):
    llm = make_llm(ckpt, kv_cache_tokens=1024)
    real_step, calls = llm.engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return real_step()

    llm.engine.step = flaky_step
    with running_server(llm) as (url, _, _):
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 20, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        wait_for_pages_back(url)
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200


def test_requests_that_finished_in_a_failed_step_keep_their_result(ckpt, ref_llm):
    """A step can finish some requests (a one-token prefill) and then fail (the decode of
    the others): the finished ones end with their own reason and tokens, not "abort"."""
    llm = make_llm(ckpt, kv_cache_tokens=1024)
    engine, real_decode, faults = llm.engine, llm.engine._decode, []

    def decode_failing_after_a_finish(reqs):
        if not faults and any(r.finished for r in engine.running):
            faults.append(1)
            raise RuntimeError("injected fault")
        return real_decode(reqs)

    engine._decode = decode_failing_after_a_finish
    with running_server(llm) as (url, _, _):
        body = {"model": "tiny", "temperature": 0, "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(timeout=60) as c:
                long = {**body, "prompt": [5, 6, 7], "max_tokens": 400, "stream": True}
                async with c.stream("POST", url + "/v1/completions", json=long) as r:
                    lines = r.aiter_lines()
                    while not (await anext(lines)).startswith("data: "):
                        pass  # the long request is decoding: the next step fails
                    one = {**body, "prompt": [8, 9], "max_tokens": 1, "return_token_ids": True}
                    short = asyncio.ensure_future(c.post(url + "/v1/completions", json=one))
                    rest = [line async for line in lines]
                    return await short, rest

        short, rest = asyncio.run(run())
        assert faults == [1]
        assert any("injected fault" in line for line in rest)  # the decoding one failed
        assert short.status_code == 200, short.text
        choice = short.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        ref = ref_llm.generate([[8, 9]], SamplingParams(max_tokens=1, ignore_eos=True))[0]
        assert (choice["token_ids"], choice["text"]) == (ref.token_ids, ref.text)
        assert short.json()["usage"]["completion_tokens"] == 1
        wait_for_pages_back(url)


def test_requests_queued_during_a_fatal_step_are_answered(ckpt):
    """A request submitted while the step that kills the engine thread runs (a hung rank is
    detected only after TREEFLASH_DIST_TIMEOUT) gets an error naming the cause, not a
    connection dropped when the server exits."""
    llm = make_llm(ckpt, kv_cache_tokens=1024)
    real_step, calls = llm.engine.step, []
    with running_server(llm) as (url, app, _):
        ae = app.state.treeflash.async_engine

        def step_dying_once_another_request_waits():
            calls.append(1)
            if len(calls) < 3:
                return real_step()
            deadline = time.monotonic() + 30
            while ae._cmds.empty() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise DistributedError("rank 1 hung (injected)")

        llm.engine.step = step_dying_once_another_request_waits
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(timeout=60) as c:
                first = asyncio.ensure_future(c.post(url + "/v1/completions", json=body))
                while len(calls) < 3:
                    await asyncio.sleep(0.01)
                return await asyncio.gather(first, c.post(url + "/v1/completions", json=body))

        first, second = asyncio.run(run())
        # The running one failed with the engine (500); the queued one never reached it and
        # is refused as the engine being unavailable (503). Both name the cause.
        assert (first.status_code, second.status_code) == (500, 503), (first.text, second.text)
        for r in (first, second):
            assert "rank 1 hung (injected)" in r.json()["error"]["message"]


class _SpyQueue:
    """The engine's command queue; `on_put(cmd)` runs before each put (in the caller)."""

    def __init__(self, on_put):
        self._q, self._on_put = queue.SimpleQueue(), on_put

    def put(self, cmd):
        self._on_put(cmd)
        self._q.put(cmd)

    def __getattr__(self, name):
        return getattr(self._q, name)


class _SpyLock:
    """A lock that reports when `thread` starts to wait for it."""

    def __init__(self, thread, waiting: threading.Event):
        self._lock, self._thread, self._waiting = threading.Lock(), thread, waiting

    def __enter__(self):
        if threading.current_thread() is self._thread:
            self._waiting.set()
        self._lock.acquire()

    def __exit__(self, *exc):
        self._lock.release()


def rendered(app, name: str) -> float:
    """A counter's total from the server's own metrics text (works after the server stopped)."""
    text = app.state.treeflash.metrics.render().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.mark.parametrize("stream", [False, True])
def test_submit_racing_the_engine_threads_last_drain_is_refused_not_lost(ckpt, stream):
    """A submit that found the engine alive and enqueues its request only after the engine
    thread, stopped by a fatal step, made its last pass over the command queue: the request
    must still be answered (503, naming the cause), never left without an event.

    The interleaving is forced, not timed: the fatal step waits until the submit is about to
    put its add command, and that put waits until the engine thread has either finished its
    last drain (the lost-request interleaving) or is waiting for the submit lock (a fix
    that makes check-and-put atomic with the drain).

    stream: the refusal is still a 503 (the stream's status waits for the engine to take the
    request; it was 200 and an error frame), and it is counted as a rejection, not an abort."""
    llm = make_llm(ckpt, kv_cache_tokens=1024)
    stepping, submitting, engine_moved = threading.Event(), threading.Event(), threading.Event()

    def fatal_step():
        stepping.set()
        assert submitting.wait(30)
        raise DistributedError("rank 1 hung (injected)")

    def before_put(cmd):
        if cmd[0] == "add" and stepping.is_set() and not submitting.is_set():
            submitting.set()  # the second request passed the liveness check
            assert engine_moved.wait(30)

    with running_server(llm) as (url, app, _):
        ae = app.state.treeflash.async_engine
        ae._cmds = _SpyQueue(before_put)
        ae._admit_lock = _SpyLock(ae._thread, engine_moved)
        real_refuse = ae._refuse_pending

        def refuse_pending(error):
            real_refuse(error)
            engine_moved.set()

        ae._refuse_pending = refuse_pending
        llm.engine.step = fatal_step
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(timeout=60) as c:
                first = asyncio.ensure_future(c.post(url + "/v1/completions", json=body))
                assert await asyncio.to_thread(stepping.wait, 30)
                second = await c.post(url + "/v1/completions", json={**body, "stream": stream})
                return await first, second

        rejected = rendered(app, "treeflash:num_rejected_requests_total")
        aborted = rendered(app, "treeflash:num_aborted_requests_total")
        first, second = asyncio.run(run())
        assert rendered(app, "treeflash:num_rejected_requests_total") == rejected + 1
        assert rendered(app, "treeflash:num_aborted_requests_total") == aborted + 1  # the first only
    assert submitting.is_set() and engine_moved.is_set()
    assert first.status_code == 500, first.text  # it was running when the engine failed
    assert second.status_code == 503, second.text
    error = second.json()["error"]
    assert error["type"] == "service_unavailable" and error["code"] == 503
    assert "rank 1 hung (injected)" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_request_the_engine_refuses_at_admission_is_a_400(ckpt, stream):
    """A request validated by the HTTP layer but refused by Engine.add_request (its limits
    changed in between): 400 with the engine's reason, a stream included (no 200 + error frame),
    counted as rejected ("invalid"), nothing left behind; the next request runs."""
    llm = make_llm(ckpt, kv_cache_tokens=1024)
    real_add, calls = llm.engine.add_request, []

    def add_request(ids, params, rid=None):
        calls.append(rid)
        if len(calls) == 1:
            raise ValueError("prompt (3 tokens) + max_tokens (50) = 53 exceeds max_model_len=40")
        return real_add(ids, params, rid)

    llm.engine.add_request = add_request
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True, "stream": stream}
    with running_server(llm) as (url, app, _):
        rejected = rendered(app, "treeflash:num_rejected_requests_total")
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].endswith("exceeds max_model_len=40")
        assert rendered(app, "treeflash:num_rejected_requests_total") == rejected + 1
        assert rendered(app, "treeflash:num_aborted_requests_total") == 0
        ok = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert ok.status_code == 200 and ("[DONE]" in ok.text if stream else ok.json()["choices"])
        wait_for_pages_back(url)


def _sse(text_or_lines) -> tuple[int, list[str]]:
    """(token ids, error messages) in the data frames of a completion stream."""
    lines = text_or_lines.splitlines() if isinstance(text_or_lines, str) else text_or_lines
    tokens, errors = 0, []
    for line in lines:
        if not line.startswith("data: {"):
            continue
        data = json.loads(line[6:])
        if "error" in data:
            errors.append(data["error"]["message"])
        else:
            tokens += sum(len(ch.get("token_ids") or []) for ch in data["choices"])
    return tokens, errors


def test_ttft_is_observed_once_per_request_that_produced_a_token_in_a_failed_step(ckpt):
    """A step prefills a fresh request and then fails (the decode of another): the fresh
    request's first token was produced, so it gets exactly one time-to-first-token sample,
    whether it finished in that step (and keeps its result) or is aborted with the token.
    A request whose prefill itself failed produced nothing and gets none. The prompt and
    generation token counters agree with what the clients were sent."""
    llm = make_llm(ckpt, kv_cache_tokens=1024)
    engine, real_decode, real_prefill = llm.engine, llm.engine._decode, llm.engine._prefill
    fault = {"at": None}  # the next step that admits a request fails in "decode" or "prefill"

    def decode(reqs):
        decoding = {id(r) for r in reqs}
        if fault["at"] == "decode" and any(id(r) not in decoding for r in engine.running):
            fault["at"] = None
            raise RuntimeError("injected decode fault")
        return real_decode(reqs)

    def prefill(req):
        if fault["at"] == "prefill" and req is not engine.running[0]:
            fault["at"] = None
            raise RuntimeError("injected prefill fault")
        return real_prefill(req)

    engine._decode, engine._prefill = decode, prefill
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    long = {**body, "prompt": [5, 6, 7], "max_tokens": 400, "stream": True}
    cases = [
        ("decode", {"prompt": [8, 9], "max_tokens": 1}),  # finishes in the failed step
        ("decode", {"prompt": [10, 11, 12], "max_tokens": 5, "stream": True}),  # aborted
        ("prefill", {"prompt": [13, 14, 15, 16], "max_tokens": 5}),  # never gets a token
    ]

    async def one_case(url, at: str, fresh: dict) -> int:
        """A long stream decodes; `fresh` arrives and the step admitting it fails at `at`.
        Returns the tokens both clients were sent."""
        fault["at"] = at
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", url + "/v1/completions", json=long) as r:
                it = r.aiter_lines()
                lines = [await anext(it)]  # its first token came: the long request is decoding
                other = asyncio.ensure_future(c.post(url + "/v1/completions", json={**body, **fresh}))
                lines += [line async for line in it]
                resp = await other
        assert fault["at"] is None, f"the {at} fault never fired"
        long_tokens, long_errors = _sse(lines)
        assert any(f"injected {at} fault" in e for e in long_errors), lines
        if fresh.get("stream"):
            fresh_tokens, fresh_errors = _sse(resp.text)
            assert fresh_errors and fresh_tokens == 1, resp.text  # its prefill token came
        elif at == "decode":
            assert resp.status_code == 200, resp.text  # it finished before the fault
            fresh_tokens = len(resp.json()["choices"][0]["token_ids"])
            assert fresh_tokens == 1
        else:
            assert resp.status_code == 500 and "injected prefill fault" in resp.text, resp.text
            fresh_tokens = 0
        return long_tokens + fresh_tokens

    async def run(url):
        return [await one_case(url, at, fresh) for at, fresh in cases]

    with running_server(llm) as (url, _, _):
        sent = asyncio.run(run(url))
        wait_for_pages_back(url)
        # Each long stream and the first two fresh requests produced a first token.
        assert metric(url, "treeflash:time_to_first_token_seconds_count") == 3 + 2
        assert metric(url, "treeflash:prompt_tokens_total") == 3 * 3 + 2 + 3
        assert metric(url, "treeflash:generation_tokens_total") == sum(sent)
