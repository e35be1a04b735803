"""The `treeflash` command: generate, serve, bench, doctor, train.

Each subcommand lives in its own module and registers its flags here; bad arguments end
with a one-line error and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from treeflash import knobs


class CLIError(Exception):
    """A user mistake: printed as `treeflash: error: ...`, exit code 2."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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
    from treeflash.bench.sweep import parse_sizes

    try:
        return parse_sizes(text)
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


def tree_budget_arg(text: str) -> int | str:
    """A node budget >= 1, or "auto" (sized per step and request: spec/budget.py)."""
    return text if text == "auto" else positive_int(text)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by generate, bench sweep and doctor."""
    p.add_argument("--model", help="target checkpoint directory (Hugging Face DeepSeek-V3/Kimi-K2 "
                   "format); default: the small model shipped inside the package")
    p.add_argument("--drafter", help="DFlash drafter directory (z-lab format); default: the shipped "
                   "drafter when --model is not given, else none")
    p.add_argument("--spec", choices=["ddtree", "dflash", "off"], default=None,
                   help="speculative decoding: ddtree (draft tree), dflash (single chain) or off; "
                   "default ddtree when a drafter is loaded")
    p.add_argument("--tree-budget", type=tree_budget_arg, default=None,
                   help="DDTree node budget (draft nodes verified per step, root excluded), or auto: "
                   "sized each step per request among {1,3,7,15,31,63}, or no tree where none pays")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 "
                   "(auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--page-size", type=positive_int, default=64, help="KV page size in tokens (default 64)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks: attention heads and MLP/MoE split over N processes "
                   "(one GPU each; gloo on CPU); started here, or by torchrun (default 1)")
    p.add_argument("--ep", type=positive_int, default=1,
                   help="expert-parallel groups: routed experts split over M groups of tp/M ranks; "
                   "M must divide --tp (default 1: experts split by intermediate dim)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode/verify and the batch-1 draft step from CUDA graphs "
                   "(default: on for one CUDA device, off on CPU and under --tp)")


def resolve_model_paths(args) -> tuple[str | None, str | None]:
    """(model, drafter) as given; with neither, `LLM` picks the shipped pair itself."""
    return args.model, (None if args.spec == "off" else args.drafter)


def build_llm(args, **extra):
    from treeflash import LLM

    model, drafter = resolve_model_paths(args)
    if args.tree_budget is not None and args.spec in ("dflash", "off"):
        print(f"treeflash: note: --tree-budget applies to --spec ddtree; {args.spec} ignores it", file=sys.stderr)
    return LLM(model, drafter, spec=args.spec, tree_budget=args.tree_budget, device=args.device,
               dtype=args.dtype, page_size=args.page_size, max_model_len=args.max_model_len,
               tp=getattr(args, "tp", 1), ep=getattr(args, "ep", 1),
               cuda_graphs=getattr(args, "cuda_graphs", None), **extra)


def _register_generate(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt and print the text and acceptance figures",
                       description="Complete PROMPT with the target model (and its drafter).")
    p.add_argument("prompt", help="the prompt text")
    add_model_arguments(p)
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same output)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, metrics)")
    add_chat_arguments(p)
    p.add_argument("--chat", action="store_true",
                   help="send PROMPT as one user message through the chat template (the tokenizer's, or "
                   "--chat-template; without one, the plain 'role: content' template) and print the reply")
    p.set_defaults(func=_cmd_generate)


def add_chat_arguments(p) -> None:
    """--tokenizer and --chat-template (vLLM's names), shared by generate and serve."""
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or file (tokenizer.json, or Kimi's tiktoken.model with its "
                   "tokenizer_config.json beside it); default: the model directory's")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template file (or the template text) to use instead of the tokenizer's")


def _cmd_generate(args) -> int:
    from treeflash import SamplingParams

    if not args.prompt:
        raise CLIError("the prompt is empty")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    llm = build_llm(args, tokenizer=args.tokenizer, chat_template=args.chat_template)
    try:
        t0 = time.perf_counter()
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            out = llm.generate(args.prompt, params)[0]
        seconds = time.perf_counter() - t0
    finally:
        llm.close()  # tensor parallel: followers exit and the process group is destroyed
    report = {
        "prompt": args.prompt, "text": out.text, "token_ids": out.token_ids,
        "finish_reason": out.finish_reason, "num_tokens": len(out.token_ids),
        "seconds": round(seconds, 4), "tokens_per_second": round(len(out.token_ids) / seconds, 2),
        "device": str(llm.device), "metrics": out.metrics,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(out.text if args.chat else args.prompt + out.text)
    spec = out.metrics.get("speculative_decoding")
    line = f"[{len(out.token_ids)} tokens in {seconds:.2f}s, {report['tokens_per_second']} tok/s on {llm.device}"
    if spec:
        line += (f"; {spec['spec_mode']}: mean acceptance length {spec['mean_acceptance_length'] or 1.0:.2f}"
                 f" over {spec['num_spec_steps']} steps, budget {spec['tree_budget']}")
        if spec.get("num_plain_steps"):
            line += f" ({spec['steps_by_budget']}, {spec['num_plain_steps']} plain)"
    print(line + f", finish: {out.finish_reason}]", file=sys.stderr)
    return 0


_EXTRAS = {
    "treeflash.server.cli": ("serve", "server", "run the OpenAI-compatible HTTP server"),
    "treeflash.bench.cli": ("bench", "bench", "benchmarks: decode sweep against context, verify kernel"),
    "treeflash.doctor": ("doctor", "bench", "check each known cause of slow or useless speculation"),
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
    from treeflash.dist.launch import DistributedError

    parser = make_parser()
    args = parser.parse_args(argv)
    notes, errors = knobs.check_environment()
    if errors:  # before any model loads: a mistyped value is not a silent default
        parser.exit(2, "".join(f"treeflash {args.command}: error: {e}\n" for e in errors))
    if args.command != "doctor":  # (the doctor reports them as a check)
        for note in notes:
            print(f"treeflash: note: {note}", file=sys.stderr)
    try:
        return int(args.func(args) or 0)
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


if __name__ == "__main__":
    sys.exit(main())


