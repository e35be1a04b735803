"""`treeflash bench ...`: sweep (decode against context, beside the floors), kernel, moe (the MoE
experts' kernels, INT4 and bf16), export, and diff (two results side by side)."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

from treeflash import flags, progress
from treeflash.cli import positive_float, sizes_arg


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: decode sweep against context, verify kernel",
                       description="Benchmarks that print every figure beside its hardware floor.")
    bench = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    _register_sweep(bench)
    _register_serve(bench)
    _register_export(bench)
    _register_kernel(bench)
    _register_moe(bench)
    _register_diff(bench)


def _register_diff(bench) -> None:
    from treeflash.bench.diff import __doc__ as doc
    from treeflash.bench.diff import cmd_diff

    p = bench.add_parser("diff", help="two sweep or kernel results side by side (new / old per point)",
                         description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", help="a JSON written by `bench sweep` or `bench kernel`")
    p.add_argument("new", help="another of the same kind")
    p.set_defaults(func=cmd_diff)


def _register_export(bench) -> None:
    from treeflash.bench.export import __doc__ as doc
    from treeflash.bench.presets import PRESETS
    from treeflash.cli import positive_int

    p = bench.add_parser("export", help="write a preset's random-weight pair as checkpoints (for --tp runs)",
                         description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--out", required=True, help="new or empty folder: OUT/target and OUT/drafter")
    p.add_argument("--device", default="auto", help="where to build the weights (auto | cpu | cuda)")
    p.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16 (default bfloat16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gb", type=positive_int, default=4, help="safetensors shard size in GB (default 4)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from treeflash.bench.export import export_preset
    from treeflash.bench.presets import check_preset_fits
    from treeflash.engine.llm import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    check_preset_fits(args.preset, device, resolve_dtype(args.dtype, device), 0)
    target, drafter = export_preset(args.preset, args.out, device, resolve_dtype(args.dtype, device), args.seed,
                                    args.shard_gb << 30, not args.no_progress)
    print(f"wrote {target} and {drafter}: treeflash bench sweep --model {target} --drafter {drafter} "
          "--acceptance oracle --tp N")
    return 0


def _register_sweep(bench) -> None:
    from treeflash.bench.presets import DEFAULT_PRESET, PRESETS
    from treeflash.bench.sweep import DEFAULT_CONTEXTS
    from treeflash.cli import positive_int

    p = bench.add_parser(
        "sweep", help="decode tok/s, ms/step, acceptance and each part of a step vs its floor, by context",
        description="Bring one request to each context, decode with each spec mode, and print a table "
        "(tok/s, ms/step, floor, acceptance, nodes, verify attention and its effective KV bandwidth, "
        "MoE/projections, drafter, host), the step-time slope per +1k context against the floor's, "
        "a JSON file and a PNG plot (in the current directory unless --out says where).")
    flags.add_model_flags(p, sweep=True)
    s = p.add_argument_group("the sweep")
    flags.add_preset_flag(s, PRESETS, "random-weight model at real geometry instead of a checkpoint (see "
                          f"bench/presets.py; --preset alone: {DEFAULT_PRESET}, Kimi K2.6's TP8 slice with INT4 "
                          "experts; kimi-k2-tp8: the same with bf16 experts); refused, with its size, when it does "
                          "not fit in this machine's memory", nargs="?", const=DEFAULT_PRESET)
    s.add_argument("--contexts", type=sizes_arg, default=None,
                   help=f"comma list, k = 1024 (default {DEFAULT_CONTEXTS}, those the model allows)")
    s.add_argument("--max-tokens", type=positive_int, default=128,
                   help="tokens decoded per context and mode (default 128; first 2 steps are warm-up)")
    s.add_argument("--acceptance", default=None,
                   help="oracle (full acceptance), K (target's own tokens for K depths, then wrong), or "
                   "drafter (the real drafter's; not for presets); a comma list (e.g. 0,1,3,oracle) runs each. "
                   "Default: oracle for presets, else drafter")
    s.add_argument("--fill", choices=["random", "prefill"], default=None,
                   help="reach the context by random latents (presets only; default for them) or a real "
                   "prefill with a progress bar (default for checkpoints)")
    s.add_argument("--scattered", action="store_true",
                   help="shuffle KV pages over the pool (with --page-size 1: the incident's layout, see "
                   "treeflash doctor --help)")
    s.add_argument("--dcp-model", type=positive_int, default=1,
                   help="presets: one rank of a decode-context-parallel group of N, on this device (its 1/N "
                   "share of each request's cache, the group's N x heads, the LSE merge); the collectives' wire "
                   "time is added from --dcp-collective-us (default 1: no DCP)")
    s.add_argument("--dcp-collective-us", type=float, default=None,
                   help="with --dcp-model: declared microseconds a layer for the DCP collectives (the queries' "
                   "all-gather + the partials' all-to-all), added to each modelled step")
    s.add_argument("--max-position-embeddings", dest="max_positions", type=sizes_arg, default=None,
                   help="presets: raise the target's max_position_embeddings to N (k = 1024) to time contexts past "
                   "its trained length (a cost model: e.g. 1M under --dcp-model 8)")
    s.add_argument("--bandwidth", type=positive_float, default=None, help="bytes/s ceiling (default: 4.24e12 "
                   "on an H200, else a quick probe of the device)")
    s.add_argument("--matmul", type=positive_float, default=None, help="flop/s ceiling (default: 779e12 on an "
                   "H200, else a quick probe of the device)")
    s.add_argument("--out", default=None, help="JSON path (default: ./sweep-MODEL-DATE-TIME.json in the "
                   "current directory)")
    s.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("-q", "--quiet", "--no-progress", dest="no_progress", action="store_true",
                   help="no progress bars")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args) -> int:
    import matplotlib  # noqa: F401  (the plot comes last: fail before the work, not after it)

    from treeflash.bench.presets import check_preset_fits, load_rig
    from treeflash.engine.llm import resolve_device, resolve_dtype

    modes = args.spec or ["off", "dflash", "ddtree"]
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    fill = args.fill or ("random" if args.preset else "prefill")
    if fill == "random" and not args.preset:
        raise ValueError("--fill random is for presets (a checkpoint's context comes from a real prefill)")
    if args.cuda_graphs and (args.tp > 1 or args.ep > 1):
        raise ValueError("--cuda-graphs needs --tp 1 (graphs are not supported under tensor parallelism yet)")
    # one budget, or a comma list (a budget table); --speculative-num-draft-tokens gives one
    args.tree_budget = args.tree_budget if isinstance(args.tree_budget, list) else [args.tree_budget]
    out = sweep_out_path(args)
    _check_dcp_model(args)
    if args.preset:
        from treeflash.bench.sweep import DEFAULT_CONTEXTS

        longest = max(args.contexts or flags.parse_sizes(DEFAULT_CONTEXTS))
        check_preset_fits(args.preset, device, dtype, -(-longest // args.dcp_model) + args.max_tokens,
                          args.tree_budget, args.kv_cache_dtype)
    show = progress.wanted(args.no_progress)
    one = args.tree_budget[0] if len(args.tree_budget) == 1 else None
    with progress.spinner(f"building {args.preset or args.model or 'the shipped pair'}", show=show):
        rig = load_rig(args.model, args.drafter, args.preset, device, dtype, args.page_size, args.scattered,
                       one, args.seed, args.tp, args.ep, args.kv_cache_dtype, options=args.runtime_options,
                       dcp=args.dcp, dcp_model=args.dcp_model, max_positions=_max_positions(args))
    if args.dcp_model > 1:
        rig.extra["dcp_collective_us"] = args.dcp_collective_us
    try:
        return _sweep_on(rig, args, modes, device, dtype, fill, out)
    finally:
        rig.close()


def _max_positions(args) -> int | None:
    if args.max_positions is None:
        return None
    if not args.preset or len(args.max_positions) != 1:
        raise ValueError("--max-position-embeddings takes one size, for a preset (a checkpoint's is its own)")
    return args.max_positions[0]


def _check_dcp_model(args) -> None:
    if args.dcp_model == 1:
        if args.dcp_collective_us is not None:
            raise ValueError("--dcp-collective-us is for --dcp-model N (N > 1)")
        return
    if not args.preset:
        raise ValueError("--dcp-model models one DCP rank on a preset; a checkpoint runs the real group: "
                         "--tp N --dcp M")
    if args.cuda_graphs:
        raise ValueError("--dcp-model runs eager: its graphs would commit a verify's rows as one rank without DCP does")
    if args.dcp_collective_us is None or args.dcp_collective_us < 0:
        raise ValueError("--dcp-model needs --dcp-collective-us US (>= 0): the declared latency a layer of the "
                         "DCP collectives, which one device cannot measure")


def sweep_out_path(args, kind: str = "sweep") -> Path:
    """--out, else ./<kind>-<preset or model folder>-<date-time>.json; its folder made and checked
    writable now, before the benchmark runs."""
    if args.out:
        path = Path(args.out)
    else:
        name = args.preset or (Path(args.model).name if args.model else "shipped-pair")
        path = Path(f"{kind}-{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(path.parent, os.W_OK):
        raise PermissionError(f"cannot write {path}: {path.parent.resolve()} is not writable")
    return path


def _sweep_on(rig, args, modes, device, dtype, fill: str, out: Path) -> int:
    from treeflash import costs as floors
    from treeflash.bench import compare, sweep
    from treeflash.bench.plot import plot_sweep

    clock = progress.Stopwatch()
    rig.cuda_graphs = bool(args.cuda_graphs)
    if rig.drafter is None and any(m != "off" for m in modes):
        raise ValueError("spec modes dflash/ddtree need a drafter (--drafter)")
    acceptances = [a.strip() for a in (args.acceptance or ("oracle" if args.preset else "drafter")).split(",")
                   if a.strip()]
    budgets = args.tree_budget or [None]
    contexts = args.contexts or flags.parse_sizes(sweep.DEFAULT_CONTEXTS)
    limit = rig.cfg.max_position_embeddings
    if args.contexts is None:
        contexts = [c for c in contexts if c <= limit] or [min(1024, limit // 2)]
    elif max(contexts) > limit:
        raise ValueError(f"context {max(contexts)} exceeds the model's max_position_embeddings={limit}")
    ceilings = floors.default_ceilings(device, dtype, args.bandwidth, args.matmul)
    # a budget table (bench/compare.py) for several budgets or acceptances, and for auto alone (its
    # plans warmed before it is timed, its bars against off)
    table = len(budgets) > 1 or len(acceptances) > 1 or "auto" in budgets
    show = progress.wanted(args.no_progress)
    rc = sweep.RunConfig(contexts, modes, args.max_tokens, fill, acceptances[0], args.seed, show,
                         budgets=budgets if table and budgets != [None] else None,
                         acceptances=acceptances if table else None)
    print(f"bench sweep: {rig.source} on {floors.device_name(device)}, {fill} context, "
          f"page {args.page_size}{' scattered' if args.scattered else ''}", flush=True)
    if rig.preset is not None:
        print(f"preset: {rig.preset.notes}")
    bar = progress.bar(len(contexts) * rc.runs_per_context, "sweep", unit="run", show=show, leave=False)
    on_context = None
    if out is not None:  # each finished context written at once (kept if a time limit cuts the run)
        def on_context(partial):
            sweep.write_json(partial | ({"comparison": compare.comparison(partial)} if rc.table else {}), out)
    try:
        result = sweep.sweep(rig, rc, ceilings, log=lambda line: _logged(bar, line), on_context=on_context)
    finally:
        bar.close()
    print(sweep.table(result))
    if rc.table:
        result["comparison"] = compare.comparison(result)
        print("\n" + compare.table(result["comparison"]))
    path = sweep.write_json(result, out)
    png = plot_sweep(result, args.plot or path.with_suffix(".png"))
    print(f"wrote {path.resolve()} and {Path(png).resolve()}")
    shape = f"{len(contexts)} context(s) x {len(modes)} mode(s)"
    if rc.table:
        shape += f", {len(budgets)} budget(s) x {len(acceptances)} acceptance(s)"
    print(f"bench sweep: {shape} in {clock}", file=sys.stderr)
    return 0


def _logged(bar, line: str) -> None:
    """A finished run's line, printed above the bar, which moves one run on."""
    if bar.disable:
        print(line, flush=True)
    else:
        bar.write(line, file=sys.stdout)
    bar.update(1)


