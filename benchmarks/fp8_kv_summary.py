"""Issue 45's bars from one `benchmarks/gpu_fp8_kv.sh` output folder: the fp8 correctness checks,
the kernel grid (many-row shapes >= 0.8 of the fp8 floor at >= 64k; plain decode at 185k >= 1.6x
the bf16 cache), the accuracy table (greedy agreement >= 99%, acceptance within 2% of bf16) and
the kimi sweep's side-by-side rows. Parts that did not run say so.

    python benchmarks/fp8_kv_summary.py OUT_DIR      # prints, and writes OUT_DIR/summary.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MANY_ROWS = 512  # N x H at or above this: the many-row (compute-bound) shapes
N1_CONTEXT = 185 * 1024


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def checks(out: Path) -> dict:
    """The `bench kernel --check --kv-dtype fp8` logs (a run cut by its time limit writes no JSON):
    cases ok and bad, and the logs that did not reach their end."""
    ok, bad, cut = 0, [], []
    for path in sorted(out.glob("check-*fp8.log")):
        text = path.read_text(errors="replace")
        ok += sum(line.startswith("check ok") for line in text.splitlines())
        bad += [line for line in text.splitlines() if line.startswith("check BAD")]
        if "check_fp8: all ok" not in text and "check_fp8: FAILURES" not in text:
            cut.append(path.name)
    return {"cases_ok": ok, "failures": bad, "cut_or_crashed": cut, "ok": ok > 0 and not bad and not cut}


def grid(out: Path) -> dict:
    rows = [r for r in _jsonl(out / "grid-rows.jsonl") if "error" not in r and r.get("mode") == "contiguous"]
    fp8 = [r for r in rows if r["kv_dtype"] == "fp8"]
    many = [{"context": r["context"], "n": r["n"], "h": r["h"], "frac_floor": round(r["frac_floor"], 3)}
            for r in fp8 if r["n"] * r["h"] >= MANY_ROWS and r["context"] >= 65536]
    bf16 = {(r["context"], r["n"], r["h"]): r for r in rows if r["kv_dtype"] == "bf16"}
    n1 = [{"h": r["h"], "bf16_ms": bf16[key]["step_ms"], "fp8_ms": r["step_ms"],
           "speedup": bf16[key]["step_ms"] / r["step_ms"]}
          for r in fp8 if r["n"] == 1 and r["context"] == N1_CONTEXT
          and (key := (r["context"], 1, r["h"])) in bf16]
    errors = [r for r in _jsonl(out / "grid-rows.jsonl") if "error" in r]
    return {"rows": len(rows), "errors": len(errors),
            "many_row_fp8": many, "many_row_ok": bool(many) and all(m["frac_floor"] >= 0.8 for m in many),
            "n1_185k": n1, "n1_ok": bool(n1) and all(x["speedup"] >= 1.6 for x in n1)}


def accuracy(out: Path) -> dict:
    results = []
    for path in sorted(out.glob("accuracy*/accuracy.json")):
        results += json.loads(path.read_text())
    rows = [{"model": r["model"], "prompts": r["prompts"], "tokens": r["tokens"],
             "agreement": r["fp8_vs_bf16"]["agreement"],
             "logits_rel_err_median": r["fp8_vs_bf16"]["logits_rel_err_median"],
             "acceptance_fp8_over_bf16": r["acceptance"]["fp8_over_bf16"],
             "acceptance_fp32_over_bf16": r["acceptance"]["fp32_over_bf16"],
             "bf16_vs_fp32_agreement": r["bf16_vs_fp32"]["agreement"]} for r in results]
    for r in rows:
        r["ok"] = r["agreement"] >= 0.99 and abs(r["acceptance_fp8_over_bf16"] - 1) <= 0.02
    return {"models": rows, "results": results}


def sweep(out: Path) -> dict:
    path = out / "sweep" / "fp8-kv-sweep.json"
    return json.loads(path.read_text()) if path.is_file() else {"rows": []}


def summarise(out: Path) -> dict:
    acc = accuracy(out)
    if acc["results"]:  # the models ran in separate processes: one table of both
        sys.path.insert(0, str(Path(__file__).parent))
        from fp8_kv_accuracy import table

        (out / "accuracy.md").write_text(table(acc["results"]) + "\n")
    return {"checks": checks(out), "grid": grid(out), "accuracy": acc["models"], "sweep": sweep(out)["rows"]}


def report(s: dict) -> str:
    c, g = s["checks"], s["grid"]
    lines = [f"fp8 checks: {c['cases_ok']} ok, {len(c['failures'])} bad" + (", all ok" if c["ok"] else "")]
    lines += [f"  {line}" for line in c["failures"]]
    if c["cut_or_crashed"]:
        lines.append(f"  cut by the time limit or crashed: {', '.join(c['cut_or_crashed'])}")
    lines.append(f"grid: {g['rows']} rows ({g['errors']} errors)")
    for m in g["many_row_fp8"]:
        lines.append(f"  many-row fp8 L={m['context']} N={m['n']} H={m['h']}: {m['frac_floor']:.2f} of the floor")
    lines.append(f"  many-row bar (>= 0.8 at >= 64k): {'met' if g['many_row_ok'] else 'NOT met / not run'}")
    for x in g["n1_185k"]:
        lines.append(f"  N=1 185k H={x['h']}: bf16 {x['bf16_ms']:.4f} ms, fp8 {x['fp8_ms']:.4f} ms: "
                     f"{x['speedup']:.2f}x")
    lines.append(f"  N=1 185k bar (>= 1.6x): {'met' if g['n1_ok'] else 'NOT met / not run'}")
    for a in s["accuracy"]:
        lines.append(f"accuracy {a['model']} ({a['prompts']} x {a['tokens']}): agreement {100 * a['agreement']:.2f}%, "
                     f"acceptance fp8/bf16 {a['acceptance_fp8_over_bf16']:.4f} (fp32/bf16 "
                     f"{a['acceptance_fp32_over_bf16']:.4f}): {'met' if a['ok'] else 'NOT met'}")
    if not s["accuracy"]:
        lines.append("accuracy: not run")
    for r in s["sweep"]:
        lines.append(f"sweep {r['context']} {r['mode']} (acceptance {r['acceptance']:.2f}): {r['ms_auto']:.2f} ms "
                     f"bf16, {r['ms_fp8']:.2f} ms fp8: {r['speedup']:.2f}x")
    if not s["sweep"]:
        lines.append("sweep: not run")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    s = summarise(out)
    (out / "summary.json").write_text(json.dumps(s, indent=1))
    print(report(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
