"""`treeflash serve`: flags (named like SGLang's where it has one, vLLM's spellings accepted) -> LLM
-> app -> uvicorn, with one startup line saying what was loaded and where it listens."""

from __future__ import annotations

import argparse
import logging
import socket

from treeflash import flags, knobs, progress

log = logging.getLogger("treeflash.server")


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [1, 65535], got {value}")
    return value


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads (as uvicorn would bind it), so a
    taken port or a bad host fails in a second, not after minutes of loading weights."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port}: {e.strerror or e}") from None
    return sock


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a DeepSeek-V3 / Kimi-K2 checkpoint over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health, /health_generate, /metrics, and "
        "vLLM's /version, /tokenize, /detokenize) with continuous batching and DFlash/DDTree speculative "
        "decoding. Flags take SGLang's names, and vLLM's spellings where the meaning is the same.",
    )
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the target checkpoint directory, as in `vllm serve MODEL` (the same as --model)")
    flags.add_model_flags(p, serving=True)
    m = p.add_argument_group("serving")
    m.add_argument(
        "--served-model-name",
        help="model id /v1/models lists and clients may send (a request without \"model\" gets it too; "
        "default: the --model value as given)",
    )
    m.add_argument("--seed", type=int, default=0, help="engine seed for requests without one")
    flags.add_chat_arguments(m)
    m.add_argument(
        "--max-queued-requests",
        type=flags.positive_int,
        default=256,
        help="requests waiting for admission; beyond this new requests get 503 (default 256)",
    )
    h = p.add_argument_group("HTTP")
    _add_http_flags(h)
    _add_request_limits(h)
    _add_health_and_logs(h)
    p.set_defaults(func=_cmd_serve)


def _add_http_flags(h) -> None:
    """Where the server listens, its key and how it stops."""
    h.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1, loopback "
        "only; use 0.0.0.0 deliberately, behind a proxy)",
    )
    h.add_argument("--port", type=_port, default=30000, help="port to bind (default 30000)")
    h.add_argument(
        "--api-key",
        default=knobs.get("TREEFLASH_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $TREEFLASH_API_KEY, else no key)",
    )
    h.add_argument(
        "--shutdown-timeout",
        type=_non_negative_float,
        default=0.0,
        help="on SIGTERM stop admitting and let in-flight requests finish for this many "
        "seconds, then abort the rest and exit (default 0: abort at once)",
    )


def _add_request_limits(h) -> None:
    """What one request and one client may take: choices, bytes, headers, time, connections."""
    h.add_argument(
        "--max-n",
        type=flags.positive_int,
        default=16,
        help="largest n (choices per request) accepted (default 16)",
    )
    h.add_argument(
        "--max-body-bytes",
        type=flags.positive_int,
        default=8 << 20,
        help="largest request body; larger ones get 413 before parsing (default 8 MiB)",
    )
    h.add_argument(
        "--max-header-bytes",
        type=flags.positive_int,
        default=16 << 10,
        help="largest request line + headers; a longer line gets 414, longer headers 431 "
        "(default 16 KiB)",
    )
    h.add_argument(
        "--max-header-count",
        type=flags.positive_int,
        default=100,
        help="most request headers; more get 431 (default 100)",
    )
    h.add_argument(
        "--request-read-timeout",
        type=_positive_float,
        default=30.0,
        help="seconds a client has to send a request's line and headers, and again its body; "
        "then 408 and the connection is closed (default 30)",
    )
    h.add_argument(
        "--max-connections",
        type=flags.positive_int,
        default=4096,
        help="open connections; a new one beyond gets 503 and is closed (default 4096)",
    )
    h.add_argument(
        "--max-connections-per-client",
        type=_non_negative_int,
        default=None,
        help="open connections one client address may hold; beyond, 429 and closed. 0 = no "
        "cap, for a server behind a reverse proxy (every connection is the proxy's; "
        "default: a quarter of --max-connections)",
    )


def _add_health_and_logs(h) -> None:
    """/health_generate's deadline, per-request metrics and the logs."""
    h.add_argument(
        "--health-generate-timeout",
        type=_non_negative_float,
        default=20.0,
        help="deadline of /health_generate's one-token generation in seconds (default 20)",
    )
    h.add_argument(
        "--per-request-spec-decode-metrics",
        choices=["none", "summary", "detailed"],
        default="none",
        help="add vLLM's metrics.speculative_decoding to each response "
        "(summary: totals and histogram; detailed: also per-step lists)",
    )
    h.add_argument(
        "--log-interval",
        type=_non_negative_float,
        default=10.0,
        help="seconds between stats log lines in vLLM's wording (0 = off; default 10)",
    )
    h.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default info)",
    )