def _serve_budgets_arg(text: str) -> list:
    """off, node budgets and auto, comma separated."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if part:
            out.append(part if part in ("off", "auto") else flags.tree_budget_arg(part))
    if not out:
        raise argparse.ArgumentTypeError("expected off, auto or node budgets, comma separated")
    return out


def _counts_arg(text: str) -> list[int]:
    counts = [flags.positive_int(p.strip()) for p in text.split(",") if p.strip()]
    if not counts:
        raise argparse.ArgumentTypeError("expected concurrencies like 1,8,32,64")
    return counts


def _register_serve(bench) -> None:
    from treeflash.bench.presets import PRESETS
    from treeflash.bench.serve import __doc__ as doc
    from treeflash.cli import positive_int

    p = bench.add_parser("serve", help="throughput at several concurrencies: spec off, fixed budgets, auto",
                         description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (SGLang names; vLLM spellings accepted)")
    flags.add_pair_flags(g)
    g.add_argument("--speculative-ddtree-budget", "--tree-budget", dest="tree_budget", type=_serve_budgets_arg,
                   default=["off", 7, 15, 31, "auto"], metavar="off,N,...,auto",
                   help="comma list of off (plain decoding), DDTree node budgets and auto (sized each step per "
                   "request among {1,3,7,15,31,63}, or no tree where none pays); default off,7,15,31,auto")
    flags.add_device_flags(g)
    flags.add_graph_flags(g, "a CUDA device, as the server runs")
    flags.add_runtime_option_flag(g)
    s = p.add_argument_group("the benchmark")
    flags.add_preset_flag(s, PRESETS, "random-weight model at real geometry; refused, with its size, when it "
                          "does not fit in this machine's memory")
    s.add_argument("--concurrency", type=_counts_arg, default=[1, 8, 32, 64],
                   help="comma list of concurrent requests (default 1,8,32,64)")
    s.add_argument("--max-tokens", type=positive_int, default=64, help="tokens a request (default 64)")
    s.add_argument("--prompt-len", type=positive_int, default=128, help="prompt tokens (default 128)")
    s.add_argument("--out", default=None, help="JSON path (default: ./serve-MODEL-DATE-TIME.json in the "
                   "current directory)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("-q", "--quiet", "--no-progress", dest="no_progress", action="store_true",
                   help="no progress bars")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from treeflash.bench import serve
    from treeflash.bench.presets import check_preset_fits, load_rig
    from treeflash.engine.llm import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    out = sweep_out_path(args, "serve")
    trees = [b for b in args.tree_budget if b != "off"]
    if args.preset:  # every request of the largest round held at once
        check_preset_fits(args.preset, device, dtype, max(args.concurrency) * (args.prompt_len + args.max_tokens),
                          trees, args.kv_cache_dtype)
    show = progress.wanted(args.no_progress)
    clock = progress.Stopwatch()
    with progress.spinner(f"building {args.preset or args.model or 'the shipped pair'}", show=show):
        rig = load_rig(args.model, args.drafter, args.preset, device, dtype, args.page_size, seed=args.seed,
                       kv_cache_dtype=args.kv_cache_dtype, options=args.runtime_options)
    try:
        rig.cuda_graphs = args.cuda_graphs if args.cuda_graphs is not None else device.type == "cuda"
        if rig.drafter is None and trees:
            raise ValueError("speculative budgets need a drafter (--drafter)")
        limit = rig.cfg.max_position_embeddings
        if args.prompt_len + args.max_tokens + 64 > limit:
            raise ValueError(f"--prompt-len + --max-tokens exceed the model's max_position_embeddings={limit}")
        cfg = serve.ServeConfig(args.concurrency, args.tree_budget, args.max_tokens, args.prompt_len, progress=show)
        print(f"bench serve: {rig.source} on {serve.costs.device_name(device)}, concurrency {args.concurrency}, "
              f"budgets {args.tree_budget}", flush=True)
        bar = progress.bar(len(args.tree_budget) * len(args.concurrency), "serve", unit="round", show=show,
                           leave=False)
        try:
            result = serve.serve_bench(rig, cfg, log=lambda line: _logged(bar, line))
        finally:
            bar.close()
    finally:
        rig.close()
    print(serve.table(result))
    print(f"wrote {serve.write_json(result, out).resolve()}")
    print(f"bench serve: {len(args.tree_budget)} budget(s) x {len(args.concurrency)} concurrency(ies) in {clock}",
          file=sys.stderr)
    return 0


def _register_moe(bench) -> None:
    from treeflash.bench import moe

    p = bench.add_parser("moe", help="one MoE layer's experts: INT4 (W4A16) beside bf16 and humming-kernels, "
                         "against the byte and matmul floors", description=(moe.__doc__ or "").split("\n\n")[0],
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    moe.add_arguments(p)
    p.set_defaults(func=moe.cmd)


def _register_kernel(bench) -> None:
    """`bench/kernel.py`'s command, when it is in this checkout."""
    try:
        from treeflash.bench import kernel
    except ImportError:
        return
    if not hasattr(kernel, "add_arguments"):
        return
    p = bench.add_parser("kernel", help="MLA verify kernel roofline on one GPU (needs CUDA + Triton)",
                         description=(kernel.__doc__ or "").split("\n\n")[0],
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    kernel.add_arguments(p)
    p.set_defaults(func=lambda args: _cmd_kernel(kernel, args))


def _cmd_kernel(kernel, args) -> int:
    import torch

    if not hasattr(kernel, "run"):
        return kernel.main([])
    if not getattr(args, "compile_report", False) and not torch.cuda.is_available():
        raise ValueError("bench kernel times the verify kernel on a CUDA GPU and none is available here "
                         "(--compile-report compiles for sm_90 without one; on CPU: treeflash bench sweep)")
    kernel.run(args)
    return 0
