"""A long prefill is visible and interruptible: the running / waiting / KV gauges are set when a
request is submitted and admitted (not only between engine steps), and a client that leaves
during its prefill gets its pages back after at most the chunk in progress."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from helpers.server import make_llm, metric, running_server, wait_for_pages_back

pytestmark = pytest.mark.slow

CHUNK = 16
LONG = [(7 * i) % 90 + 2 for i in range(480)]  # 30 chunks of 16


class PausedPrefill:
    """Wraps Engine.forward: counts the prefill chunks of requests whose prompt is LONG and
    holds the engine thread inside chunk number `pause_at` until `release` is set."""

    def __init__(self, engine, pause_at: int):
        self.engine, self.real, self.pause_at = engine, engine.forward, pause_at
        self.chunks = 0
        self.reached, self.release = threading.Event(), threading.Event()
        engine.forward = self

    def __call__(self, reqs, input_ids, *args, **kw):
        if len(reqs) == 1 and reqs[0].prompt_ids == LONG and input_ids.shape[1] > 1:
            self.chunks += 1
            if self.chunks == self.pause_at:
                self.reached.set()
                assert self.release.wait(60), "the test never released the engine"
        return self.real(reqs, input_ids, *args, **kw)


def _wait_metric(url: str, name: str, value: float, timeout: float = 5.0) -> float:
    deadline = time.monotonic() + timeout
    while (got := metric(url, name)) != value and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def test_gauges_are_set_on_submit_and_admission_not_only_between_steps(ckpt):
    llm = make_llm(ckpt, prefill_chunk=CHUNK)
    paused = PausedPrefill(llm.engine, pause_at=3)
    body = {"model": "tiny", "max_tokens": 2, "ignore_eos": True}
    with running_server(llm) as (url, _, _):
        results = []

        def post(prompt):
            results.append(httpx.post(url + "/v1/completions", json={**body, "prompt": prompt},
                                      timeout=60).status_code)

        first = threading.Thread(target=post, args=(LONG,))
        first.start()
        try:
            assert paused.reached.wait(30)  # the engine is inside the long request's prefill
            assert metric(url, "treeflash:num_requests_running") == 1
            assert metric(url, "treeflash:num_requests_waiting") == 0
            assert metric(url, "treeflash:kv_cache_usage_perc") > 0
            second = threading.Thread(target=post, args=([5, 6, 7],))
            second.start()  # submitted while the engine thread is busy: waiting at once
            assert _wait_metric(url, "treeflash:num_requests_waiting", 1) == 1
        finally:
            paused.release.set()
        first.join(60)
        second.join(60)
        assert results == [200, 200]
        wait_for_pages_back(url)
        assert metric(url, "treeflash:num_requests_waiting") == 0


def test_disconnect_during_prefill_frees_pages_within_one_chunk(ckpt):
    llm = make_llm(ckpt, prefill_chunk=CHUNK)
    paused = PausedPrefill(llm.engine, pause_at=3)
    with running_server(llm) as (url, app, _):
        ae = app.state.treeflash.async_engine
        aborted, real_abort = threading.Event(), ae.abort
        ae.abort = lambda rid: (real_abort(rid), aborted.set())
        port = int(url.rsplit(":", 1)[1])
        payload = httpx.Request("POST", url + "/v1/completions", json={
            "model": "tiny", "prompt": LONG, "max_tokens": 2, "ignore_eos": True})
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        head += f"content-length: {len(payload.read())}\r\n\r\n"
        sock = socket.create_connection(("127.0.0.1", port))
        try:
            sock.sendall(head.encode() + payload.read())
            assert paused.reached.wait(30)
        finally:
            sock.close()  # the client leaves in the middle of chunk 3 of 30
        try:
            assert aborted.wait(10)  # the server saw it and asked the engine to abort
        finally:
            paused.release.set()
        wait_for_pages_back(url)
        assert paused.chunks <= 4, f"{paused.chunks} of 30 chunks computed for a gone client"
