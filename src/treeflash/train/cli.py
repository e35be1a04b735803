"""`treeflash train tokenizer|target|drafter|eval`: build the embedded model pair.

`treeflash/cli.py` calls `register(subparsers)`; `python -m treeflash.train.cli`
runs the same commands stand-alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from treeflash.cli import positive_int

from .drafter import DRAFTER_PRESETS, DrafterTrainArgs
from .evaluate import EvalArgs
from .loop import TrainingDiverged
from .target import TARGET_PRESETS, TargetTrainArgs

_SIZE_SUFFIX = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def _size(text: str) -> int:
    """'20M', '300k' or '12345' bytes."""
    t = text.strip().lower().removesuffix("b")
    mult = _SIZE_SUFFIX.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in _SIZE_SUFFIX else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a byte count like 20M or 300k, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return int(value)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


class _HelpFormatter(argparse.HelpFormatter):
    """Adds '(default: X)' to each option that has a default to state (not to flags)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or action.default in (None, argparse.SUPPRESS)
                or "%(default)" in text):
            return text
        return text + " (default: %(default)s)"


def _common(p: argparse.ArgumentParser, steps_default: int) -> None:
    p.add_argument("--steps", type=positive_int, default=steps_default,
                   help="optimizer steps in all (with --resume: the total, not the steps to add)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop after this many seconds in all (with --resume: counted over every run); the LR "
                   "schedule ends at steps or time, whichever first (default: no limit)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights, data order and anchors")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda[:N]")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/checkpoint.pt: weights, optimizer, step count, LR schedule and data "
                   "order carry on; --preset, --seq-len and --batch-size (drafter: and --anchors) must match it. "
                   "Without it, an existing OUT/checkpoint.pt is an error, never overwritten")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the tokenizer/target/drafter/eval sub-commands to `parser`."""
    sub = parser.add_subparsers(dest="train_command", metavar="{tokenizer,target,drafter,eval}")
    sub.required = True
    _add_tokenizer(sub)
    _add_target(sub)
    _add_drafter(sub)
    _add_eval(sub)


def _add_tokenizer(sub) -> None:
    """`train tokenizer`: the corpus, the BPE and the tokenized data."""
    p = sub.add_parser("tokenizer", formatter_class=_HelpFormatter,
                       help="train the byte-level BPE tokenizer and tokenize the corpus",
                       description="Collect Python source (stdlib + installed packages, or --corpus), "
                       "split it train/held-out by path hash, train a byte-level BPE tokenizer (or reuse "
                       "--tokenizer) and write OUT/tokenizer.json plus the tokenized corpus under OUT/data/.")
    p.add_argument("--out", required=True, help="output folder (tokenizer.json, data/)")
    p.add_argument("--corpus", default=None,
                   help="folder of .py files (default: this interpreter's stdlib and packages)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="reuse this tokenizer.json (or a folder holding one, e.g. src/treeflash/assets/target) "
                   "instead of training a new BPE, so token ids match a model trained with it; "
                   "only the corpus is encoded")
    p.add_argument("--vocab-size", type=positive_int, default=None,
                   help="vocabulary size incl. 4 special tokens (default 4096; with --tokenizer: must match it)")
    p.add_argument("--sample-bytes", type=_size, default="20M",
                   help="train-split text the BPE is trained on, in bytes like 20M or 300k (unused with --tokenizer)")
    p.add_argument("--max-bytes", type=_size, default=None, help="cap on corpus text in bytes like 50M "
                   "(files taken in path-hash order; default: no cap)")
    p.add_argument("--heldout-percent", type=float, default=2.0, help="share of files held out (by path hash)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _add_target(sub) -> None:
    """`train target`: the DeepSeek-V3 target."""
    p = sub.add_parser("target", formatter_class=_HelpFormatter, help="train the DeepSeek-V3 (MLA + MoE) target model",
                       description="Train transformers' DeepseekV3ForCausalLM on the tokenized corpus and "
                       "export it in the Hugging Face format (bf16) to OUT.")
    p.add_argument("--data", required=True, help="folder written by `treeflash train tokenizer`")
    p.add_argument("--out", required=True, help="output folder (config.json, model.safetensors, checkpoint.pt)")
    p.add_argument("--preset", choices=sorted(TARGET_PRESETS), default="small",
                   help="model size: small (the shipped target) or tiny (CPU smoke tests)")
    p.add_argument("--seq-len", type=positive_int, default=8192, help="training context (files concatenated)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=100, help="linear warmup steps")
    p.add_argument("--eval-every", type=positive_int, default=200, help="held-out eval period (steps)")
    p.add_argument("--eval-batches", type=positive_int, default=8, help="held-out windows per eval")
    p.add_argument("--save-every", type=positive_int, default=500, help="checkpoint period (steps)")
    _common(p, 100_000)


def _add_drafter(sub) -> None:
    """`train drafter`: the DFlash drafter for a trained target."""
    p = sub.add_parser("drafter", formatter_class=_HelpFormatter,
                       help="train a DFlash drafter on the target's greedy predictions",
                       description="Train a z-lab DFlash drafter (one sliding-window + one full layer) with "
                       "many random anchors per sequence, mask blocks, context strictly before the anchor, "
                       "position-decayed loss, and labels = the target's own greedy tokens.")
    p.add_argument("--data", required=True, help="folder written by `treeflash train tokenizer`")
    p.add_argument("--target", required=True, help="target folder written by `treeflash train target`")
    p.add_argument("--out", required=True, help="output folder (config.json, model.safetensors)")
    p.add_argument("--preset", choices=sorted(DRAFTER_PRESETS), default="small",
                   help="drafter size: small (the shipped drafter, block size 16) or tiny (CPU smoke tests, block "
                   "size 4); the block size is the preset's")
    p.add_argument("--seq-len", type=positive_int, default=8192,
                   help="context length per training sequence (more than the preset's block size)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step")
    p.add_argument("--anchors", type=positive_int, default=512, help="random anchors (blocks) per sequence")
    p.add_argument("--lr", type=float, default=1.5e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=50, help="linear warmup steps")
    p.add_argument("--eval-every", type=positive_int, default=100, help="held-out eval period (steps)")
    p.add_argument("--eval-batches", type=positive_int, default=4, help="held-out sequences per eval")
    p.add_argument("--save-every", type=positive_int, default=200, help="checkpoint period (steps)")
    p.add_argument("--init", default=None, metavar="DIR",
                   help="start from the weights of this drafter folder (e.g. src/treeflash/assets/drafter; "
                   "its config must match --preset on --target) with a fresh optimizer and LR schedule; "
                   "with --resume the checkpoint's weights are used instead")
    _common(p, 100_000)


def _add_eval(sub) -> None:
    """`train eval`: held-out quality of a target and its drafter."""
    p = sub.add_parser("eval", formatter_class=_HelpFormatter,
                       help="held-out loss, valid-Python share and drafter acceptance",
                       description="Evaluate a target (and drafter) on held-out files; writes a metrics JSON.")
    p.add_argument("--data", required=True, help="folder written by `treeflash train tokenizer`")
    p.add_argument("--target", required=True, help="target folder")
    p.add_argument("--drafter", default=None, help="drafter folder (omit to evaluate the target alone)")
    p.add_argument("--out", required=True, help="metrics JSON path")
    p.add_argument("--prompts", type=positive_int, default=48, help="held-out function-header prompts")
    p.add_argument("--prompt-len", type=positive_int, default=512, help="prompt tokens before each header's colon")
    p.add_argument("--new-tokens", type=positive_int, default=128, help="tokens generated per prompt")
    p.add_argument("--seq-len", type=positive_int, default=8192, help="held-out loss window")
    p.add_argument("--loss-windows", type=positive_int, default=16, help="held-out loss windows")
    p.add_argument("--long-len", type=int, default=32768, help="window for loss by position (0: skip)")
    p.add_argument("--context-lengths", type=_int_list, default=None,
                   help="comma-separated contexts for the acceptance sweep (default: 1024,4096,8192,16384,32768, "
                        "the longest cut to what the target's max_position_embeddings holds)")
    p.add_argument("--context-prompts", type=positive_int, default=4, help="prompts per context length")
    p.add_argument("--budgets", type=_int_list, default="16,32", help="comma-separated DDTree node budgets")
    p.add_argument("--reference-prompts", type=int, default=4, help="prompts re-run through dflash_generate")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (T=1)")


def register(subparsers) -> argparse.ArgumentParser:
    """Add `train` to the top-level `treeflash` sub-parsers."""
    p = subparsers.add_parser("train", help="train the tokenizer, target and DFlash drafter",
                              description="Build the embedded model pair (see src/treeflash/assets/MODEL_CARD.md).")
    add_arguments(p)
    p.set_defaults(func=main_from_args)
    return p


def _dataclass_args(cls, ns: argparse.Namespace, **extra):
    names = {f.name for f in fields(cls)}
    kwargs = {k: v for k, v in vars(ns).items() if k in names}
    kwargs.update(extra)
    return cls(**kwargs)


def main_from_args(ns: argparse.Namespace) -> int:
    """Run a parsed `train` command; a bad argument becomes a one-line error and exit code 2, a
    diverged run one line and exit code 1, Ctrl-C one line and exit code 130."""
    try:
        if ns.train_command == "tokenizer":
            from .tokenizer import build_tokenizer_and_data

            build_tokenizer_and_data(ns.out, corpus_dir=ns.corpus, vocab_size=ns.vocab_size,
                                     sample_bytes=ns.sample_bytes, max_bytes=ns.max_bytes,
                                     heldout_percent=ns.heldout_percent, tokenizer_path=ns.tokenizer,
                                     progress=ns.progress)
        elif ns.train_command == "target":
            from .target import train_target

            train_target(_dataclass_args(TargetTrainArgs, ns))
        elif ns.train_command == "drafter":
            from .drafter import train_drafter

            train_drafter(_dataclass_args(DrafterTrainArgs, ns))
        elif ns.train_command == "eval":
            from .evaluate import evaluate

            m = evaluate(_dataclass_args(EvalArgs, ns))
            print(json.dumps({k: m[k] for k in ("target", "drafter") if k in m}, indent=1)[:4000])
    except ValueError as e:
        print(f"treeflash train {ns.train_command}: error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:  # not a bad argument as such: the run went wrong midway
        print(f"treeflash train {ns.train_command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # a TrainingInterrupted says where it saved and how to go on
        print(f"treeflash train {ns.train_command}: {e or 'interrupted'}", file=sys.stderr)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treeflash train", description="Build the embedded model pair.")
    add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
