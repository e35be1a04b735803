"""The server against abusive clients: stalled and slow connections, broken HTTP framing,
redirects, oversized request lines, requests that can never be admitted. Raw sockets where
the framing itself is the test; a second loopback address (127.0.0.2) plays the good client."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import openai
import pytest

from helpers.server import make_llm, running_server

pytestmark = pytest.mark.slow

READ_TIMEOUT = 1.5
MAX_CONNECTIONS = 128  # a quarter, 32, per client address
OK = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def guarded(ckpt):
    """A server with short read deadlines and few connections: (url, port)."""
    llm = make_llm(ckpt)
    with running_server(llm, max_connections=MAX_CONNECTIONS,
                        request_read_timeout=READ_TIMEOUT) as (url, _, _):
        yield url, urlparse(url).port


def _port(url: str) -> int:
    return urlparse(url).port


def _connect(port: int, data: bytes = b"", source: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    if data:
        s.sendall(data)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes; b"" for a reset."""
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    finally:
        s.close()
    return out


def _response(raw: bytes) -> tuple[int, dict, dict]:
    """(status, lower-cased headers, JSON body) of one raw HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def _good_client() -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30)


# ---- stalled and slow clients (item 2) ---------------------------------------------------
def test_stalled_clients_do_not_starve_others(guarded):
    """300 half-sent requests from one address: it keeps 32 connections (a quarter of 128),
    the rest are refused at once; /health and a completion from another address answer
    meanwhile; the 32 get a 408 when the head's deadline passes."""
    url, port = guarded
    stalled = [_connect(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
               for _ in range(300)]
    t0 = time.monotonic()
    with _good_client() as c:
        assert c.get(url + "/health").status_code == 200
        r = c.post(url + "/v1/completions", json=OK)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        ai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, http_client=c)
        assert ai.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    assert time.monotonic() - t0 < READ_TIMEOUT  # served while the stalled ones were held
    with ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(_read_all, stalled))
    assert time.monotonic() - t0 < READ_TIMEOUT + 5
    statuses = [_response(r)[0] if r else None for r in replies]
    assert statuses.count(408) == MAX_CONNECTIONS // 4, statuses
    assert set(statuses) <= {408, 429, None}  # None: refused, reset before the 429 was read
    assert _response(replies[0])[2]["error"]["message"].startswith("the request head did not")


def test_reads_time_out(guarded):
    """A head or a body that does not come in time is a 408 and a closed connection, also
    for a client that trickles bytes (the deadline is not renewed); a connection that sends
    nothing is closed without a word, one that owes a body nobody reads after its answer."""
    url, port = guarded
    body = json.dumps(OK).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    half_body, silent = _connect(port, head + body[:5]), _connect(port)
    unread = _connect(port, b"POST /health HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\n{")
    trickle = _connect(port)

    def drip():  # a head to one, the unread body to the other, a byte each every 0.1 s
        for byte in head[:40]:
            for s, b in ((trickle, bytes([byte])), (unread, b" ")):
                try:
                    s.send(b)
                except OSError:
                    pass
            time.sleep(0.1)

    dripper = threading.Thread(target=drip)
    t0 = time.monotonic()
    dripper.start()
    status, headers, err = _response(_read_all(half_body))
    assert status == 408 and headers["connection"] == "close"
    assert "request body did not arrive within 1.5 s" in err["error"]["message"]
    assert _response(_read_all(trickle))[0] == 408
    assert _read_all(silent) == b""
    assert _read_all(unread).startswith(b"HTTP/1.1 405")  # then closed: nobody reads that body
    assert READ_TIMEOUT - 0.1 < time.monotonic() - t0 < READ_TIMEOUT + 3
    dripper.join()
    with _good_client() as c:
        assert c.post(url + "/v1/completions", json=OK).status_code == 200


def test_one_client_is_capped_not_everyone(ckpt):
    """Per address: a 33rd connection of one client is a 429, another client's is served."""
    llm = make_llm(ckpt)
    with running_server(llm, max_connections=8, max_connections_per_client=2) as (url, _, _):
        port = _port(url)
        held = [_connect(port) for _ in range(2)]
        time.sleep(0.2)
        status, _, err = _response(_read_all(_connect(port, b"GET /health HTTP/1.1\r\n\r\n")))
        assert status == 429 and "--max-connections-per-client" in err["error"]["message"]
        with _good_client() as c:
            assert c.get(url + "/health").status_code == 200
        for s in held:
            s.close()
        time.sleep(0.2)
        assert httpx.get(url + "/health").status_code == 200  # the slots came back


