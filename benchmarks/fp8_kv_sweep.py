"""Decode speed over both KV caches side by side: `bench sweep`'s runs (same rig, same contexts,
same declared acceptance) once with the model-dtype cache and once with fp8_e4m3 rows
(`kvcache.format`), then one table of the two. On a GPU, the kimi-k2-tp8 preset (one GPU's
slice of Kimi K2 under TP8: 8 heads, 4 layers built and extrapolated to 61) at long context:

    PYTHONPATH=src python benchmarks/fp8_kv_sweep.py --preset kimi-k2-tp8 --device cuda \\
        --contexts 128k,185k,256k --spec off,ddtree --tree-budget 31 --max-tokens 128 \\
        --cuda-graphs --out benchmarks/results/DIR

Each context runs under both caches back to back (a cut-off run keeps whole pairs). Writes
DIR/sweep-{auto,fp8_e4m3}.json (`bench sweep`'s JSON, each context's runs) and
DIR/fp8-kv-sweep.json (the side-by-side rows), after every context. Speculation figures state
the acceptance they ran under (oracle by default on presets: the target's own greedy
continuation, an upper bound).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

CACHES = ("auto", "fp8_e4m3")


def side_by_side(results: dict[str, dict]) -> list[dict]:
    """One row per (context, mode): ms a step, tok/s, attention ms and x floor under each cache."""
    by = {(r["context"], r["mode"], cache): r for cache, res in results.items() for r in res["runs"]}
    rows = []
    for (context, mode, cache), r in by.items():
        if cache != "auto" or (context, mode, "fp8_e4m3") not in by:
            continue
        f = by[(context, mode, "fp8_e4m3")]
        rows.append({"context": context, "mode": mode, "acceptance": r["mean_acceptance_length"],
                     "declared_acceptance": r.get("declared_acceptance"),
                     "ms_auto": r["ms_per_step"], "ms_fp8": f["ms_per_step"],
                     "speedup": r["ms_per_step"] / f["ms_per_step"],
                     "tok_s_auto": r["tok_s"], "tok_s_fp8": f["tok_s"],
                     "attention_ms_auto": r.get("attention_ms"), "attention_ms_fp8": f.get("attention_ms"),
                     "x_floor_auto": r["x_floor"], "x_floor_fp8": f["x_floor"],
                     "acceptance_fp8": f["mean_acceptance_length"]})
    return rows


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def table(rows: list[dict]) -> str:
    head = (f"| {'Context':>7} | {'Spec':>6} | {'accept':>6} | {'ms auto':>8} | {'ms fp8':>8} | {'speedup':>7} | "
            f"{'tok/s auto':>10} | {'tok/s fp8':>9} | {'x floor auto':>12} | {'x floor fp8':>11} |")
    lines = [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        lines.append(f"| {_k(r['context']):>7} | {r['mode']:>6} | {r['acceptance']:6.2f} | {r['ms_auto']:8.2f} | "
                     f"{r['ms_fp8']:8.2f} | {r['speedup']:7.2f} | {r['tok_s_auto']:10.1f} | {r['tok_s_fp8']:9.1f} | "
                     f"{r['x_floor_auto']:12.2f} | {r['x_floor_fp8']:11.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from treeflash import flags
    from treeflash.bench import floors, sweep
    from treeflash.bench.presets import PRESETS, load_rig
    from treeflash.engine.llm import resolve_device, resolve_dtype

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="kimi-k2-tp8")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--contexts", default="128k,185k,256k")
    p.add_argument("--spec", default="off,ddtree", help="comma list of off, dflash, ddtree")
    p.add_argument("--tree-budget", type=int, default=31)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--acceptance", default="oracle")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--budget-s", type=float, default=0.0, help="start no new context after this many seconds")
    p.add_argument("--out", required=True, help="folder for the JSON files")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rig = load_rig(None, None, args.preset, device, dtype, args.page_size, tree_budget=args.tree_budget)
    rig.cuda_graphs = args.cuda_graphs
    ceilings = floors.default_ceilings(device, dtype)
    modes = [m for m in args.spec.split(",") if m]
    modes_rc = dict(modes=modes, max_tokens=args.max_tokens, fill="random", acceptance=args.acceptance)
    results: dict[str, dict] = {}
    t_start = time.time()
    for context in flags.parse_sizes(args.contexts):  # both caches a context, back to back: a cut keeps pairs
        if args.budget_s and time.time() - t_start > args.budget_s:
            print(f"fp8_kv_sweep: budget {args.budget_s:.0f} s spent, {context} skipped", flush=True)
            continue
        for cache in CACHES:
            rig.kv_cache_dtype = cache
            t0 = time.time()
            print(f"fp8_kv_sweep: {rig.source} at {context}, KV cache {rig.kv_format.label} "
                  f"({rig.kv_format.row_bytes} B a row)", flush=True)
            res = sweep.sweep(rig, sweep.RunConfig([context], **modes_rc), ceilings)
            res["kv_cache_dtype"] = rig.kv_format.label
            if cache in results:
                results[cache]["runs"] += res["runs"]
            else:
                results[cache] = res
            print(sweep.table(res))
            print(f"({time.time() - t0:.0f} s)", flush=True)
            sweep.write_json(results[cache], out / f"sweep-{cache}.json")
        rows = side_by_side(results)
        (out / "fp8-kv-sweep.json").write_text(json.dumps(
            {"preset": args.preset, "device": floors.device_name(device), "commit": sweep.git_commit(),
             "acceptance": args.acceptance, "tree_budget": args.tree_budget, "max_tokens": args.max_tokens,
             "rows": rows}, indent=1))
    print(table(side_by_side(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
