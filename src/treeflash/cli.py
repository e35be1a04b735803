"""The `treeflash` command: generate, serve, bench, doctor, train.

Each subcommand lives in its own module and registers its flags here; bad arguments end
with a one-line error and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from treeflash import flags, knobs, progress
from treeflash.flags import add_chat_arguments, positive_int, tree_budget_arg  # noqa: F401  (re-exported: bench, serve)


class CLIError(Exception):
    """A user mistake: printed as `treeflash: error: ...`, exit code 2."""


def positive_float(text: str) -> float:
    """A finite number > 0 (a ceiling in bytes/s or flop/s)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def sizes_arg(text: str) -> list[int]:
    """A comma list of token counts, k = 1024 ('1k,8k,185k', '4096'), each >= 1."""
    try:
        return flags.parse_sizes(text)
    except ValueError as e:
        if "must be" in str(e):
            raise argparse.ArgumentTypeError(str(e)) from None
        raise argparse.ArgumentTypeError(f"expected token counts like 1k,32k or 4096 (k = 1024), "
                                         f"got {text!r}") from None


def size_arg(text: str) -> int:
    """One token count, k = 1024 ('32k', '4096')."""
    sizes = sizes_arg(text)
    if len(sizes) != 1:
        raise argparse.ArgumentTypeError(f"expected one token count like 32k, got {text!r}")
    return sizes[0]


def resolve_model_paths(args) -> tuple[str | None, str | None]:
    """(model, drafter) as given; with neither, `LLM` picks the shipped pair itself."""
    return args.model, (None if args.spec == "off" else args.drafter)


def build_llm(args, **extra):
    from treeflash import LLM

    model, drafter = resolve_model_paths(args)
    if args.tree_budget is not None and args.spec in ("dflash", "off"):
        print(f"treeflash: note: --tree-budget applies to --spec ddtree; {args.spec} ignores it",
              file=sys.stderr)
    show = progress.wanted(getattr(args, "quiet", False))
    with progress.spinner(f"loading {model or 'the shipped pair'}", show=show):
        return LLM(model, drafter, spec=args.spec, tree_budget=args.tree_budget, device=args.device,
                   dtype=args.dtype, page_size=args.page_size, max_model_len=args.max_model_len,
                   tp=args.tp, ep=args.ep, dcp=args.dcp, cuda_graphs=args.cuda_graphs,
                   kv_cache_tokens=getattr(args, "max_total_tokens", None),
                   max_running=getattr(args, "max_running_requests", 64),
                   kv_memory_fraction=getattr(args, "mem_fraction", None), kv_cache_dtype=args.kv_cache_dtype,
                   runtime_options=getattr(args, "runtime_options", None), **extra)


def read_prompt(text: str) -> tuple[str, bool]:
    """(prompt, whether it came from stdin or a file): `-` reads stdin, `@PATH` a file, `@@...` is a
    literal leading @. Bytes that are not UTF-8 are kept as surrogates, for `LLM.encode` to name."""
    if text == "-":
        if sys.stdin is None or sys.stdin.isatty():
            print("treeflash: reading the prompt from stdin (end it with Ctrl-D)", file=sys.stderr)
        return sys.stdin.buffer.read().decode("utf-8", "surrogateescape"), True
    if text.startswith("@@"):
        return text[1:], False
    if text.startswith("@"):
        path = Path(text[1:])
        if not path.is_file():
            raise CLIError(f"{text}: no such file (a prompt starting with @ names a file to read; write @@ for a "
                           "literal @)")
        return path.read_bytes().decode("utf-8", "surrogateescape"), True
    return text, False