# ---- broken framing (item 4) ----------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def server_log():
    """Records of the server's loggers (uvicorn's do not propagate to pytest's caplog)."""
    handler, names = _Records(), ("uvicorn", "treeflash.server")  # uvicorn.error propagates
    for name in names:
        logging.getLogger(name).addHandler(handler)
    yield handler.records
    for name in names:
        logging.getLogger(name).removeHandler(handler)


POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"


def _quiet(records: list, before: int) -> None:
    """At most one log line since `before`, below ERROR, and no traceback."""
    time.sleep(0.3)  # the handler of a gone client ends after the socket closes
    new = records[before:]
    assert len(new) <= 1, [r.getMessage() for r in new]
    assert all(r.levelno < logging.ERROR and not r.exc_info for r in new), new


def test_bad_chunk_size_is_a_json_400(url, server_log):
    before = len(server_log)
    raw = _read_all(_connect(_port(url), POST + b"transfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n"))
    status, headers, err = _response(raw)
    assert status == 400 and headers["content-type"] == "application/json"
    assert "malformed HTTP request" in err["error"]["message"]
    _quiet(server_log, before)
    assert httpx.post(url + "/v1/completions", json=OK).status_code == 200


@pytest.mark.parametrize("cut", ["close", "half_close"])
def test_body_cut_short_is_a_400_or_nothing(url, server_log, cut):
    """The client announces 100 bytes, sends 10, then shuts its side (a 400 naming that) or
    leaves (nothing to answer): nothing runs, at most one quiet log line."""
    before = len(server_log)
    s = _connect(_port(url), POST + b"content-length: 100\r\n\r\n" + b'{"model": ')
    time.sleep(0.2)  # the handler is reading the body
    if cut == "close":
        s.close()
    else:
        s.shutdown(socket.SHUT_WR)
        status, _, err = _response(_read_all(s))
        assert status == 400 and "before its body was complete" in err["error"]["message"]
    _quiet(server_log, before)
    assert httpx.post(url + "/v1/completions", json=OK).status_code == 200


# ---- redirects, methods, long request lines (items 6, 7) -----------------------------------
def test_trailing_slash_is_a_404_not_a_redirect(url):
    r = httpx.post(url + "/v1/completions/", json=OK, headers={"Host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers
    assert r.json()["error"]["message"] == "Not Found"


def test_405_names_the_allowed_methods(url):
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert httpx.post(url + "/health").headers["allow"] == "GET"


@pytest.mark.parametrize("pieces", [1, 2])
def test_long_request_line_is_414(url, pieces):
    """100 KB of path: in one piece (parsed whole by h11) or in two (h11's buffer limit)."""
    line = b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    s = _connect(_port(url))
    try:
        for part in (line[:50_000], line[50_000:]) if pieces == 2 else (line,):
            s.sendall(part)
            time.sleep(0.1)
    except OSError:  # the server may answer and close before the rest is sent
        pass
    status, _, err = _response(_read_all(s))
    assert status == 414 and "--max-header-bytes" in err["error"]["message"]


def test_headers_over_the_buffer_are_431_json(url):
    s = _connect(_port(url))
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.1)
        s.sendall(b"X-Big: " + b"a" * (64 << 10) + b"\r\n")
    except OSError:
        pass
    status, headers, err = _response(_read_all(s))
    assert status == 431 and headers["content-type"] == "application/json"
    assert "request headers too long" in err["error"]["message"]


# ---- never admissible (item 3) --------------------------------------------------------------
def test_more_choices_than_the_queue_holds_is_a_400_naming_the_limit(client):
    """64 prompts x n=8 = 512 choices, the queue holds 256: no retry would ever help."""
    with pytest.raises(openai.BadRequestError, match="--max-queued-requests") as e:
        client.completions.create(model="tiny", prompt=["a"] * 64, n=8, max_tokens=2)
    assert "512 choices" in str(e.value) and "256" in str(e.value)
