"""A tiny checkpoint with a tokenizer, an LLM on it, and a real uvicorn server on a free loopback
port. (Tests import these from here, never from a conftest: several directories have one, and
`import conftest` would find whichever came first on sys.path.)"""

from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from helpers.hf_checkpoints import add_tokenizer, write_checkpoint

TINY = dict(num_hidden_layers=2, max_position_embeddings=2048)  # small enough for a CPU under load
MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 64 << 10


def write_tiny_model(path: Path, **overrides) -> Path:
    write_checkpoint(path, **{**TINY, **overrides})
    add_tokenizer(path)
    return path


def make_llm(ckpt, **kw):
    from treeflash import LLM

    kw = {
        "device": "cpu",
        "dtype": "float32",
        "page_size": 16,
        "max_model_len": MAX_MODEL_LEN,
        **kw,
    }
    return LLM(ckpt, **kw)


@contextmanager
def running_server(llm, **config):
    """Serve `llm` with ServerConfig(**config) from a thread; yields (base_url, app, server)."""
    from treeflash.server.app import ServerConfig, create_app, make_server

    config.setdefault("model_name", "tiny")
    config.setdefault("log_interval", 0)
    app = create_app(llm, ServerConfig(**config))
    server = make_server(app, "127.0.0.1", 0, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app, server
    finally:
        server.should_exit = True
        thread.join(30)


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (every label set) on the server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = [
        float(m.group(1))
        for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    ]
    assert values, name
    return sum(values)


def wait_for_pages_back(url: str, timeout: float = 30.0) -> None:
    """Until every KV page is free and nothing runs (an AssertionError after `timeout` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        free = metric(url, "treeflash:kv_cache_free_pages")
        if (
            free == metric(url, "treeflash:kv_cache_total_pages")
            and metric(url, "treeflash:num_requests_running") == 0
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"KV pages did not come back: {free} free")
