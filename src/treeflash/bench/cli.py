"""`treeflash bench ...`: sweep (decode against context, beside the floors), kernel, moe (the MoE
experts' kernels, INT4 and bf16), export, and diff (two results side by side)."""

from __future__ import annotations

import argparse

from treeflash.cli import positive_float, sizes_arg, tree_budget_arg


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: decode sweep against context, verify kernel",
                       description="Benchmarks that print every figure beside its hardware floor.")
    bench = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    _register_sweep(bench)
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
    from treeflash.engine.llm import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    target, drafter = export_preset(args.preset, args.out, device, resolve_dtype(args.dtype, device), args.seed,
                                    args.shard_gb << 30, not args.no_progress)
    print(f"wrote {target} and {drafter}: treeflash bench sweep --model {target} --drafter {drafter} "
          "--acceptance oracle --tp N")
    return 0


def _register_sweep(bench) -> None:
    from treeflash.bench.presets import PRESETS
    from treeflash.bench.sweep import DEFAULT_CONTEXTS
    from treeflash.cli import positive_int

    p = bench.add_parser(
        "sweep", help="decode tok/s, ms/step, acceptance and each part of a step vs its floor, by context",
        description="Bring one request to each context, decode with each spec mode, and print a table "
        "(tok/s, ms/step, floor, acceptance, nodes, verify attention and its effective KV bandwidth, "
        "MoE/projections, drafter, host), the step-time slope per +1k context against the floor's, "
        "a JSON file and a PNG plot.")
    p.add_argument("--model", help="target checkpoint directory (default: the embedded pair)")
    p.add_argument("--drafter", help="DFlash drafter directory (default: the embedded drafter)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="random-weight model at real geometry instead of a checkpoint (see bench/presets.py)")
    p.add_argument("--contexts", type=sizes_arg, default=None,
                   help=f"comma list, k = 1024 (default {DEFAULT_CONTEXTS}, those the model allows)")
    p.add_argument("--spec", default="off,dflash,ddtree", help="comma list of off, dflash, ddtree")
    p.add_argument("--tree-budget", type=tree_budget_arg, default=None,
                   help="DDTree node budget, or auto (chosen from measured verify cost and acceptance)")
    p.add_argument("--max-tokens", type=positive_int, default=128,
                   help="tokens decoded per context and mode (default 128; first 2 steps are warm-up)")
    p.add_argument("--acceptance", default=None,
                   help="oracle (full acceptance), K (target's own tokens for K depths, then wrong), or "
                   "drafter (the real drafter's; not for presets). Default: oracle for presets, else drafter")
    p.add_argument("--fill", choices=["random", "prefill"], default=None,
                   help="reach the context by random latents (presets only; default for them) or a real "
                   "prefill with a progress bar (default for checkpoints)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--page-size", type=positive_int, default=64, help="KV page size in tokens (default 64)")
    p.add_argument("--scattered", action="store_true",
                   help="shuffle KV pages over the pool (with --page-size 1: the incident's layout)")
    p.add_argument("--bandwidth", type=positive_float, default=None, help="bytes/s ceiling (default: 4.24e12 "
                   "on an H200, else a quick probe of the device)")
    p.add_argument("--matmul", type=positive_float, default=None, help="flop/s ceiling (default: 779e12 on an "
                   "H200, else a quick probe of the device)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks for a checkpoint (one process each; gloo on CPU, NCCL on GPU)")
    p.add_argument("--ep", type=positive_int, default=1, help="expert-parallel groups; must divide --tp")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay CUDA graphs of the decode/verify forward (GPU; eager on the CPU)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sweep-*.json)")
    p.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args) -> int:
    from treeflash.bench.presets import load_rig
    from treeflash.engine.llm import resolve_device, resolve_dtype

    modes = [m.strip() for m in args.spec.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("off", "dflash", "ddtree")]
    if bad or not modes:
        raise ValueError(f"--spec takes off, dflash, ddtree; got {args.spec!r}")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    fill = args.fill or ("random" if args.preset else "prefill")
    if fill == "random" and not args.preset:
        raise ValueError("--fill random is for presets (a checkpoint's context comes from a real prefill)")
    if args.cuda_graphs and (args.tp > 1 or args.ep > 1):
        raise ValueError("--cuda-graphs needs --tp 1 (graphs are not supported under tensor parallelism yet)")
    rig = load_rig(args.model, args.drafter, args.preset, device, dtype, args.page_size, args.scattered,
                   args.tree_budget, args.seed, args.tp, args.ep)
    try:
        return _sweep_on(rig, args, modes, device, dtype, fill)
    finally:
        rig.close()


def _sweep_on(rig, args, modes, device, dtype, fill: str) -> int:
    from treeflash.bench import floors, sweep
    from treeflash.bench.plot import plot_sweep

    rig.cuda_graphs = args.cuda_graphs
    if rig.drafter is None and any(m != "off" for m in modes):
        raise ValueError("spec modes dflash/ddtree need a drafter (--drafter)")
    acceptance = args.acceptance or ("oracle" if args.preset else "drafter")
    contexts = args.contexts or sweep.parse_sizes(sweep.DEFAULT_CONTEXTS)
    limit = rig.cfg.max_position_embeddings
    if args.contexts is None:
        contexts = [c for c in contexts if c <= limit] or [min(1024, limit // 2)]
    elif max(contexts) > limit:
        raise ValueError(f"context {max(contexts)} exceeds the model's max_position_embeddings={limit}")
    ceilings = floors.default_ceilings(device, dtype, args.bandwidth, args.matmul)
    rc = sweep.RunConfig(contexts, modes, args.max_tokens, fill, acceptance, args.seed, not args.no_progress)
    print(f"bench sweep: {rig.source} on {floors.device_name(device)}, {fill} context, "
          f"page {args.page_size}{' scattered' if args.scattered else ''}")
    if rig.preset is not None:
        print(f"preset: {rig.preset.notes}")
    result = sweep.sweep(rig, rc, ceilings)
    print(sweep.table(result))
    path = sweep.write_json(result, args.out)
    png = plot_sweep(result, args.plot or path.with_suffix(".png"))
    print(f"wrote {path} and {png}")
    return 0


def _register_moe(bench) -> None:
    from treeflash.bench import moe

    p = bench.add_parser("moe", help="one MoE layer's experts: INT4 (W4A16) beside bf16 and humming-kernels, "
                         "against the byte and matmul floors", description=(moe.__doc__ or "").split("\n\n")[0],
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    moe.add_arguments(p)
    p.set_defaults(func=moe.cmd)


def _register_kernel(bench) -> None:
    """The kernel engineer's `bench/kernel.py`, when it is in this checkout."""
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