def resolve_spec(args) -> tuple[str | None, str | None]:
    """(drafter path, LLM spec mode) from --drafter and --speculative-algorithm."""
    from treeflash.engine.llm import EMBEDDED

    drafter = args.drafter
    if args.model is None and drafter is None and (EMBEDDED / "drafter" / "config.json").is_file():
        drafter = str(EMBEDDED / "drafter")
    if args.spec == "off":
        return None, "off"
    if args.spec is not None and drafter is None:
        raise ValueError(f"--speculative-algorithm {args.spec.upper()} needs --drafter")
    return drafter, args.spec


def _cmd_serve(args) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    import treeflash.server.app  # noqa: F401  (without the server extra: fail now, not after loading)

    drafter, spec = resolve_spec(args)
    sock = bind_socket(args.host, args.port)
    try:
        return _load_and_serve(args, sock, drafter, spec)
    finally:
        sock.close()


def _load_and_serve(args, sock: socket.socket, drafter: str | None, spec: str | None) -> int:
    from treeflash import LLM
    from treeflash.server.app import create_app, make_server

    with progress.spinner(f"loading {args.model or 'the shipped pair'}", show=progress.wanted()):
        llm = LLM(
            args.model,
            drafter,
            spec=spec,
            tree_budget=args.tree_budget,
            device=args.device,
            dtype=args.dtype,
            page_size=args.page_size,
            max_model_len=args.max_model_len,
            seed=args.seed,
            kv_cache_tokens=args.max_total_tokens,
            max_running=args.max_running_requests,
            tp=args.tp,
            ep=args.ep,
            dcp=args.dcp,
            cuda_graphs=args.cuda_graphs,
            tokenizer=args.tokenizer,
            chat_template=args.chat_template,
            kv_memory_fraction=args.mem_fraction,
            kv_cache_dtype=args.kv_cache_dtype,
            runtime_options=getattr(args, "runtime_options", None),  # set by flags.resolve
        )
    log.info("KV cache: %s", llm.kv_summary())
    if llm.cuda_graphs:  # kernels compiled and graphs captured before the first request, at every batch size
        log.info("warm-up (every plan this engine may use, batches up to %d): %.1f s", args.max_running_requests,
                 llm.warmup(max_batch=args.max_running_requests))
    if args.served_model_name is None and args.model is None:
        args.served_model_name = "treeflash-embedded"
    app = create_app(llm, args)
    server = make_server(app, args.host, args.port, args.log_level)
    log.info("%s", startup_line(llm, args, drafter, sock))
    try:
        server.run(sockets=[sock])
    finally:
        llm.close()  # stops tensor-parallel followers, if any
    return 0 if server.started and app.state.treeflash.async_engine.dead is None else 1


def startup_line(llm, args, drafter: str | None, sock: socket.socket) -> str:
    """What was loaded and where it listens, on one line: model, drafter, speculation mode and
    budget, device, dtype, KV capacity in tokens, address."""
    spec = llm.engine.spec
    if spec is None:
        speculation = "no speculation"
    elif spec.mode == "dflash":
        speculation = f"dflash (a chain of {spec.budget})"
    else:
        speculation = f"ddtree (budget {'auto, up to ' if spec.auto else ''}{spec.budget})"
    pool = llm.pool
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    tp = f" x tp {args.tp}" if args.tp > 1 else ""
    tp += f" (dcp {pool.dcp}: pages dealt over {pool.dcp} ranks)" if pool.dcp > 1 else ""
    return (f"serving {args.model or 'the shipped model'} as '{args.served_model_name or args.model}', drafter "
            f"{drafter or 'none'}, {speculation}, on {llm.device}{tp} in {str(llm.dtype).removeprefix('torch.')}, "
            f"KV cache {pool.num_pages * pool.tokens_per_page} tokens ({pool.num_pages} pages of "
            f"{pool.tokens_per_page}), "
            f"max_model_len {llm.engine.max_model_len}, at http://{host}:{port}")
