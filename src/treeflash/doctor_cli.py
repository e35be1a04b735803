"""`treeflash doctor`, the command: flags, loading (with progress), the context it can check at,
the checks of `doctor.py` with a bar over them, next steps this machine can run, a summary line."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from treeflash import costs as floors  # the floor model, costs/
from treeflash import flags, progress

DESCRIPTION = """\
Check, one by one, each known cause of a slow or useless speculative decode and name the one at
fault. The checks follow a real deployment (an MLA + MoE model with a tree-verifying drafter)
whose decode fell from 118.6 tok/s at 1.4k context to 0.7 tok/s at 185k while its drafter looked
useless (commit length 1.00): the cause was its verify attention reading a KV cache scattered in
pages of one token, at ~14 GB/s on a 1.8 TB/s GPU.

Each check prints PASS / WARN / FAIL (or N/A) with one line of evidence and, where it helps, the
next command to run; any FAIL makes the exit code 1. The suspects: a step far above its floor
(and its slope per +1k context), the verify attention's effective bandwidth and the KV layout
under it, the drafter's sliding window and incremental cache, the tapped layers, acceptance (an
oracle drafter must reach full acceptance; a real one at exactly 1.00 is a likely bug), the
metrics' own invariants, MoE load at batch 1 and the GPU's busy fraction. Then, informational,
which tree the auto budget's rule picks at this context and --batch, and why (tree_sizing: the
expected gain and the marginal cost per node of each bucket).

