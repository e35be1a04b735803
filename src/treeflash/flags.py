"""The flags every model-running command shares (generate, serve, bench sweep, doctor; bench serve
the model and device ones), defined once: treeflash's names are SGLang's where SGLang has one,
the vLLM spellings a user already types are aliases where the meaning is the same, and the flags
of theirs that treeflash does not implement are refused with the reason instead of
"unrecognized arguments".
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from treeflash import runtime

SPEC_MODES = {"ddtree": "ddtree", "dflash": "dflash", "off": "off", "none": "off"}
DTYPES = {"auto": "auto", "float32": "float32", "fp32": "float32", "float": "float32",
          "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}
QUANTIZATIONS = ("fp8", "compressed-tensors")  # what the loader reads; the checkpoint says which

# vLLM / SGLang flags with no treeflash equivalent: (spellings, why). Refused, never ignored.
NOT_IMPLEMENTED = [
    (("--pipeline-parallel-size", "-pp", "--pp-size"),
     "pipeline parallelism is not implemented; split the model with --tp (and --ep)"),
    (("--data-parallel-size", "-dp", "--dp-size"),
     "data parallelism is not implemented: one engine a process (run one server per GPU group)"),
    (("--speculative-num-steps", "--speculative-eagle-topk"),
     "DDTree sizes its tree by a node budget, not by steps x top-k: use --speculative-ddtree-budget "
     "(or --speculative-num-draft-tokens)"),
    (("--speculative-config",),
     "give the drafter and the tree separately: --speculative-draft-model-path PATH "
     "--speculative-algorithm DDTREE --speculative-ddtree-budget N"),
    (("--enable-lora",), "LoRA adapters are not implemented"),
]
# Engine-sizing flags: meaningful where an engine serves requests (generate, serve). bench sweep
# and doctor run one request at each context and size its KV themselves.
SERVING_ONLY = ("--max-model-len", "--context-length", "--max-num-seqs", "--max-running-requests",
                "--gpu-memory-utilization", "--mem-fraction-static", "--max-total-tokens")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def spec_mode(text: str) -> str:
    """ddtree | dflash | off, in any case; NONE (SGLang's word) is off."""
    mode = SPEC_MODES.get(text.strip().lower())
    if mode is None:
        raise argparse.ArgumentTypeError(f"expected DDTREE, DFLASH or NONE (off), got {text!r}")
    return mode


def spec_modes(text: str) -> list[str]:
    """A comma list of spec modes (bench sweep runs each)."""
    modes = [spec_mode(m) for m in text.split(",") if m.strip()]
    if not modes:
        raise argparse.ArgumentTypeError("expected a comma list of off, dflash, ddtree")
    return list(dict.fromkeys(modes))


def tree_budget_arg(text: str) -> int | str:
    """A node budget >= 1, or "auto" (sized per step and request: speculative/budget.py)."""
    return text if text == "auto" else positive_int(text)


def tree_budgets_arg(text: str) -> list:
    """One node budget (or auto), or a comma list of them (bench sweep: a budget table)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected a node budget, auto, or a comma list of them")
    return [tree_budget_arg(p) for p in parts]


def num_draft_tokens_arg(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"counts the root too, so must be >= 2, got {value}")
    return value


def num_draft_tokens_list(text: str) -> list[int]:
    """A comma list of --speculative-num-draft-tokens (bench sweep: a budget table)."""
    parts = [num_draft_tokens_arg(p.strip()) for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected token counts >= 2, comma separated")
    return parts


def dtype_arg(text: str) -> str:
    dtype = DTYPES.get(text.strip().lower())
    if dtype is None:
        raise argparse.ArgumentTypeError(f"expected auto, float32, bfloat16 or float16 (vLLM's float and "
                                         f"half too), got {text!r}")
    return dtype


KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8-e4m3": "fp8_e4m3",
                   "fp8_ds_mla": "fp8_e4m3"}  # vLLM's fp8 and fp8_ds_mla are the e4m3 cache


def kv_cache_dtype_arg(text: str) -> str:
    """auto (the model's dtype), fp8_e4m3 (vLLM's / SGLang's fp8 and vLLM's fp8_ds_mla too: FlashMLA's
    656-byte rows, `kvcache.format`), or the model dtype's own name (checked against --dtype in
    `resolve`); fp8_e5m2 is refused with the reason."""
    name = text.strip().lower()
    if name in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[name]
    if "e5m2" in name:
        raise argparse.ArgumentTypeError(
            f"{text}: not implemented: the fp8 KV cache is e4m3 with a float32 scale a 128 values (FlashMLA's "
            "row); e5m2 would keep 2 mantissa bits, not 3. Give --kv-cache-dtype fp8_e4m3 (or fp8)")
    if name.startswith("fp8"):
        raise argparse.ArgumentTypeError(f"{text}: expected fp8_e4m3 (also fp8, fp8_ds_mla) for an fp8 cache")
    try:
        return dtype_arg(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto, fp8_e4m3 (also fp8, fp8_ds_mla) or the model's dtype, "
                                         f"got {text!r}") from None


def quantization_arg(text: str) -> str | None:
    name = text.strip().lower().replace("_", "-")
    if name in ("none", "auto"):
        return None
    if name not in QUANTIZATIONS:
        raise argparse.ArgumentTypeError(f"{text}: treeflash reads fp8 (block-scaled) and compressed-tensors "
                                         "(INT4 pack-quantized) checkpoints; other formats are not implemented")
    return name


def fraction_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


class Refused(argparse.Action):
    """A flag treeflash knows and does not do: parsing it stops with the reason (exit 2)."""

    def __init__(self, option_strings, dest, reason: str = "", **kw):
        kw.pop("nargs", None)
        kw.setdefault("metavar", "...")
        super().__init__(option_strings, argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS, **kw)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.reason}")


def add_refusals(p: argparse.ArgumentParser, refusals) -> None:
    g = p.add_argument_group("vLLM / SGLang flags treeflash does not implement (refused, with the reason)")
    for spellings, reason in refusals:
        g.add_argument(*spellings, action=Refused, reason=reason, help=reason)


def parse_sizes(text: str) -> list[int]:
    """'1k,8k,185k' -> [1024, 8192, 189440] (k = 1024)."""
    out = []
    for tok in text.split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        scale = {"k": 1024, "m": 1 << 20}.get(tok[-1:], 1)  # (m = 1024k)
        value = int(float(tok[:-1]) * scale) if scale > 1 else int(tok)
        if value < 1:
            raise ValueError(f"context {tok!r} must be >= 1")
        out.append(value)
    if not out:
        raise ValueError("no contexts given")
    return out


def add_chat_arguments(p) -> None:
    """--tokenizer and --chat-template (vLLM's names), shared by generate and serve."""
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or file (tokenizer.json, or Kimi's tiktoken.model with its "
                   "tokenizer_config.json beside it); default: the model directory's")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template file (or the template text) to use instead of the tokenizer's")


def add_preset_flag(g, presets: Mapping, help_text: str, **kw) -> None:
    """--preset NAME: a random-weight model at real geometry (`bench/presets.py`, handed in by the
    command that offers it), with each preset's config.json fields kept for `resolve`'s checks."""
    g.add_argument("--preset", choices=sorted(presets), help=help_text, **kw)
    g.set_defaults(preset_configs={name: preset.target for name, preset in presets.items()})


def add_model_flags(p: argparse.ArgumentParser, *, sweep: bool = False, serving: bool = False) -> None:
    """The model, speculation and placement flags, one definition for every command.

    sweep: --speculative-algorithm and --speculative-ddtree-budget take comma lists (each is
    run); serving: the engine-sizing flags (generate, serve), refused elsewhere."""
    g = p.add_argument_group("model and speculation (SGLang names; vLLM spellings accepted)")
    add_pair_flags(g)
    add_speculation_flags(g, sweep=sweep)
    add_device_flags(g)
    g.add_argument("--tp", "--tensor-parallel-size", "--tp-size", dest="tp", type=positive_int, default=1,
                   help="tensor-parallel ranks: attention heads and MLP/MoE split over N processes (one GPU "
                   "each; gloo on CPU), started here or by torchrun (default 1)")
    g.add_argument("--ep", "--ep-size", "--expert-parallel-size", dest="ep", type=positive_int, default=1,
                   help="expert-parallel groups: routed experts split over M groups of tp/M ranks; M must "
                   "divide --tp (default 1: experts split by intermediate dim)")
    g.add_argument("--dcp", "--dcp-size", "--decode-context-parallel-size", dest="dcp", type=positive_int, default=1,
                   help="decode context parallelism: each request's latent cache dealt across groups of N "
                   "tensor-parallel ranks (N divides --tp; N x the context a request can hold; default 1)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="vLLM's switch: experts split over every rank (the same as --ep equal to --tp)")
    add_graph_flags(g, "one CUDA device" + (", off for bench sweep" if sweep else "") + "; off on CPU and under "
                    "--tp")
    add_runtime_option_flag(g)
    if serving:
        add_serving_flags(p)
    else:
        add_refusals(p, [(SERVING_ONLY, "sizes an engine for serving (generate, serve); this command runs one "
                          "request at each context and sizes its KV itself")])
    add_refusals(p, NOT_IMPLEMENTED)


def add_pair_flags(g) -> None:
    """The target and drafter checkpoints (and vLLM's --trust-remote-code, a no-op here)."""
    g.add_argument("--model", "--model-path", dest="model",
                   help="target checkpoint directory (Hugging Face DeepSeek-V3/Kimi-K2 format); default: "
                   "the small model shipped inside the package")
    g.add_argument("--drafter", "--speculative-draft-model-path", dest="drafter",
                   help="DFlash drafter directory (z-lab format); default: the shipped drafter when --model "
                   "is not given, else none (no speculation)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM/SGLang command lines; has no effect: treeflash reads a checkpoint "
                   "as data (config.json, safetensors) and runs no code from it")


def add_speculation_flags(g, *, sweep: bool = False) -> None:
    g.add_argument("--speculative-algorithm", "--spec", dest="spec", metavar="DDTREE|DFLASH|NONE",
                   type=spec_modes if sweep else spec_mode, default=None,
                   help=("comma list of modes to run, each of " if sweep else "")
                   + "DDTREE (a draft tree; the default with a drafter), DFLASH (one chain) or NONE (plain "
                   "decoding; also 'off'); any case" + (" (default: NONE,DFLASH,DDTREE)" if sweep else ""))
    g.add_argument("--speculative-ddtree-budget", "--tree-budget", dest="tree_budget",
                   type=tree_budgets_arg if sweep else tree_budget_arg, default=None,
                   metavar="N,...|auto" if sweep else "N|auto",
                   help="DDTree node budget: draft nodes verified per step, root excluded; or auto: sized "
                   "each step per request among {1,3,7,15,31,63}, or no tree where none pays"
                   + ("; a comma list (e.g. 1,3,7,15,31,auto) runs each and prints the budget table "
                      "(bench/compare.py)" if sweep else ""))
    g.add_argument("--speculative-num-draft-tokens", dest="num_draft_tokens",
                   type=num_draft_tokens_list if sweep else num_draft_tokens_arg, default=None,
                   metavar="N,..." if sweep else "N",
                   help="SGLang's count of tokens verified per step, the root (last committed token) "
                   "included: the same as --speculative-ddtree-budget N-1" + (" (a comma list too)" if sweep else ""))


def add_device_flags(g) -> None:
    """Where and in what the model runs: device, dtypes, quantization, KV page size."""
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    g.add_argument("--dtype", type=dtype_arg, default="auto",
                   help="auto | float32 | bfloat16 | float16 (vLLM's float, half too; auto: bfloat16 on "
                   "GPU, float32 on CPU)")
    g.add_argument("--kv-cache-dtype", type=kv_cache_dtype_arg, default="auto",
                   help="auto: the target's latent KV cache in the model's dtype (naming that dtype is "
                   "accepted); fp8_e4m3 (vLLM's fp8 too): 656-byte rows of e4m3 values with a float32 scale a "
                   "128 and bf16 rope, 0.57 of bf16's bytes, so 1.75x the tokens in the same memory "
                   "(the drafter's cache stays in the model dtype); fp8_e5m2 is not implemented")
    g.add_argument("--quantization", type=quantization_arg, default=None,
                   help="fp8 | compressed-tensors | none: accepted when it is what the checkpoint declares "
                   "(config.json quantization_config), which is what is loaded either way")
    g.add_argument("--page-size", "--block-size", dest="page_size", type=positive_int, default=64,
                   help="KV page size in tokens (vLLM's --block-size; default 64)")


def add_graph_flags(g, default: str) -> None:
    """--cuda-graphs / --no-cuda-graphs and vLLM's and SGLang's names for the latter; `default`
    says when graphs are on without a flag."""
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help=f"replay decode/verify and the batch-1 draft step from CUDA graphs (default: on for "
                   f"{default})")
    g.add_argument("--enforce-eager", "--disable-cuda-graph", dest="enforce_eager", action="store_true",
                   help="no CUDA graphs (vLLM's and SGLang's names for --no-cuda-graphs)")


class RuntimeOptionAction(argparse.Action):
    """--runtime-option NAME=VALUE, repeatable, collected as given (`resolve` checks them);
    `--runtime-option help` prints every option and exits."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values == "help":  # like --help: on stdout
            print(runtime.describe())
            parser.exit(0)
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), values])


def add_runtime_option_flag(g) -> None:
    g.add_argument("--runtime-option", dest="runtime_option", action=RuntimeOptionAction, default=[],
                   metavar="NAME=VALUE",
                   help="run a fused step another way, for an A/B measurement or a bug report, e.g. "
                   "fused_norm=0 (repeatable; noted when set; `--runtime-option help` lists each option and its "
                   "measured default)")


def add_serving_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine size and memory (SGLang names; vLLM spellings accepted)")
    g.add_argument("--max-model-len", "--context-length", dest="max_model_len", type=positive_int, default=None,
                   help="longest prompt + completion in tokens (default: the model's max_position_embeddings)")
    g.add_argument("--max-running-requests", "--max-num-seqs", dest="max_running_requests", type=positive_int,
                   default=64, help="requests decoded together in one batch (vLLM's --max-num-seqs; default 64)")
    g.add_argument("--max-total-tokens", type=positive_int, default=None,
                   help="KV pool size in tokens (default: max(max_model_len, min(4 x max_model_len, 65536)), "
                   "or what --mem-fraction-static leaves)")
    g.add_argument("--mem-fraction-static", "--gpu-memory-utilization", dest="mem_fraction", type=fraction_arg,
                   default=None, metavar="F",
                   help="size the KV pool so that weights + KV + workspace use this fraction of the device's "
                   "memory (the CPU's RAM on CPU); vLLM's --gpu-memory-utilization. Default: --max-total-tokens")


def resolve(args: argparse.Namespace) -> None:
    """Check and normalise the shared flags in place, before anything loads (ValueError: exit 2)."""
    tag = getattr(args, "model_tag", None)  # `treeflash serve MODEL`, vLLM's positional model
    if tag is not None:
        if args.model not in (None, tag):
            raise ValueError(f"two models given: {tag} and --model {args.model}")
        args.model = tag
    if getattr(args, "num_draft_tokens", None) is not None:
        n = args.num_draft_tokens
        budget = [x - 1 for x in n] if isinstance(n, list) else n - 1  # bench sweep: comma lists
        if args.tree_budget is not None and args.tree_budget != budget:
            raise ValueError(f"--speculative-num-draft-tokens {args.num_draft_tokens} means a DDTree budget of "
                             f"{budget} (the root counts), but --speculative-ddtree-budget is {args.tree_budget}")
        args.tree_budget = budget
    if args.enforce_eager:
        if args.cuda_graphs:
            raise ValueError("--enforce-eager and --cuda-graphs contradict each other: give one")
        args.cuda_graphs = False
    if getattr(args, "enable_expert_parallel", False):
        if args.ep not in (1, args.tp):
            raise ValueError(f"--enable-expert-parallel splits experts over all {args.tp} ranks; --ep {args.ep} "
                             "asks otherwise: give one")
        args.ep = args.tp
    if getattr(args, "dcp", 1) > 1 and args.tp % args.dcp:
        raise ValueError(f"--dcp {args.dcp} must divide --tp {args.tp}: decode context parallelism deals the cache "
                         "across groups of tensor-parallel ranks")
    if getattr(args, "mem_fraction", None) is not None and getattr(args, "max_total_tokens", None) is not None:
        raise ValueError("--mem-fraction-static (--gpu-memory-utilization) and --max-total-tokens both size the KV "
                         "pool: give one")
    _check_kv_cache_dtype(args)
    _check_quantization(args)
    args.runtime_options = runtime.RuntimeOptions.parse(getattr(args, "runtime_option", None) or [])


def _check_kv_cache_dtype(args) -> None:
    if args.kv_cache_dtype in ("auto", "fp8_e4m3"):
        return
    from treeflash.engine.llm import resolve_device, resolve_dtype

    model_dtype = str(resolve_dtype(args.dtype, resolve_device(args.device))).removeprefix("torch.")
    if args.kv_cache_dtype != model_dtype:
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype}: the KV cache is kept in the model's dtype "
                         f"({model_dtype} here); give --dtype {args.kv_cache_dtype} or --kv-cache-dtype auto")


def declared_quantization(args) -> tuple[str | None, str]:
    """(quant_method the checkpoint declares or None, what was read) for --model / --preset /
    the shipped model."""
    from treeflash.config import ModelConfig

    preset = getattr(args, "preset", None)
    if preset is not None and args.model is None:
        raw, where = args.preset_configs[preset], f"preset {preset}"
    else:
        from treeflash.engine.llm import default_model_path

        raw = Path(args.model) if args.model is not None else default_model_path()
        where = str(raw)
    qc = ModelConfig.from_hf(raw).extra.get("quantization_config") or {}
    method = qc.get("quant_method")
    return (str(method).lower().replace("_", "-") if method else None), where


def _check_quantization(args) -> None:
    if args.quantization is None:
        return
    declared, where = declared_quantization(args)
    if declared == args.quantization:
        return
    if declared is None:
        raise ValueError(f"--quantization {args.quantization}: {where} declares no quantization_config (its "
                         "weights load in --dtype); treeflash does not quantize at load time: drop the flag")
    raise ValueError(f"--quantization {args.quantization}: {where} declares {declared} (config.json "
                     f"quantization_config), which is what loads: give --quantization {declared} or drop the flag")
