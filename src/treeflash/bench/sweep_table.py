"""`bench sweep`'s printing: the per-run table, the side-by-side tok/s per mode, the slopes,
and the JSON a later run can diff."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path


def _k(n: int) -> str:
    return f"{n / 1024:.4g}k" if n >= 1024 else str(n)


def _f(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _one_line(r: dict) -> str:
    return (f"  {_k(r['context']):>6} {r['mode']:>6}: {r['tok_s']:.1f} tok/s, {r['ms_per_step']:.2f} ms/step "
            f"(floor {r['floor_ms']:.3f} ms, {r['x_floor']:.1f}x), acceptance {r['mean_acceptance_length']:.2f}")


def table(result: dict) -> str:
    runs = result["runs"]
    lines = []
    if result["extrapolated"]:
        lines.append(f"(times extrapolated from {result['layers_measured']} measured layers to "
                     f"{result['layers_reported']}; measured figures in the JSON)")
    head = (f"| {'Context':>7} | {'Spec':>6} | {'Experts':>7} | {'Decode (tok/s)':>14} | {'ms/step':>8} | "
            f"{'floor ms':>8} | {'x floor':>7} | {'accept len':>10} | {'nodes':>5} | {'attn ms':>8} | "
            f"{'attn x fl':>9} | {'KV GB/s':>8} | {'MoE+proj ms':>11} | {'drafter ms':>10} | {'host ms':>7} |")
    lines += [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in runs:
        p = r["parts"]
        pf = r.get("part_floors", {})
        moe_keys, drafter_keys = ("mla_projections", "dense_mlp", "moe"), ("drafter", "drafter_extend")
        moe = sum(p[k]["ms"] for k in moe_keys if k in p) if any(k in p for k in moe_keys) else None
        drafter = sum(p[k]["ms"] for k in drafter_keys if k in p) if any(k in p for k in drafter_keys) else None
        lines.append(
            f"| {_k(r['context']):>7} | {r['mode']:>6} | {r.get('expert_format', '-'):>7} | {r['tok_s']:>14.1f} | "
            f"{r['ms_per_step']:>8.2f} | "
            f"{r['floor_ms']:>8.3f} | {r['x_floor']:>7.1f} | {r['mean_acceptance_length']:>10.2f} | "
            f"{r['nodes_verified']:>5.1f} | {_f(r['attention_ms'], '.3f'):>8} | "
            f"{_f(pf.get('attention', {}).get('x_floor')):>9} | {_f(r['kv_gbps'], '.1f'):>8} | "
            f"{_f(moe, '.2f'):>11} | {_f(drafter, '.2f'):>10} | "
            f"{_f(p.get('host_other', {}).get('ms') if p else None, '.2f'):>7} |")
    ar = [(r["context"], r["mode"], r["parts"]["all_reduce"]["ms"]) for r in runs
          if r["parts"].get("all_reduce", {}).get("ms")]
    if ar:
        lines.append("all-reduce per step (rank 0, waiting for the slowest rank included): " + ", ".join(
            f"{_k(c)} {m} {ms:.2f} ms" for c, m, ms in ar))
    spread = [line for r in runs if (line := _host_spread(r))]
    if spread:
        lines.append("host ms is the median of few instrumented steps; these steps are not like the "
                     "others (a one-time capture or rebuild?): " + "; ".join(spread))
    if result.get("cuda_graphs"):
        lines.append("(CUDA graphs: the target forward is one replay, timed on the device and scaled by "
                     "the layer count; no attention / MoE split: run with graphs off for that)")
    lines.append("")
    lines.append(side_by_side(result))
    lines.append("")
    for mode, s in result["slopes"].items():
        lines.append(f"slope {mode:>6}: {_f(s['ms_per_1k'], '.4f')} ms per +1k context "
                     f"(floor {_f(s['floor_ms_per_1k'], '.4f')}, {_f(s['x_floor'])}x)")
    lines.append(f"acceptance: {result['acceptance']}")
    if result.get("expert_format"):
        lines.append(f"routed experts: {result['expert_format']}" + (
            " (W4A16: packed INT4 + bf16 scales; the floors count the bytes as stored)"
            if "int4" in result["expert_format"] else ""))
    lines.append(f"context: {result['fill_note']}")
    lines.append(f"ceilings: {result['ceilings']['bandwidth'] / 1e9:.1f} GB/s, "
                 f"{result['ceilings']['matmul'] / 1e12:.2f} TFLOP/s ({result['ceilings']['source']})")
    switches = result.get("meta", {}).get("switches")
    if switches:  # an A/B run: not the defaults' figures
        lines.append("switches away from their defaults: " + ", ".join(f"{k}={v}" for k, v in switches.items()))
    return "\n".join(lines)


def _host_spread(r: dict) -> str | None:
    """A note when one instrumented step's untimed host time dwarfs the others' (its median is
    the table's host ms: with two or three samples, one such step sets it)."""
    host = sorted(r.get("instrumented_host_ms") or [])
    if len(host) < 2 or host[-1] < 1.0 or host[-1] < 5 * host[0]:
        return None
    return f"{_k(r['context'])} {r['mode']}: {', '.join(f'{x:.2f}' for x in r['instrumented_host_ms'])} ms"


def side_by_side(result: dict) -> str:
    modes = list(result["slopes"])
    contexts = sorted({r["context"] for r in result["runs"]})
    by = {(r["context"], r["mode"]): r for r in result["runs"]}
    head = "| Context | " + " | ".join(f"{m + ' tok/s':>13} | {m + ' ms':>10}" for m in modes) + " |"
    lines = [head]
    for c in contexts:
        cells = []
        for m in modes:
            r = by.get((c, m))
            cells.append(f"{_f(r and r['tok_s']):>13} | {_f(r and r['ms_per_step'], '.2f'):>10}")
        lines.append(f"| {_k(c):>7} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(result: dict, path: str | Path | None) -> Path:
    if path is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = result["preset"] or "model"
        path = Path("benchmarks/results") / f"sweep-{name}-{stamp}.json"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return path


def beside(results: list[dict]) -> str:
    """Sweeps of the same contexts and modes side by side (e.g. a preset with INT4 routed experts
    and its bf16 twin), one row per (context, mode): each sweep's expert format, decode tok/s
    over all timed steps (`tok_s_mean`: auto mixes trees and plain steps), ms a step (median),
    its floor and acceptance length, then the first sweep's tok/s over each other's."""
    names = [f"{r.get('preset') or r.get('model')} ({r.get('expert_format', '?')})" for r in results]
    keys = list(dict.fromkeys((r["context"], r["mode"]) for res in results for r in res["runs"]))
    by = [{(r["context"], r["mode"]): r for r in res["runs"]} for res in results]
    head = ["context", "spec"]
    for n in names:
        head += [f"{n} tok/s", "ms/step", "floor ms", "accept len"]
    head += [f"tok/s {names[0]} / {n}" for n in names[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for key in keys:
        cells = [_k(key[0]), key[1]]
        for b in by:
            r = b.get(key)
            cells += [_f(r and r["tok_s_mean"]), _f(r and r["ms_per_step"], ".2f"), _f(r and r["floor_ms"], ".2f"),
                      _f(r and r["mean_acceptance_length"], ".2f")]
        first = by[0].get(key)
        for b in by[1:]:
            r = b.get(key)
            cells.append(_f(first["tok_s_mean"] / r["tok_s_mean"], ".2f") + "x" if first and r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("tok/s: tokens over the seconds of all timed steps (extrapolated to the real layer count where a "
                 "preset keeps fewer); acceptance: " + "; ".join(
                     f"{n}: {res.get('acceptance')}" for n, res in zip(names, results)))
    return "\n".join(lines)


def expected_acceptance(run: dict, result: dict) -> float | None:
    """The mean acceptance length a fixed-size spec run must reach under its declared acceptance:
    K accepted + the bonus token under acceptance K, the whole block under oracle, capped by the
    drafter's block and a ddtree-N's N + 1 nodes; None for off, auto (its steps may be plain or
    smaller trees) and the real drafter's own proposals."""
    spec, budget = run.get("spec", run["mode"]), run.get("tree_budget", result.get("tree_budget"))
    if spec not in ("dflash", "ddtree") or budget == "auto":
        return None
    declared = run.get("acceptance") or run.get("declared_acceptance") or ""
    if declared.startswith("oracle"):
        want = float("inf")
    elif m := re.fullmatch(r"(\d+)|fixed: the target's own tokens for (\d+) depths.*", declared):
        want = int(m.group(1) or m.group(2)) + 1
    else:
        return None
    cap = result.get("drafter_block_size") or want
    if spec == "ddtree" and isinstance(budget, int):
        cap = min(cap, budget + 1)
    return min(want, cap)


def acceptance_misses(result: dict, tol: float = 0.05) -> list[str]:
    """One line per spec run whose mean acceptance length is off `expected_acceptance` by more
    than `tol` (a declared acceptance the engine did not reach, or passed); [] when all match."""
    out = []
    for r in result["runs"]:
        want = expected_acceptance(r, result)
        if want is not None and abs(r["mean_acceptance_length"] - want) > tol:
            out.append(f"{result.get('preset') or result.get('model')} {_k(r['context'])} {r['mode']}: acceptance "
                       f"length {r['mean_acceptance_length']:.2f}, declared {want:g}")
    return out
