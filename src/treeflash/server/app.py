"""The FastAPI app (`create_app`) and the uvicorn server that drains on SIGTERM.

Routes: /v1/models (and /v1/models/{id}), /v1/completions, /v1/chat/completions, vLLM's
/version, /tokenize and /detokenize (`utility.py`), /health
(liveness: the engine thread is alive), /health_generate (readiness: a real one-token generation under a
deadline), /metrics (Prometheus text). With an API key every route but /health needs
`Authorization: Bearer <key>`. No docs/openapi routes, no slash redirects (a redirect's
Location would be built from the client's Host header): an unknown path is a 404.

Shutdown: on SIGTERM/SIGINT the server stops admitting (503) and accepting connections,
in-flight requests get `shutdown_timeout` seconds to finish, whatever is left is aborted at
the engine's next step boundary (a stream ends with finish_reason "abort" and [DONE], a
non-streaming request gets its choices so far), uvicorn gives the handlers
`SHUTDOWN_WRITE_GRACE_S` to write those answers, the engine thread ends, and the process
exits 0: within the drain timeout plus one engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass, fields

import uvicorn
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from treeflash.sampling import SamplingParams
from treeflash.server.async_engine import AsyncEngine, Unavailable
from treeflash.server.connections import ConnectionLimits, guarded_h11
from treeflash.server.guard import GuardMiddleware
from treeflash.server.metrics import ServerMetrics, StatLogger
from treeflash.server.protocol import ApiError, error_body, new_id, now
from treeflash.server.serving import OpenAIServing
from treeflash.server.utility import add_utility_routes

log = logging.getLogger("treeflash.server")

# Once the engine has answered every request, the seconds the handlers get to write those
# answers before uvicorn cancels them (a client that does not read holds its socket's buffer).
SHUTDOWN_WRITE_GRACE_S = 5.0


@dataclass(frozen=True)
class ServerConfig:
    """Limits and policies of one server; `from_args` maps `treeflash serve` flags."""

    model_name: str = "treeflash"
    api_key: str | None = None
    max_n: int = 16
    max_body_bytes: int = 8 << 20
    max_header_count: int = 100
    max_header_bytes: int = 16 << 10  # the request line + headers (guard.py, connections.py)
    max_queued_requests: int = 256
    max_connections: int = 4096
    # None: a quarter of max_connections; 0: no cap (every connection comes from one proxy)
    max_connections_per_client: int | None = None
    request_read_timeout: float = 30.0  # for the request head, and again for the body
    shutdown_timeout: float = 0.0
    health_generate_timeout: float = 20.0
    log_interval: float = 10.0
    per_request_spec_decode_metrics: str = "none"  # none | summary | detailed

    @classmethod
    def from_args(cls, args) -> ServerConfig:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names and v is not None}
        if getattr(args, "served_model_name", None):
            values["model_name"] = args.served_model_name
        elif getattr(args, "model", None):
            values["model_name"] = args.model
        return cls(**values)


class ServerState:
    """What the routes share: the engine thread, metrics, serving logic and drain state."""

    def __init__(self, llm, cfg: ServerConfig):
        self.llm, self.cfg = llm, cfg
        self.metrics = ServerMetrics(cfg.model_name)
        self.async_engine = AsyncEngine(
            llm.engine, self.metrics, max_queued=cfg.max_queued_requests
        )
        self.serving = OpenAIServing(llm, self.async_engine, cfg)
        self.stat_logger = StatLogger(self.metrics, llm.device.type)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started = time.time()

    def request_drain(self) -> None:
        """Thread- and signal-safe: stop admitting and abort what is left after the timeout."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.begin_drain)

    def begin_drain(self) -> None:
        """In the loop thread: stop admitting; abort what is left after shutdown_timeout."""
        if self.async_engine.draining:
            return
        self.async_engine.draining = True
        log.info(
            "Draining: no new requests; in-flight ones get %.1fs (--shutdown-timeout)",
            self.cfg.shutdown_timeout,
        )
        self.loop.call_later(self.cfg.shutdown_timeout, self.async_engine.abort_all)

    async def log_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.log_interval)
            self.stat_logger.log()