def _register_generate(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt and print the text and acceptance figures",
                       description="Complete PROMPT with the target model (and its drafter). Progress (loading, "
                       "prefill, decode) is drawn on stderr when it is a terminal.")
    p.add_argument("prompt", help="the prompt text; - reads it from stdin, @FILE from a file (@@ for a literal "
                   "leading @): for prompts longer than the shell allows")
    flags.add_model_flags(p, serving=True)
    add_chat_arguments(p)
    o = p.add_argument_group("sampling and output")
    o.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate (default 64)")
    o.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    o.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    o.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    o.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same output)")
    o.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    o.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, metrics); no progress")
    o.add_argument("-q", "--quiet", action="store_true", help="print the text alone: no progress, no summary line")
    o.add_argument("--chat", action="store_true",
                   help="send PROMPT as one user message through the chat template (the tokenizer's, or "
                   "--chat-template; without one, the plain 'role: content' template) and print the reply")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args) -> int:
    from treeflash import SamplingParams

    prompt, from_file = read_prompt(args.prompt)
    if not prompt:
        raise CLIError("the prompt is empty")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    args.quiet = args.quiet or args.json
    llm = build_llm(args, tokenizer=args.tokenizer, chat_template=args.chat_template)
    try:
        clock = progress.Stopwatch()
        if args.chat:
            run = lambda on_step: llm.chat([{"role": "user", "content": prompt}], params, on_step=on_step)
        else:
            run = lambda on_step: llm.generate(prompt, params, on_step=on_step)[0]
        out = _generate_with_progress(llm, run, params, progress.wanted(args.quiet))
        seconds = clock.seconds
    finally:
        llm.close()  # tensor parallel: followers exit and the process group is destroyed
    report = {
        "prompt": prompt, "text": out.text, "token_ids": out.token_ids,
        "finish_reason": out.finish_reason, "num_tokens": len(out.token_ids),
        "num_prompt_tokens": len(out.prompt_token_ids),
        "seconds": round(seconds, 4), "tokens_per_second": round(len(out.token_ids) / seconds, 2),
        "device": str(llm.device), "metrics": out.metrics,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(out.text if from_file or args.chat else prompt + out.text)
    if not args.quiet:
        print(summary_line(report), file=sys.stderr)
    return 0


def _generate_with_progress(llm, run, params, show: bool):
    """`run(on_step)` (one generation: a prompt or a chat) with a prefill bar for a prompt of more
    than one chunk (an engine step prefills one chunk), then a decode bar."""
    prefill = decode = None

    def on_step(reqs) -> None:
        nonlocal prefill, decode
        req = reqs[0]
        if prefill is None:
            many = len(req.prompt_ids) > llm.engine.prefill_chunk
            prefill = progress.bar(len(req.prompt_ids), "prefill", unit="tok", show=show and many)
        if not req.output_ids:
            prefill.update(req.num_cached - prefill.n)
            return
        if decode is None:
            prefill.update(len(req.prompt_ids) - prefill.n)
            prefill.close()
            decode = progress.bar(params.max_tokens, "decode", unit="tok", show=show)
        decode.update(len(req.output_ids) - decode.n)

    try:
        return run(on_step)
    finally:
        for bar in (prefill, decode):
            if bar is not None:
                bar.close()


def summary_line(report: dict) -> str:
    """`[64 tokens in 2.10s on cpu: prefill 6 tokens 0.05s, decode 31.2 tok/s; ddtree: mean acceptance
    length 3.32 over 19 steps, budget 31, finish: length]`"""
    line = f"[{report['num_tokens']} tokens in {report['seconds']:.2f}s on {report['device']}"
    timing = report["metrics"].get("timing") or {}
    if timing.get("ttft_s") is not None:
        line += f": prefill {report['num_prompt_tokens']} tokens {timing['ttft_s']:.2f}s"
        if timing.get("decode_tokens"):
            line += f", decode {timing['decode_tokens'] / max(timing['decode_s'], 1e-9):.2f} tok/s"
    spec = report["metrics"].get("speculative_decoding")
    if spec and spec.get("num_spec_steps"):
        line += (f"; {spec['spec_mode']}: mean acceptance length {spec['mean_acceptance_length']:.2f}"
                 f" over {spec['num_spec_steps']} steps, budget {spec['tree_budget']}")
        if spec.get("num_plain_steps"):  # tree_budget auto: trees by size, and steps without one
            line += f" ({spec['steps_by_budget']}, {spec['num_plain_steps']} plain)"
    elif spec and spec.get("num_plain_steps"):  # auto found no tree that pays for this request
        line += (f"; {spec['spec_mode']}: no tree paid, {spec['num_plain_steps']} plain steps, "
                 f"budget {spec['tree_budget']}")
    elif spec:  # the prefill's token was the only one: no speculative step ran
        line += f"; {spec['spec_mode']}: no speculative step ran (the prefill made the only token)"
    return line + f", finish: {report['finish_reason']}]"


_EXTRAS = {
    "treeflash.server.cli": ("serve", "server", "run the OpenAI-compatible HTTP server"),
    "treeflash.bench.cli": ("bench", "bench", "benchmarks: decode sweep against context, verify kernel"),
    "treeflash.doctor_cli": ("doctor", "bench", "check each known cause of slow or useless speculation"),
    "treeflash.train.cli": ("train", "train", "train the tokenizer, target and DFlash drafter"),
}


def _register_optional(sub) -> None:
    """Subcommands whose modules may need an extra; without it they say what to install."""
    for module, (name, extra, help_text) in _EXTRAS.items():
        try:
            mod = __import__(module, fromlist=["register"])
        except ImportError as e:
            missing = e.name or "a dependency"
            p = sub.add_parser(name, help=f"{help_text} (needs: pip install 'treeflash[{extra}]')")
            p.set_defaults(func=lambda args, m=missing, x=extra: _missing_extra(m, x))
            continue
        mod.register(sub)


def _missing_extra(module: str, extra: str) -> int:
    raise CLIError(f"this command needs the '{extra}' extra ({module} is not installed): "
                   f"pip install 'treeflash[{extra}]'")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treeflash",
        description="DFlash + DDTree speculative decoding for DeepSeek-V3 / Kimi-K2 models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _register_generate(sub)
    _register_optional(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from treeflash.parallel.errors import DistributedError

    parser = make_parser()
    args = parser.parse_args(argv)
    notes, errors = knobs.check_environment()
    if errors:  # before any model loads: a mistyped value is not a silent default
        parser.exit(2, "".join(f"treeflash {args.command}: error: {e}\n" for e in errors))
    if args.command != "doctor":  # (the doctor reports them as a check)
        for note in notes:
            print(f"treeflash: note: {note}", file=sys.stderr)
    try:
        if hasattr(args, "enforce_eager"):
            flags.resolve(args)  # the shared model flags (flags.add_model_flags)
            if args.command != "doctor":  # (the doctor reports them as a check)
                for note in args.runtime_options.notes():
                    print(f"treeflash: note: {note}", file=sys.stderr)
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not in the interpreter's exit
        return rc
    except BrokenPipeError:  # `treeflash ... | head`: the reader left; say nothing more
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what the shell reports for a writer killed by it
    except (CLIError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
            FileExistsError) as e:  # a user's mistake (a path that is wrong): no traceback
        parser.exit(2, f"treeflash {args.command}: error: {e}\n")
    except DistributedError as e:  # a tensor-parallel rank died or hung: its stderr has the rest
        parser.exit(1, f"treeflash {args.command}: error: {e}\n")
    except ImportError as e:
        if e.name is None or e.name.startswith("treeflash"):
            raise
        extra = "triton" if e.name.split(".")[0] == "triton" else \
            {"serve": "server", "train": "train"}.get(args.command, "bench")
        parser.exit(2, f"treeflash {args.command}: error: {e.name} is not installed: "
                       f"pip install 'treeflash[{extra}]'\n")
    except KeyboardInterrupt:
        return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush on exit does not raise
    BrokenPipeError again (Python's documented recipe, docs.python.org/3/library/signal.html)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())


