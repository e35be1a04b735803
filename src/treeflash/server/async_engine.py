"""The engine thread: one background thread owns the (not thread-safe) Engine.

The event loop talks to it only through a command queue (add, abort, abort-all, stop) and
gets back per-request `Event`s delivered with `loop.call_soon_threadsafe` onto the asyncio
queue of the HTTP request that owns them. The loop never blocks on a step, and the engine
thread never touches asyncio objects directly. Nothing crosses a process boundary (no
pickling, no sockets).

Commands take effect at step boundaries; a step is at most one prefill chunk plus one decode
(engine/engine.py), so an abort, a disconnect or a shutdown lands within that. The running /
waiting / KV gauges are published when a request is submitted, when the engine admits it
(before its prefill computes) and after every step, before the step's events are posted.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from treeflash.parallel.errors import DistributedError
from treeflash.sampling import SamplingParams
from treeflash.server.metrics import ServerMetrics

log = logging.getLogger("treeflash.server")

IDLE_POLL_S = 0.05  # how often an idle engine thread refreshes gauges and looks for stop
STOP_LOG_S = 10.0  # while stopping, how often to say that the engine's step is still running


class Unavailable(Exception):
    """The engine cannot take the request now (queue full, draining, dead): HTTP 503."""


@dataclass
class Event:
    """New tokens of one choice; the last one has finished=True, the final text and metrics."""

    index: int
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    text: str | None = None
    metrics: dict[str, Any] | None = None
    error: str | None = None
    status: int = 500  # the HTTP status that `error` is answered with
    # accepted: the engine has taken the choice (the first event of every choice it takes);
    # refused: it never reached the engine, nothing of it ran (the choice's only event).
    accepted: bool = False
    refused: bool = False


@dataclass
class _Live:
    """Engine-thread bookkeeping of one engine request."""

    submission: Submission
    index: int
    request: Any
    arrival: float
    last_output: float | None = None
    sent: int = 0  # output tokens already posted


class Submission:
    """The engine requests of one HTTP request (its n choices and prompts); events arrive on
    `queue` in the event loop. `abort()` cancels whatever has not finished."""

    def __init__(self, engine: AsyncEngine, request_ids: Sequence[str]):
        self.engine = engine
        self.request_ids = list(request_ids)
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.unfinished = set(self.request_ids)  # updated on delivery, in the loop thread

    def abort(self) -> None:
        for rid in list(self.unfinished):
            self.engine.abort(rid)


class AsyncEngine:
    def __init__(self, engine, metrics: ServerMetrics, *, max_queued: int):
        self.engine = engine
        self.pool = engine.pool
        self.metrics = metrics
        self.max_queued = max_queued
        self.draining = False
        self.dead: str | None = None  # why the engine thread stopped unexpectedly
        self.on_death: Callable[[], None] | None = None  # called in the loop thread once dead is set
        self.last_step_time: float | None = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        # Held by submit from its checks to its last put, and by the engine thread to close:
        # an add is then either enqueued before the thread's last drain or refused.
        self._admit_lock = threading.Lock()
        self._closed: str | None = None  # why the engine thread takes no more commands
        self._live: dict[str, _Live] = {}  # engine thread only
        self._unfinished = 0  # loop thread only: submitted, final event not yet delivered
        self._num_running = 0  # published by the engine thread
        # Gauges: the engine thread's last view (running, waiting, free pages, total pages) plus
        # the adds submitted but not yet taken by the engine thread, under one lock so that the
        # two threads' publications never interleave.
        self._gauge_lock = threading.Lock()
        self._engine_view = (0, 0, self.pool.num_free_pages, self.pool.num_pages)
        self._queued_adds = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        engine.spec_listeners.append(metrics.on_spec_step)

    # ---- event-loop side -----------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="treeflash-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return alive and self.dead is None and self._closed is None

    def submit(
        self,
        choices: Sequence[tuple[int, list[int], SamplingParams]],
        *,
        request_id: str,
        bypass_queue_limit: bool = False,
    ) -> Submission:
        """Queue (index, prompt_ids, params) choices as engine requests `request_id-index`.
        Validate first (Engine.validate): this only refuses for capacity reasons."""
        with self._admit_lock:
            return self._submit(choices, request_id, bypass_queue_limit)

    def _submit(
        self,
        choices: Sequence[tuple[int, list[int], SamplingParams]],
        request_id: str,
        bypass_queue_limit: bool,
    ) -> Submission:
        if not self.alive:
            raise Unavailable(
                f"the engine is not running ({self.dead or self._closed or 'stopped'})"
            )
        if self.draining:
            raise Unavailable("the server is shutting down and admits no new requests")
        queued = self._unfinished - self._num_running
        if not bypass_queue_limit and queued + len(choices) > self.max_queued:
            raise Unavailable(
                f"the request queue is full ({queued} waiting, "
                f"--max-queued-requests={self.max_queued}); retry later"
            )
        sub = Submission(self, [f"{request_id}-{i}" for i, _, _ in choices])
        self._unfinished += len(choices)
        now = time.monotonic()
        for rid, (index, ids, params) in zip(sub.request_ids, choices, strict=True):
            self._cmds.put(("add", rid, index, ids, params, sub, now))
        self._publish(queued=len(choices))  # waiting now, not after the step in progress
        return sub

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    def abort_all(self) -> None:
        self._cmds.put(("abort_all",))

    def stop(self) -> None:
        """Abort everything left and end the thread at its next step boundary (blocking; call
        from a worker thread). It waits for the step in progress: a process that exits while
        the thread is inside torch dies with SIGABRT instead of exiting 0."""
        self._cmds.put(("stop",))
        t0 = time.monotonic()
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(STOP_LOG_S)
            if self._thread.is_alive():
                log.warning("stopping: the engine's current step has run %.0f s",
                            time.monotonic() - t0)

    async def until_delivered(self, give_up: Callable[[], bool] = lambda: False) -> None:
        """Return once every submitted choice's final event is delivered (or give_up())."""
        while self._unfinished and not give_up():
            await asyncio.sleep(IDLE_POLL_S)

    def _deliver(self, sub: Submission, rid: str, event: Event) -> None:
        """Runs in the loop thread."""
        if event.finished and rid in sub.unfinished:
            sub.unfinished.discard(rid)
            self._unfinished -= 1
        sub.queue.put_nowait(event)

    # ---- engine-thread side --------------------------------------------------------
    def _post(self, live: _Live, rid: str, event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, live.submission, rid, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        try:
            while not self._stop:
                self._apply_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished() and not self._stop:
                    self._step()
                elif not self._stop:
                    # Idle: a tensor-parallel rank that died since the last step is found now
                    # (raises DistributedError, which ends the thread and the server), not by
                    # the next request.
                    self.engine.executor.check()
                self._publish()
        except BaseException as e:  # noqa: BLE001 - the thread must say why it died
            self.dead = f"engine thread crashed: {e!r}"
            log.exception("engine thread crashed")
        finally:
            reason = "the server is shutting down" if self.dead is None else self.dead
            with self._admit_lock:  # a submit between its checks and its puts finishes first
                self._closed = reason
            self._refuse_pending(f"the engine is not running ({reason})")
            self._abort_all(reason)
            self._publish()
            if self.dead is not None and self.on_death is not None and self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self.on_death)
                except RuntimeError:  # the loop is closed: the server is gone already
                    pass

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=IDLE_POLL_S) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            if self._stop:
                return  # what follows "stop" is refused by _refuse_pending, never added
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _refuse_pending(self, error: str) -> None:
        """End the requests still queued as commands: no step will ever add them. They never
        reached the engine, so they are refused as unavailable (503), like a late submit."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                rid, index, _, _, sub, arrival = cmd[1:]
                self._publish(queued=-1)
                self._post_refusal(_Live(sub, index, None, arrival), rid, error, 503)

    def _post_refusal(self, live: _Live, rid: str, error: str, status: int) -> None:
        """The only event of a choice that never reached the engine: no tokens, no metrics of
        a finished request (the HTTP layer counts the refusal, once per HTTP request)."""
        self._post(live, rid, Event(live.index, [], True, "abort", "", error=error, status=status,
                                    refused=True))

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            self._add(*cmd[1:])
        elif kind == "abort":
            self._abort(cmd[1], None)
        elif kind == "abort_all":
            self._abort_all(None)
        elif kind == "stop":
            self._stop = True

    def _add(
        self,
        rid: str,
        index: int,
        ids: list[int],
        params: SamplingParams,
        sub: Submission,
        arrival: float,
    ) -> None:
        live = _Live(sub, index, None, arrival)
        try:
            live.request = self.engine.add_request(ids, params, rid)
        except ValueError as e:  # validated before; only a race with a config change lands here
            self._publish(queued=-1)
            self._post_refusal(live, rid, str(e), 400)
            return
        self._publish(queued=-1)
        self._live[rid] = live
        self._post(live, rid, Event(index, [], accepted=True))

    def _abort(self, rid: str, error: str | None) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return  # already finished
        req = live.request
        if req is not None and req.finished:
            # It finished inside a step that then failed, so its outputs were never posted:
            # deliver its own ending (and tokens), not an abort.
            self._post_end(live, rid, req.finish_reason, None)
            return
        try:
            self.engine.abort(rid)
        except Exception:  # noqa: BLE001 - pages of a broken request; keep serving the others
            log.exception("abort of %s failed", rid)
        self._post_end(live, rid, "abort", error)

    def _post_end(
        self, live: _Live, rid: str, reason: str, error: str | None, status: int = 500
    ) -> None:
        """The final event of `live`, with whatever tokens it produced but were not posted
        (those of a step that then failed): they are accounted like a step's outputs, so a
        request whose first token came in that step gets its one TTFT sample."""
        now = time.monotonic()
        req = live.request
        tokens = req.output_ids[live.sent :] if req else []
        self._account(live, tokens, now)
        live.sent += len(tokens)
        self.metrics.on_finish(reason, now - live.arrival)
        text, metrics = (req.text, dict(req.metrics)) if req else ("", None)
        event = Event(live.index, tokens, True, reason, text, metrics, error=error, status=status)
        self._post(live, rid, event)

    def _abort_all(self, error: str | None) -> None:
        for rid in list(self._live):
            self._abort(rid, error)

    def _step(self) -> None:
        try:
            if self.engine.admit():
                self._publish()  # running and KV in use before the prefill computes
            outputs = self.engine.step()
        except DistributedError as e:  # a rank died or hung: every later step fails too
            self._abort_all(f"the engine failed while running this request: {e}")
            raise
        except Exception as e:  # noqa: BLE001 - fail the batch, not the server
            log.exception("engine step failed; aborting its requests")
            self._abort_all(f"the engine failed while running this request: {e}")
            return
        now = time.monotonic()
        self.last_step_time = now
        self._publish()  # a client that has its final event sees gauges without it
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            self._account(live, out.new_token_ids, now)
            live.sent += len(out.new_token_ids)
            event = Event(live.index, list(out.new_token_ids), out.finished, out.finish_reason)
            if out.finished:
                del self._live[out.request_id]
                event.text = live.request.text
                event.metrics = dict(live.request.metrics)
                self.metrics.on_finish(out.finish_reason, now - live.arrival)
            self._post(live, out.request_id, event)

    def _account(self, live: _Live, tokens: list[int], now: float) -> None:
        """TTFT (once, at the first output that holds a token), ITL and token counters."""
        if not tokens:
            return  # no token: neither a first token nor an inter-token gap
        if live.last_output is None:
            self.metrics.on_first_tokens(len(live.request.prompt_ids), now - live.arrival)
            self.metrics.on_tokens(len(tokens), None)
        else:
            self.metrics.on_tokens(len(tokens), now - live.last_output)
        live.last_output = now

    def _publish(self, queued: int | None = None) -> None:
        """Set the gauges. From the engine thread (queued None or -1: an add taken) with its
        view of the engine; from the loop thread (queued = choices just submitted) with the
        engine thread's last view, which it must not read itself."""
        with self._gauge_lock:
            if queued is not None:
                self._queued_adds += queued
            if queued is None or queued < 0:
                e = self.engine
                self._num_running = len(e.running)
                self._engine_view = (len(e.running), len(e.waiting), self.pool.num_free_pages,
                                     self.pool.num_pages)
            running, waiting, free, total = self._engine_view
            self.metrics.set_state(running, waiting + self._queued_adds, free, total)
