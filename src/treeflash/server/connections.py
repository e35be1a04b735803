"""What uvicorn's h11 protocol lacks against abusive clients: a deadline on the request head, a
cap on connections (per client and in all) when they open, and JSON answers to framing errors.

uvicorn 0.55 has no timeout while it reads a request: a client that sends half a request line
holds its connection for ever, and under `limit_concurrency` such stalled connections count
like busy ones until every request, /health included, is answered 503. This protocol
- closes a connection whose request head has not fully arrived `read_timeout` seconds after
  the connection opened (or, on a kept-alive connection, after the head's first byte): a 408
  if part of a head came, silently if nothing did. Likewise a body that nobody reads (its
  response went out first: a 405, a 413) must be done `read_timeout` after that response. The
  body a handler reads has `read_json`'s deadline (guard.py), also a 408;
- refuses a connection as it opens, with a 429 when its client address already holds
  `max_per_client` connections, with a 503 when `max_connections` are open;
- answers h11's framing errors as JSON: 414 / 431 for a request line / head over
  `--max-header-bytes` (h11's buffer limit), 400 for the rest (a bad chunk size...), and a
  request whose client shut its sending side before the end (a body shorter than its
  Content-Length) with a 400; a client gone altogether gets nothing.

It relies on H11Protocol's documented asyncio.Protocol methods plus its `conn` (the h11
connection), `cycle`, `client` and `transport` attributes, checked by tests/server.
"""

from __future__ import annotations

import asyncio
import functools
import http
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from treeflash.server.protocol import error_body


@dataclass
class ConnectionLimits:
    """Shared by every connection of one server (uvicorn runs them all on one event loop)."""

    read_timeout: float
    max_connections: int
    max_per_client: int  # 0: no per-client cap
    on_reject: Callable[[str], None] = lambda reason: None
    # Connections let in, in all and per client address (refused ones, still closing, are not).
    open: int = 0
    per_client: Counter[str] = field(default_factory=Counter)


def guarded_h11(limits: ConnectionLimits) -> Callable[..., GuardedH11Protocol]:
    """The `http` protocol factory to give uvicorn.Config."""
    return functools.partial(GuardedH11Protocol, limits=limits)


def _raw_response(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response with a JSON error body that closes the connection (written
    outside h11's state machine: only ever followed by closing the transport)."""
    body = json.dumps(error_body(status, message)).encode()
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._admitted = False  # counted in limits.open (and per_client) while connected
        self._peer: str | None = None
        self._read_timer: asyncio.TimerHandle | None = None

    # ---- connection caps -------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        refusal = self._refusal()
        if refusal is not None:
            status, reason, message = refusal
            self.limits.on_reject(reason)
            transport.write(_raw_response(status, message))
            transport.close()
            return
        self._admitted = True
        self.limits.open += 1
        if self.client is not None:
            self._peer = self.client[0]
            self.limits.per_client[self._peer] += 1
        self._arm_read_timer()

    def _refusal(self) -> tuple[int, str, str] | None:
        lim = self.limits
        host = self.client[0] if self.client is not None else None
        if lim.max_per_client and host is not None and lim.per_client[host] >= lim.max_per_client:
            return 429, "too_many_connections_per_client", (
                f"this client already holds {lim.per_client[host]} connections, the most one "
                "client may (--max-connections-per-client)")
        if lim.open >= lim.max_connections:
            return 503, "too_many_connections", (
                f"the server holds its maximum of {lim.max_connections} connections "
                "(--max-connections); retry later")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._disarm_read_timer()
        if self._admitted:
            self._admitted = False
            self.limits.open -= 1
        if self._peer is not None:
            self.limits.per_client[self._peer] -= 1
            if not self.limits.per_client[self._peer]:
                del self.limits.per_client[self._peer]
            self._peer = None

    # ---- the read deadline ----------------------------------------------------------
    def _owed_unread(self) -> bool:
        """The client owes bytes that no handler is waiting for: a request head, or the rest
        of a body whose response has gone out already."""
        state, cycle = self.conn.their_state, self.cycle
        if state is h11.IDLE:
            return True
        return state is h11.SEND_BODY and cycle is not None and cycle.response_complete

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._owed_unread() and not self.transport.is_closing():
            self._arm_read_timer()  # kept from the first byte, not renewed by later ones
        else:
            self._disarm_read_timer()  # the head is complete: the body's deadline is read_json's

    def on_response_complete(self) -> None:
        self._disarm_read_timer()
        super().on_response_complete()  # arms uvicorn's keep-alive timeout for an idle wait
        if self._owed_unread() and not self.transport.is_closing():
            self._arm_read_timer()

    def _arm_read_timer(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.limits.read_timeout, self._read_timed_out)

    def _disarm_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or not self._owed_unread():
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:  # part of a head
            self.limits.on_reject("read_timeout")
            self.transport.write(_raw_response(
                408, f"the request head did not arrive within {self.limits.read_timeout:g} s "
                "(--request-read-timeout)"))
        self.transport.close()

    # ---- framing errors --------------------------------------------------------------
    def eof_received(self) -> None:
        """The client shut its sending side (it may still read): a request cut short there is
        a 400 naming that, before the transport closes (uvicorn would close in silence)."""
        state, cycle = self.conn.their_state, self.cycle
        if state is h11.SEND_BODY and cycle is not None and not cycle.response_started:
            what = "body"
        elif state is h11.IDLE and self.conn.trailing_data[0]:
            what = "head"
        else:
            return
        self.limits.on_reject("malformed")
        self.transport.write(_raw_response(
            400, f"the client ended the request before its {what} was complete"))

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to any h11 RemoteProtocolError (text/plain 400), as JSON with the
        status that fits; called after h11 has refused the bytes, so it writes the response
        itself and closes. A handler waiting for the body sees a disconnect."""
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self.transport.close()  # a response is being written: nothing else can go out
            return
        status, message = 400, "malformed HTTP request (request line, headers or body framing)"
        buffered, limit = self.conn.trailing_data[0], self.config.h11_max_incomplete_event_size
        in_head = cycle is None or cycle.response_complete
        if in_head and limit is not None and len(buffered) > limit:  # h11: "Receive buffer too long"
            what, status = ("request headers", 431) if b"\r\n" in buffered else ("request line", 414)
            message = f"{what} too long (over {limit} bytes, --max-header-bytes)"
        self.limits.on_reject("malformed")
        self.transport.write(_raw_response(status, message))
        self.transport.close()
