"""SIGTERM: stop admitting, drain in-flight requests up to --shutdown-timeout, then exit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from server_helpers import running_server

from conftest import make_llm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(url: str, body: dict, out: dict, started: threading.Event) -> None:
    """Read one completion stream into out: text chunks, finish reasons, [DONE] seen."""
    out.update(chunks=0, reasons=[], done=False, error=None)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    choice = json.loads(line[6:])["choices"][0]
                    out["chunks"] += 1
                    out["tokens"] = out.get("tokens", 0) + len(choice.get("token_ids") or [])
                    if choice["finish_reason"]:
                        out["reasons"].append(choice["finish_reason"])
                    started.set()
    except Exception as e:  # noqa: BLE001 - reported through `out`
        out["error"] = repr(e)
    finally:
        started.set()


def test_sigterm_drains_in_flight_requests_then_exits(ckpt):
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "treeflash.cli",
        "serve",
        "--model",
        str(ckpt),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--page-size",
        "16",
        "--max-model-len",
        "512",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--shutdown-timeout",
        "30",
        "--log-interval",
        "1",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        out, started = {}, threading.Event()
        body = {
            "model": "tiny",
            "prompt": "hello",
            "max_tokens": 300,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        reader = threading.Thread(target=_stream, args=(url, body, out, started))
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:  # no new work once draining: refused connection or 503
            r = httpx.post(
                url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=5
            )
            assert r.status_code == 503
        except httpx.TransportError:
            pass
        reader.join(60)
        assert out["error"] is None, out
        assert out["reasons"] == ["length"] and out["tokens"] == 300 and out["done"], out
        assert proc.wait(30) == 0
        log = proc.stdout.read()
        assert f"Uvicorn running on http://127.0.0.1:{port}" in log  # also with the socket bound before loading
        assert "Draining" in log
        assert "Avg generation throughput" in log  # the periodic vLLM-style stats line
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drain_timeout_aborts_what_is_left(ckpt):
    llm = make_llm(ckpt)
    with running_server(llm, shutdown_timeout=0.5) as (url, _, server):
        out, started = {}, threading.Event()
        body = {
            "model": "tiny",
            "prompt": "hello",
            "max_tokens": 500,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        reader = threading.Thread(target=_stream, args=(url, body, out, started))
        reader.start()
        assert started.wait(30)
        t0 = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        reader.join(30)
        assert out["reasons"] == ["abort"] and out["done"], out
        assert out["tokens"] < 500
        assert time.monotonic() - t0 < 10
    assert llm.pool.num_free_pages == llm.pool.num_pages
