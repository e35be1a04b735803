"""What stands between the socket and the handlers: API key, head size, body size and time, JSON.

One pure-ASGI middleware checks every route (auth on the routed path, never on a URL rebuilt
from the Host header; a request line or header block over the limit is a 414 / 431 even when
it came in one piece, which h11's buffer limit does not catch); `read_json` enforces the body
limits while reading (size, and a deadline: a stalled body is a 408), before any parsing, and
refuses invalid UTF-8, NaN/Infinity and non-object bodies with OpenAI-shaped 4xx errors.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from starlette.requests import Request

from treeflash.server.protocol import ApiError, error_body

OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no key
CLOSE = [(b"connection", b"close")]  # after an oversized head: nothing more from this client


class GuardMiddleware:
    def __init__(
        self,
        app,
        *,
        api_key: str | None,
        max_header_count: int,
        max_header_bytes: int,
        on_reject=None,
    ):
        self.app = app
        # h11's own limit only bounds a header block that arrives in pieces; this bounds all.
        self.max_header_bytes = max_header_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_header_count = max_header_count
        self.on_reject = on_reject or (lambda reason: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        line = len(scope["method"]) + len(scope["raw_path"]) + len(scope["query_string"]) + 11
        if line > self.max_header_bytes:  # "GET /path?q HTTP/1.1\r\n"
            self.on_reject("request_line_too_long")
            return await _send_error(
                send, 414, f"request line too long ({line} bytes > {self.max_header_bytes}, "
                "--max-header-bytes)", extra=CLOSE,
            )
        if len(headers) > self.max_header_count:
            self.on_reject("too_many_headers")
            return await _send_error(
                send, 431, f"too many request headers ({len(headers)} > {self.max_header_count})",
                extra=CLOSE,
            )
        size = line + sum(len(k) + len(v) + 4 for k, v in headers)  # "k: v\r\n"
        if size > self.max_header_bytes:
            self.on_reject("headers_too_large")
            return await _send_error(
                send, 431, f"request headers too large ({size} bytes > {self.max_header_bytes}, "
                "--max-header-bytes)", extra=CLOSE,
            )
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            given = next((v for k, v in headers if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                self.on_reject("unauthorized")
                msg = "missing API key" if not given else "invalid API key"
                return await _send_error(
                    send,
                    401,
                    f"{msg}: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    extra=[(b"www-authenticate", b"Bearer")],
                )
        return await self.app(scope, receive, send)


async def _send_error(
    send, status: int, message: str, *, code: str | None = None, extra=()
) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(
    request: Request, max_bytes: int, timeout: float | None = None
) -> dict[str, Any]:
    """The body as a JSON object; 413 past max_bytes (checked on Content-Length and while
    streaming the body, so an oversized body is never held in memory), 408 if it has not
    all come within `timeout` seconds, 400 if not JSON. A client gone while its body is read
    raises starlette's ClientDisconnect (answered with nothing, app.py)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, f"invalid Content-Length header {declared[:32]!r}")
        if int(declared) > max_bytes:
            raise ApiError(
                413,
                f"request body of {int(declared)} bytes exceeds the limit of "
                f"{max_bytes} bytes (--max-body-bytes)",
                code="request_too_large",
            )
    try:
        async with asyncio.timeout(timeout):
            body = await _read_body(request, max_bytes)
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout:g} s (--request-read-timeout)",
            code="request_timeout",
            headers={"Connection": "close"},  # the rest of the body may still come: not reusable
        ) from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


async def _read_body(request: Request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(
                413,
                f"request body exceeds the limit of {max_bytes} bytes (--max-body-bytes)",
                code="request_too_large",
            )
        chunks.append(chunk)
    return b"".join(chunks)


def check_text(value: str, param: str) -> str:
    """JSON can carry lone surrogates (\\ud800) that are not text: refuse them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400, f"{param} contains invalid Unicode (a lone surrogate)", param=param
        ) from None
    return value
