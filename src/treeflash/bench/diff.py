"""`treeflash bench diff OLD.json NEW.json`: two benchmark results side by side.

Records are compared all the time ("ddtree -10% on the 2026-12-06 H200 record"); this reads
two JSON files written by `bench sweep` or `bench kernel` and prints, for every point both hold,
the old figure, the new one and their ratio. Points are keyed the way the benchmarks write them:
a sweep run by (context, spec mode); a kernel row by (section, mode, context, nodes, heads, tree,
page size). Points only one file holds are counted, not hidden. Files from different GPUs, presets
or layouts are still compared, with a line that says so first: the ratio then mixes machines.

    treeflash bench diff benchmarks/results/h100-*-rope-in-absorb-sweep/apart1/sweep-*.json \
        benchmarks/results/h100-*-sweep-long-context/sweep-*-contiguous-*.json
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

KERNEL_SECTIONS = ("grid", "compare", "prefill", "defrag")


@dataclass(frozen=True)
class Result:
    """One benchmark file: its kind ("sweep" or "kernel"), what it ran on, and its points."""

    path: str
    kind: str
    header: dict  # gpu, commit, date and the settings that must match for a fair ratio
    points: dict  # key tuple -> {metric: value}


def load(path: str | Path) -> Result:
    """Read a sweep or kernel-bench JSON; ValueError if it is neither."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from e
    if isinstance(data, dict) and isinstance(data.get("runs"), list):
        return _sweep(str(path), data)
    if isinstance(data, dict) and any(isinstance(data.get(s), list) for s in KERNEL_SECTIONS):
        return _kernel(str(path), data)
    raise ValueError(f"{path}: neither a `bench sweep` result (a 'runs' list) nor a `bench kernel` "
                     f"result (a list under one of {', '.join(KERNEL_SECTIONS)})")


def _sweep(path: str, data: dict) -> Result:
    meta = data.get("meta", {})
    header = {"gpu": meta.get("device"), "commit": meta.get("commit"), "date": meta.get("date"),
              "switches": meta.get("switches") or {}, "preset": data.get("preset"),
              "page_size": data.get("page_size"), "scattered": data.get("scattered"),
              "cuda_graphs": data.get("cuda_graphs"), "tree_budget": data.get("tree_budget"),
              "acceptance": data.get("acceptance")}
    points = {}
    for r in data["runs"]:
        points[(r["context"], r["mode"])] = {"ms_per_step": r.get("ms_per_step"), "tok_s": r.get("tok_s"),
                                             "x_floor": r.get("x_floor")}
    return Result(path, "sweep", header, points)


def _kernel(path: str, data: dict) -> Result:
    header = {"gpu": data.get("gpu"), "commit": data.get("commit"), "date": data.get("date"),
              "switches": data.get("switches") or {}}
    points = {}
    for section in KERNEL_SECTIONS:
        for r in data.get(section) or []:
            if not isinstance(r, dict):
                continue
            shape = (r.get("mode", "contiguous"), r.get("context"), r.get("n"), r.get("h"), r.get("tree"))
            # a compare row holds one result per variant; grid and prefill rows are one result
            variants = r["variants"].items() if isinstance(r.get("variants"), dict) else [(None, r)]
            for name, v in variants:
                ms = v.get("step_ms", v.get("single_ms")) if isinstance(v, dict) else None
                if ms is None:
                    continue  # an error, or a row of other figures (defrag)
                key = (section, *shape, v.get("page_size"), name)
                points[key] = {"step_ms": ms, "frac_floor": v.get("frac_floor", v.get("frac_peak"))}
    return Result(path, "kernel", header, points)


def mismatches(old: Result, new: Result) -> list[str]:
    """The header fields that differ (what makes a ratio compare more than the code)."""
    return [f"{k}: {old.header.get(k)!r} -> {new.header.get(k)!r}" for k in old.header
            if k not in ("commit", "date") and old.header.get(k) != new.header.get(k)]


def rows(old: Result, new: Result) -> list[dict]:
    """One row per point both files hold, in the old file's order, with new / old per metric."""
    if old.kind != new.kind:
        raise ValueError(f"{old.path} is a {old.kind} result and {new.path} a {new.kind} result")
    out = []
    for key, a in old.points.items():
        b = new.points.get(key)
        if b is None:
            continue
        row = {"key": key}
        for metric in a:
            x, y = a.get(metric), b.get(metric)
            row[metric] = (x, y, y / x if x and y is not None else None)
        out.append(row)
    return out


def _fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def report(old: Result, new: Result) -> str:
    """The printed comparison: both headers, any setting that differs, the table, the leftovers."""
    lines = [f"old: {old.path} ({old.header.get('gpu')}, commit {str(old.header.get('commit'))[:9]}, "
             f"{old.header.get('date')})",
             f"new: {new.path} ({new.header.get('gpu')}, commit {str(new.header.get('commit'))[:9]}, "
             f"{new.header.get('date')})"]
    diff = mismatches(old, new)
    if diff:
        lines.append("settings differ, so the ratios mix more than the code: " + "; ".join(diff))
    table = rows(old, new)
    if old.kind == "sweep":
        lines.append(f"{'context':>8} {'spec':>7} | {'old ms':>8} {'new ms':>8} {'new/old':>7} | "
                     f"{'old tok/s':>9} {'new tok/s':>9} | {'old x fl':>8} {'new x fl':>8}")
        for r in table:
            ctx, mode = r["key"]
            a, b, q = r["ms_per_step"]
            lines.append(f"{_k(ctx):>8} {mode:>7} | {_fmt(a):>8} {_fmt(b):>8} {_fmt(q, 3):>7} | "
                         f"{_fmt(r['tok_s'][0], 1):>9} {_fmt(r['tok_s'][1], 1):>9} | "
                         f"{_fmt(r['x_floor'][0]):>8} {_fmt(r['x_floor'][1]):>8}")
    else:
        lines.append(f"{'section':>8} {'mode':>10} {'context':>7} {'N':>5} {'H':>4} {'tree':>6} "
                     f"{'variant':>8} | {'old us':>8} {'new us':>8} {'new/old':>7} | "
                     f"{'old fl':>6} {'new fl':>6}")
        for r in table:
            section, mode, ctx, n, h, tree, _page, variant = r["key"]
            a, b, q = r["step_ms"]
            lines.append(f"{section:>8} {str(mode):>10} {_k(ctx):>7} {n!s:>5} {h!s:>4} {str(tree):>6} "
                         f"{variant or '-':>8} | {_fmt(a * 1e3, 1):>8} {_fmt(b * 1e3, 1):>8} "
                         f"{_fmt(q, 3):>7} | {_fmt(r['frac_floor'][0]):>6} {_fmt(r['frac_floor'][1]):>6}")
    only_old = len(old.points) - len(table)
    only_new = len(new.points) - len(table)
    lines.append(f"{len(table)} point{'' if len(table) == 1 else 's'} in both; {only_old} only in old, "
                 f"{only_new} only in new")
    return "\n".join(lines)


def _k(n) -> str:
    return f"{n // 1024}k" if isinstance(n, int) and n % 1024 == 0 else str(n)


def cmd_diff(args) -> int:
    old, new = load(args.old), load(args.new)
    print(report(old, new))
    return 0
