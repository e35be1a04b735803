"""`bench sweep`'s printing: the per-run table, the side-by-side tok/s per mode, the slopes,
and the JSON a later run can diff."""

from __future__ import annotations

import datetime
import json
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
    head = (f"| {'Context':>7} | {'Spec':>6} | {'Decode (tok/s)':>14} | {'ms/step':>8} | {'floor ms':>8} | "
            f"{'x floor':>7} | {'accept len':>10} | {'nodes':>5} | {'attn ms':>8} | {'attn x fl':>9} | "
            f"{'KV GB/s':>8} | {'MoE+proj ms':>11} | {'drafter ms':>10} | {'host ms':>7} |")
    lines += [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in runs:
        p = r["parts"]
        pf = r.get("part_floors", {})
        moe_keys, drafter_keys = ("mla_projections", "dense_mlp", "moe"), ("drafter", "drafter_extend")
        moe = sum(p[k]["ms"] for k in moe_keys if k in p) if any(k in p for k in moe_keys) else None
        drafter = sum(p[k]["ms"] for k in drafter_keys if k in p) if any(k in p for k in drafter_keys) else None
        lines.append(
            f"| {_k(r['context']):>7} | {r['mode']:>6} | {r['tok_s']:>14.1f} | {r['ms_per_step']:>8.2f} | "
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
