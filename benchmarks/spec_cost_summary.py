"""One table of issue 42's ratios against their bars, from the JSON and logs that
benchmarks/gpu_spec_cost.sh left in its work folder: the kimi presets' budget tables (auto against
the best of off and every fixed budget; at acceptance 0 against off, and auto's untapped plain
step against off's step), the long acceptance-0 runs of part 4 (the same bars, over plain spells
long enough to run untapped), the shipped pair with its real drafter (auto against the best
fixed budget), serving (auto against the best other at each concurrency) and the lossless
check. A part that is missing or was cut short says so.

    python benchmarks/spec_cost_summary.py WORK_DIR > summary.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from treeflash.bench import compare, serve


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 else str(n)


def sweep_rows(path: Path, part: str) -> list[list[str]]:
    """One line per (acceptance, context) and bar of a budget-table sweep."""
    if not path.exists():
        return [[part, "-", "-", "-", "-", "missing (timed out before its first context, or failed)"]]
    result = json.loads(path.read_text())
    rows = result.get("comparison") or compare.comparison(result)
    out = []
    for r in sorted(rows, key=lambda r: (str(r["acceptance"]), r["context"])):
        steps = compare._steps(r) + _plain_step_ratio(r)
        timed = [x["captures_timed"] for x in result["runs"] if x.get("tree_budget") == "auto"
                 and x["context"] == r["context"] and str(x.get("acceptance")) == str(r["acceptance"])
                 and "captures_timed" in x]
        for name, bar in r["bar"].items():
            what = {"best": f"auto / best ({r['best']})", "off": "auto / off",
                    "best_fixed": f"auto / best fixed ({r['best_fixed']})",
                    "plain_step": "auto's untapped plain step / off's step (extrapolated)"}[name]
            out.append([part, f"acceptance {r['acceptance']}, {_k(r['context'])}", what, f"{bar['ratio']:.2f}",
                        f"{bar.get('op', '>=')} {bar['bar']}", ("PASS" if bar["pass"] else "FAIL")
                        + f" (auto's steps {steps}; graphs captured timed: {sum(timed) if timed else '-'})"])
    return out


def _plain_step_ratio(row: dict) -> str:
    """At acceptance 0 auto's steps are nearly all plain: its median plain step by forward
    (untapped: spec off's; tapped: the last TAP_BEFORE_PROBE before a probe) against off's,
    extrapolated and measured (before extrapolation: the host's share shows), with counts."""
    ratios = row.get("plain_step_over_off") or {}
    if str(row["acceptance"]) != "0" or not ratios:
        return ""
    return "; plain step / off's: " + ", ".join(
        f"{k} {v['full']:.3f} (measured {v['measured']:.3f}, {v['steps']} steps)" for k, v in sorted(ratios.items()))


def serve_rows(path: Path) -> list[list[str]]:
    if not path.exists():
        return [["serve", "-", "-", "-", "-", "missing (timed out or failed)"]]
    result = json.loads(path.read_text())
    by = {(r["budget"], r["concurrency"]): r for r in result["rows"]}
    out = []
    for c in dict.fromkeys(r["concurrency"] for r in result["rows"]):
        auto = by.get(("auto", c))
        others = {b: r["tok_s"] for (b, cc), r in by.items() if cc == c and b != "auto"}
        if auto is None or not others:
            continue
        best = max(others, key=others.get)
        ratio = auto["tok_s"] / others[best]
        out.append(["serve", f"concurrency {c}", f"auto / best other ({best})", f"{ratio:.2f}", ">= 0.97",
                    ("PASS" if ratio >= 0.97 else "FAIL") + f" (captures timed: {auto.get('captures', '-')})"])
    return out


def lossless_row(path: Path) -> list[list[str]]:
    lines = path.read_text().splitlines() if path.exists() else []
    line = next((x for x in lines if x.startswith("lossless")), None)
    ok = line is not None and line.split(": ")[-1].split("/")[0] == line.split("/")[-1].split()[0]
    return [["lossless", "shipped pair, float32", "auto tokens = off tokens", line.split(": ")[-1] if line else "-",
             "all", "PASS" if ok else "FAIL or missing"]]


def main() -> None:
    work = Path(sys.argv[1])
    rows = lossless_row(work / "0-lossless.log")
    for path in sorted(work.glob("1-*.json")):
        rows += sweep_rows(path, path.stem[2:])
    if not list(work.glob("1-*.json")):
        rows += sweep_rows(work / "1-kimi-k2-tp8.json", "kimi-k2-tp8")
    for path in sorted(work.glob("4-*.json")):
        rows += sweep_rows(path, path.stem[2:])
    rows += sweep_rows(work / "2-shipped-pair.json", "shipped pair")
    rows += serve_rows(work / "3-serve.json")
    head = ["part", "where", "ratio", "value", "bar", "verdict"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    fails = sum("FAIL" in r[-1] or "missing" in r[-1] for r in rows)
    print(f"\n{len(rows)} checks, {fails} failing or missing")
    if (work / "3-serve.json").exists():
        print("\n" + serve.table(json.loads((work / "3-serve.json").read_text())))


if __name__ == "__main__":
    main()
