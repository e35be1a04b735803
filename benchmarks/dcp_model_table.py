"""Issue 47's modelled DCP table (benchmarks/gpu_dcp_model.sh): one DCP N rank's attention a layer
(`bench kernel --dcp N`, CUDA graphs over the layers) against its floor + 5 us, and the step composed.

The step under DCP N is COMPOSED, not run: the DCP 1 step of `bench sweep --cuda-graphs` (a preset,
its layers extrapolated) with its attention replaced layer for layer by the modelled rank's,

    ms/step DCP N = ms/step DCP 1 + layers x (attn DCP N - attn DCP 1) + layers x collectives,

the collectives (the queries' all-gather and the partials' all-to-all) at a declared latency a layer
(one GPU cannot run them; gpu_multi_dcp.sh measures them on a TP8 machine). Everything else in the
step (projections, MoE, drafter, host) is DCP 1's: DCP does not change it. Per mode the step's
slope per +1k context (least squares over the contexts) under DCP N against DCP 1's / N.

    python benchmarks/dcp_model_table.py KERNEL.json SWEEP.json --collective-us 30 --out table.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# what is read of a `bench sweep` JSON (tests/bench/test_dcp_sweep.py checks a real one has them)
SWEEP_FIELDS = ("dcp", "cuda_graphs", "preset", "runs")
SWEEP_RUN_FIELDS = ("context", "mode", "layers_reported", "ms_per_step", "rows_verified")


def compose(kernel: dict, sweep: dict, collective_us: float) -> list[dict]:
    """A row per (context, mode) found in both: attention a layer DCP 1 / N with floors and the
    verdicts, the step DCP 1 (measured) and DCP N (composed)."""
    runs = {(r["context"], r["mode"]): r for r in sweep["runs"]}
    out = []
    for k in kernel["dcp"]:
        run = runs.get((k["context"], k["mode"]))
        one, many = k["dcp1"], k["dcpN"]
        if run is None or "error" in one or "error" in many:
            continue
        layers = run["layers_reported"]
        step1 = run["ms_per_step"]
        out.append({
            "context": k["context"], "mode": k["mode"], "rows": k["rows"], "sweep_rows": run["rows_verified"],
            "layers": layers,
            "dcp1_attention_us_per_layer": one["us_per_layer"], "dcp1_floor_us": one["floor_us"],
            "dcp1_within_floor_plus_5us": one["within_floor_plus_5us"],
            "dcpN_attention_us_per_layer": many["us_per_layer"], "dcpN_floor_us": many["floor_us"],
            "dcpN_verify_us_per_layer": many["verify_us_per_layer"],
            "dcpN_glue_us_per_layer": many["dcp_glue_us_per_layer"],
            "dcpN_within_floor_plus_5us": many["within_floor_plus_5us"],
            "dcp1_ms_per_step": step1,
            "dcpN_collectives_ms": layers * collective_us / 1e3,
            "dcpN_ms_per_step_composed": step1 + layers * (many["us_per_layer"] - one["us_per_layer"]) / 1e3
                                         + layers * collective_us / 1e3,
        })
    return out


def slope_per_1k(points: list[tuple[int, float]]) -> float | None:
    """Least-squares ms per +1024 tokens of (context, ms) points (None with fewer than 2 contexts)."""
    if len({c for c, _ in points}) < 2:
        return None
    return 1024 * statistics.linear_regression([c for c, _ in points], [m for _, m in points]).slope


def slopes(table: list[dict], n: int) -> dict:
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in table):
        rs = [r for r in table if r["mode"] == mode]
        s1 = slope_per_1k([(r["context"], r["dcp1_ms_per_step"]) for r in rs])
        sn = slope_per_1k([(r["context"], r["dcpN_ms_per_step_composed"]) for r in rs])
        out[mode] = {"dcp1_ms_per_1k": s1, "dcp1_over_N": s1 / n if s1 is not None else None,
                     "dcpN_ms_per_1k": sn, "dcpN_over_dcp1": sn / s1 if s1 and sn is not None else None}
    return out


def fmt(v, spec=".1f") -> str:
    if v is None:
        return "-"
    return ("yes" if v else "NO") if isinstance(v, bool) else format(v, spec)


def markdown(table: list[dict], sl: dict, n: int, note: str) -> str:
    lines = [note, "",
             f"| context | mode (rows) | attn us/layer DCP1 (floor) | ok | attn us/layer DCP{n} rank (floor; verify + "
             f"dcp) | ok | ms/step DCP1 | ms/step DCP{n} composed (collectives) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        rows = f"{r['rows']}" + ("" if r["rows"] == r["sweep_rows"] else f", sweep {r['sweep_rows']}!")
        lines.append(
            f"| {r['context'] // 1024}k | {r['mode']} ({rows}) | {fmt(r['dcp1_attention_us_per_layer'])} "
            f"({fmt(r['dcp1_floor_us'])}) | {fmt(r['dcp1_within_floor_plus_5us'])} | "
            f"{fmt(r['dcpN_attention_us_per_layer'])} ({fmt(r['dcpN_floor_us'])}; "
            f"{fmt(r['dcpN_verify_us_per_layer'])} + {fmt(r['dcpN_glue_us_per_layer'])}) | "
            f"{fmt(r['dcpN_within_floor_plus_5us'])} | {fmt(r['dcp1_ms_per_step'], '.2f')} | "
            f"{fmt(r['dcpN_ms_per_step_composed'], '.2f')} ({fmt(r['dcpN_collectives_ms'], '.2f')}) |")
    lines += ["", f"| mode | slope DCP1 ms/+1k | DCP1 / {n} | slope DCP{n} ms/+1k | DCP{n} / DCP1 (bar: 1/{n} = "
              f"{1 / n:.3f}) |", "|---|---|---|---|---|"]
    for mode, s in sl.items():
        lines.append(f"| {mode} | {fmt(s['dcp1_ms_per_1k'], '.4f')} | {fmt(s['dcp1_over_N'], '.4f')} | "
                     f"{fmt(s['dcpN_ms_per_1k'], '.4f')} | {fmt(s['dcpN_over_dcp1'], '.3f')} |")
    return "\n".join(lines)


def build(kernel: dict, sweep: dict, collective_us: float) -> dict:
    n = kernel["args"]["dcp"]
    if n < 2 or not kernel.get("dcp"):
        raise SystemExit("the first JSON must be `bench kernel --dcp N` (N > 1) with its dcp rows")
    if sweep.get("dcp", 1) != 1 or sweep.get("dcp_modelled"):
        raise SystemExit("the second JSON must be a DCP 1 `bench sweep` (no --dcp-model)")
    table = compose(kernel, sweep, collective_us)
    timing = "CUDA graphs" if sweep.get("cuda_graphs") else "EAGER (not the GPU's step: rerun with --cuda-graphs)"
    note = (f"{kernel['gpu']}, {sweep.get('preset')}: attention a layer = a CUDA graph of {kernel['args']['layers']} "
            f"layers (`bench kernel --dcp {n}`); DCP1 steps: `bench sweep` under {timing}; DCP{n} steps COMPOSED "
            f"(DCP1's step with the rank's attention in place of DCP1's, layer for layer, + {collective_us:g} us a "
            f"layer of collectives, declared). ok: within floor + 5 us.")
    return {"dcp": n, "device": kernel["gpu"], "preset": sweep.get("preset"), "collective_us_per_layer": collective_us,
            "sweep_cuda_graphs": bool(sweep.get("cuda_graphs")), "composed": True, "note": note,
            "ceilings": kernel.get("ceilings"), "rows": table, "slopes": slopes(table, n)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernel", help="JSON of `bench kernel --dcp N`")
    p.add_argument("sweep", help="JSON of a DCP 1 `bench sweep --cuda-graphs` (same contexts, modes and rows)")
    p.add_argument("--collective-us", type=float, required=True,
                   help="declared microseconds a layer of the DCP collectives")
    p.add_argument("--out", required=True, help="JSON path; the markdown table goes beside it (.md)")
    args = p.parse_args(argv)
    res = build(json.loads(Path(args.kernel).read_text()), json.loads(Path(args.sweep).read_text()),
                args.collective_us)
    out = Path(args.out)
    out.write_text(json.dumps(res, indent=1))
    md = markdown(res["rows"], res["slopes"], res["dcp"], res["note"])
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