def create_app(llm, args=None) -> FastAPI:
    """An app serving `llm` (a treeflash.LLM); args: a ServerConfig, argparse flags or None."""
    cfg = (
        args
        if isinstance(args, ServerConfig)
        else ServerConfig.from_args(args)
        if args
        else ServerConfig()
    )
    state = ServerState(llm, cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.async_engine.start(state.loop)
        logger = asyncio.ensure_future(state.log_periodically()) if cfg.log_interval > 0 else None
        try:
            yield
        finally:
            if logger is not None:
                logger.cancel()
                state.stat_logger.log()  # the last interval, so short runs leave a line too
            state.async_engine.draining = True
            await asyncio.to_thread(state.async_engine.stop)

    app = FastAPI(
        title="treeflash", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
        redirect_slashes=False,
    )
    app.state.treeflash = state
    app.add_middleware(
        GuardMiddleware,
        api_key=cfg.api_key,
        max_header_count=cfg.max_header_count,
        max_header_bytes=cfg.max_header_bytes,
        on_reject=state.metrics.on_reject,
    )
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(  # e.headers: the Allow of a 405
            error_body(e.status_code, str(e.detail)), status_code=e.status_code, headers=e.headers
        )

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, e: ClientDisconnect):
        # The client left (or its framing broke, answered by connections.py) while its body
        # was read: nothing to answer, nothing of it ran.
        log.debug("client gone while sending the body of %s", request.url.path)
        return Response(status_code=400)  # never sent: uvicorn drops writes to a gone client

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        # One line here; Starlette re-raises and uvicorn logs the traceback (once).
        log.error("unhandled error on %s: %r", request.url.path, e)
        return JSONResponse(error_body(500, "internal server error"), status_code=500)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    cfg, ae = state.cfg, state.async_engine

    def card() -> dict:
        return {
            "id": cfg.model_name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "treeflash",
            "root": cfg.model_name,
            "max_model_len": state.llm.engine.max_model_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")  # OpenAI's models.retrieve; served names may hold "/"
    async def model(model_id: str):
        if model_id != cfg.model_name:
            raise ApiError(404, f"The model `{model_id[:200]}` does not exist.", param="model",
                           code="model_not_found")
        return card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await state.serving.chat(request)

    @app.get("/health")
    async def health():
        if not ae.alive:
            raise ApiError(503, f"the engine is not running ({ae.dead or 'stopped'})")
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        return await _health_generate(state)

    @app.get("/metrics")
    async def metrics():
        return Response(
            state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    add_utility_routes(app, state)  # /version, /tokenize, /detokenize


async def _health_generate(state: ServerState) -> dict:
    """Generate one token from a one-token prompt within the deadline, else 503."""
    cfg, ae, engine = state.cfg, state.async_engine, state.llm.engine
    probe = engine.cfg.bos_token_id
    probe = probe if probe is not None and 0 <= probe < engine.cfg.vocab_size else 0
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.monotonic()
    try:
        sub = ae.submit(
            [(0, [probe], params)], request_id=new_id("health"), bypass_queue_limit=True
        )
    except Unavailable as e:
        raise ApiError(503, str(e)) from None
    try:
        async with asyncio.timeout(cfg.health_generate_timeout):
            event = await sub.queue.get()
            while not event.finished:
                event = await sub.queue.get()
    except TimeoutError:
        raise ApiError(503, f"no token within {cfg.health_generate_timeout}s") from None
    finally:
        sub.abort()
    if event.finish_reason not in ("length", "stop"):
        raise ApiError(503, f"the probe request ended with {event.finish_reason}: {event.error}")
    return {"status": "ok", "seconds": round(time.monotonic() - t0, 4), "time": now()}


class DrainingServer(uvicorn.Server):
    """uvicorn that, on SIGTERM/SIGINT, also tells the app to drain; exits 0 when done
    (it does not re-raise the signal the way plain uvicorn does)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        state.async_engine.on_death = self._engine_died

    def _engine_died(self) -> None:
        # Nothing can be served any more (a dead tensor-parallel rank, say): exit, and let a
        # supervisor restart the server, instead of answering every request with an error.
        log.error("shutting down: %s", self.state.async_engine.dead)
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        """Stop accepting, let the engine answer every in-flight request (finished, or aborted
        at the step boundary after shutdown_timeout), then uvicorn's own shutdown, whose
        graceful timeout is only the handlers' time to write those answers."""
        self.state.begin_drain()  # also when should_exit was set without a signal
        for server in self.servers:
            server.close()
        await self.state.async_engine.until_delivered(lambda: self.force_exit)
        await super().shutdown(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if sockets and self.started:  # uvicorn says where it listens only for sockets it bound itself
            host, port = sockets[0].getsockname()[:2]
            host = f"[{host}]" if ":" in host else host
            logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                                                    host, port)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        self.should_exit = True
        self.state.request_drain()


def make_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 30000, log_level: str = "info"
) -> DrainingServer:
    state: ServerState = app.state.treeflash
    cfg = state.cfg
    limits = ConnectionLimits(
        cfg.request_read_timeout,
        cfg.max_connections,
        (cfg.max_connections // 4 if cfg.max_connections_per_client is None
         else cfg.max_connections_per_client),
        on_reject=state.metrics.on_reject,
    )
    # No limit_concurrency: uvicorn counts a stalled connection like a busy one and, at the
    # limit, answers every route (/health too) 503; connections.py caps connections when they
    # open, per client and in all, and the engine's queue bounds the work.
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_h11(limits),
        ws="none",  # no WebSocket routes: an Upgrade is a plain request
        loop="asyncio",
        lifespan="on",
        log_level=log_level,
        access_log=False,
        h11_max_incomplete_event_size=cfg.max_header_bytes,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=SHUTDOWN_WRITE_GRACE_S,
    )
    return DrainingServer(config, state)