Memory plan (--memory-plan, or first whenever --tp > 1 or --gpu-memory is given): what the WHOLE
model needs on each GPU under --tp / --ep (weights by kind, routed experts in their stored format,
KV per 1k tokens, the drafter's window, CUDA graphs and workspace) against the GPU's memory, the
KV tokens left and the longest context one request can have; from config.json alone (and a
checkpoint's safetensors headers, never its tensors), so it runs on any machine. A preset plans
the real model it slices (kimi-k2.6-tp8: Kimi K2.6 as published, at its --tp 8).
"""


def register(sub) -> None:
    from treeflash.bench.presets import DEFAULT_PRESET, PRESETS
    from treeflash.cli import positive_float, positive_int, size_arg

    p = sub.add_parser("doctor", help="check each known cause of slow or useless speculation; name the culprit",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_model_flags(p)
    d = p.add_argument_group("what to check")
    d.add_argument("--context", type=size_arg, default="1k",
                   help="context to check at (k = 1024; default 1k); at the model's limit, the largest that "
                   "leaves room to decode")
    flags.add_preset_flag(d, PRESETS, f"random-weight model at real geometry (--preset alone: {DEFAULT_PRESET})",
                          nargs="?", const=DEFAULT_PRESET)
    d.add_argument("--scattered", action="store_true",
                   help="shuffle KV pages over the pool (with --page-size 1: the layout of the incident above)")
    d.add_argument("--max-tokens", type=positive_int, default=24, help="tokens decoded per probe run (default 24)")
    d.add_argument("--batch", type=positive_int, default=1,
                   help="the batch tree_sizing explains the auto budget's pick at (default 1)")
    d.add_argument("--bandwidth", type=positive_float, default=None, help="bytes/s ceiling override")
    d.add_argument("--matmul", type=positive_float, default=None, help="flop/s ceiling override")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    m = p.add_argument_group("memory plan")
    m.add_argument("--memory-plan", action="store_true",
                   help="print the whole model's memory per GPU under --tp and stop (exit 1 if a --context "
                   "request does not fit on the GPU); nothing is loaded")
    m.add_argument("--gpu-memory", type=_gpus_arg, default=None, metavar="GPU|SIZE[,...]",
                   help="the GPU(s) to plan for: h100, h200, or a memory size (141GB, 139.8GiB), comma separated "
                   "(exit 1 if the --context request misses any); default: this machine's GPU, else each of "
                   "h100 and h200")
    p.set_defaults(func=cmd_doctor)


def _gpus_arg(text: str) -> list:
    from treeflash.memory_plan import parse_gpu

    try:
        gpus = [parse_gpu(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not gpus:
        raise argparse.ArgumentTypeError("expected h100, h200 or a size such as 141GB, comma separated")
    return gpus


def cmd_doctor(args) -> int:
    from treeflash.bench.presets import check_preset_fits, load_rig
    from treeflash.engine.llm import resolve_device, resolve_dtype

    if args.memory_plan or args.gpu_memory is not None or args.tp > 1:
        rc = print_memory_plan(args)
        if args.memory_plan or args.preset or rc:  # a preset's plan is of the model it slices: done
            return rc
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.preset:
        check_preset_fits(args.preset, device, dtype, args.context + args.max_tokens, args.tree_budget,
                          args.kv_cache_dtype)
    show = progress.wanted(args.quiet)
    clock = progress.Stopwatch()
    drafter = None if args.spec == "off" else args.drafter
    with progress.spinner(f"loading {args.preset or args.model or 'the shipped pair'}", show=show):
        rig = load_rig(args.model, drafter, args.preset, device, dtype, args.page_size, args.scattered,
                       args.tree_budget, tp=args.tp, ep=args.ep, kv_cache_dtype=args.kv_cache_dtype,
                       options=args.runtime_options, dcp=args.dcp)
    # As the engine serves: graphs on for one CUDA device unless --no-cuda-graphs (an eager
    # step on the H200 is ~10x a replayed one, and would read as a floor problem).
    rig.cuda_graphs = bool(args.cuda_graphs) or (args.cuda_graphs is None and device.type == "cuda"
                                                 and args.tp == 1)
    if args.spec == "off":  # plain decode alone (the shipped pair and the presets come with a drafter)
        rig.drafter = None
    try:
        if args.spec in ("ddtree", "dflash") and rig.drafter is None:
            raise ValueError(f"--speculative-algorithm {args.spec} needs a drafter: give --drafter with --model")
        return _doctor_on(rig, args, device, dtype, show, clock)
    finally:
        rig.close()


def plan_configs(args):
    """(target config, drafter config or None, title, checkpoint dir or None, tp) of the plan: a
    preset's real model (its own config at full depth where it names none; tp: --tp, else the
    preset's), the --model / --drafter directories, or the shipped pair."""
    from treeflash.bench.presets import PRESETS
    from treeflash.config import DrafterConfig, ModelConfig
    from treeflash.engine.llm import EMBEDDED, default_model_path

    want_drafter = args.spec != "off"
    if args.preset:
        p = PRESETS[args.preset]
        target = p.full_target or dict(p.target, num_hidden_layers=p.full_layers)
        drafter = p.full_drafter or p.drafter
        cfg = ModelConfig.from_hf(target)
        title = f"the model preset {p.name} slices ({p.full_layers} layers)"
        return (cfg, DrafterConfig.from_hf(drafter) if want_drafter else None, title, None,
                args.tp if args.tp > 1 else p.tp)
    model = args.model or str(default_model_path())
    drafter = args.drafter if args.model else (args.drafter or str(EMBEDDED / "drafter"))
    dcfg = DrafterConfig.from_hf(drafter) if drafter and want_drafter else None
    title = model + (f" + {drafter}" if dcfg is not None else "")
    return ModelConfig.from_hf(model), dcfg, title, Path(model), args.tp


def print_memory_plan(args) -> int:
    """Print the plan of the whole model on each GPU asked about (--gpu-memory, this machine's, or
    the known ones); 1 if a --context request does not fit on one asked about."""
    import torch

    from treeflash import memory_plan

    cfg, dcfg, title, ckpt_dir, tp = plan_configs(args)
    dtype = torch.bfloat16 if args.dtype == "auto" else getattr(torch, args.dtype)
    checkpoint = memory_plan.read_checkpoint(ckpt_dir) if ckpt_dir is not None and ckpt_dir.is_dir() else None
    plan = memory_plan.plan_model(cfg, dcfg, tp, args.ep, dtype, args.kv_cache_dtype, args.batch, title, checkpoint)
    gpus, judged = args.gpu_memory, True
    if gpus is None and torch.cuda.is_available():
        gpus = [memory_plan.Gpu(torch.cuda.mem_get_info()[1], torch.cuda.get_device_name())]
    elif gpus is None:
        gpus, judged = [memory_plan.Gpu(*g) for g in memory_plan.GPUS.values()], False
    print(memory_plan.report(plan, gpus, args.context), flush=True)
    return 1 if judged and not all(plan.fits(g.memory, args.context) for g in gpus) else 0


def checkable_context(asked: int, max_positions: int, max_tokens: int) -> int:
    """The context to check at: `asked`, or at the model's limit the largest that leaves room to
    decode max_tokens (+ a tree's rows); ValueError past the model's positions."""
    if asked > max_positions:
        raise ValueError(f"--context {asked} exceeds the model's max_position_embeddings ({max_positions})")
    limit = max_positions - max_tokens - 64
    if limit < 1:
        raise ValueError(f"--max-tokens {max_tokens} leaves no context to check within the model's "
                         f"{max_positions} positions")
    if asked > limit:
        print(f"treeflash doctor: note: checking at context {limit}: the largest that leaves room to decode "
              f"{max_tokens} tokens within the model's {max_positions} positions", file=sys.stderr)
    return min(asked, limit)


def _doctor_on(rig, args, device, dtype, show: bool, clock) -> int:
    from treeflash.doctor import Doctor, report

    context = checkable_context(args.context, rig.cfg.max_position_embeddings, args.max_tokens)
    ceilings = floors.default_ceilings(device, dtype, args.bandwidth, args.matmul)
    mode = (args.spec or "ddtree") if rig.drafter is not None else "off"
    print(f"treeflash doctor: {rig.source} on {floors.device_name(device)}, context {context}, "
          f"page {args.page_size}{' scattered' if args.scattered else ''}, spec {mode}", flush=True)
    doc = Doctor(rig, context, ceilings, tokens=args.max_tokens, fill="random" if args.preset else "prefill",
                 spec=None if mode == "off" else mode, batch=args.batch, progress=show)
    bar = progress.bar(None, "doctor", unit="check", show=show)
    try:
        checks = doc.checks(on_check=lambda name, done, total: _advance(bar, name, done, total))
    finally:
        bar.close()
    here = Here.of(args, rig, device, context)
    for c in checks:
        c.next = here.runnable(c.next)
    print(report(checks))
    rc = 1 if any(c.status == "FAIL" for c in checks) else 0
    counts = {s: sum(c.status == s for c in checks) for s in ("PASS", "WARN", "FAIL", "N/A")}
    tail = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    print(f"treeflash doctor: {tail} in {clock} (exit {rc})", file=sys.stderr)
    return rc


def _advance(bar, name: str, done: int, total: int) -> None:
    bar.total = total
    bar.set_description(f"doctor: {name}")
    bar.update(done - bar.n)


@dataclass
class Here:
    """What this machine can run, to keep the checks' suggested commands runnable on it."""

    cuda: bool
    source: list[str]  # the flags naming the pair diagnosed (--model/--drafter, --preset, or none)
    max_context: int
    fits: object  # fits(preset) -> bool

    @staticmethod
    def of(args, rig, device, context: int) -> Here:
        from treeflash.bench.presets import preset_fits, verify_rows

        source = ["--preset", args.preset] if args.preset else []
        if args.model:
            source = ["--model", args.model] + (["--drafter", args.drafter] if args.drafter else [])
        # the largest context a sweep can decode its default 128 tokens (and a tree) after
        return Here(device.type == "cuda", source, rig.cfg.max_position_embeddings - 128 - 64,
                    lambda name: preset_fits(name, device, rig.dtype, context, verify_rows(args.tree_budget)))

    def runnable(self, text: str) -> str:
        """`text` (a check's next step) with its treeflash command made runnable here: a GPU-only
        command said to be one, a preset that does not fit in memory replaced by the pair being
        diagnosed, contexts the model cannot hold brought down to the largest it can, and the pair's
        own flags added."""
        if "treeflash " not in text:
            return text
        head, cmd = text.split("treeflash ", 1)
        if "GPU" in head:  # already said to be for a GPU
            return text
        words = shlex.split(cmd)
        if words[:2] == ["bench", "kernel"] and not self.cuda:
            return f"{head}on a machine with a CUDA GPU: treeflash {cmd}"
        if words[:2] != ["bench", "sweep"] and words[:1] != ["doctor"]:
            return text
        if "--preset" in words:
            i = words.index("--preset")
            if self.fits(words[i + 1]):
                return text
            del words[i:i + 2]
        if "--contexts" in words:
            i = words.index("--contexts") + 1
            kept = dict.fromkeys(min(c, self.max_context) for c in flags.parse_sizes(words[i]))
            words[i] = ",".join(str(c) for c in kept)
        return head + "treeflash " + shlex.join(words[:2 if words[0] == "bench" else 1] + self.source
                                                + words[2 if words[0] == "bench" else 1:])


def main(argv: list[str] | None = None) -> int:
    from treeflash.cli import main as cli_main

    return cli_main(["doctor", *(argv or sys.argv[1:])])
