"""Compare a DCP 1 sweep with a `--dcp-model N` sweep of the same preset (benchmarks/gpu_dcp_model.sh).

Per (context, mode): the rank's attention time a layer against its floor (+ 5 us is the issue's
bar), the step (measured, and with the declared collectives), and per mode the step's slope per
+1k context under DCP N against DCP 1's divided by N. Writes JSON and a markdown table.

    python benchmarks/dcp_model_table.py DCP1.json DCPN.json --out table.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SLACK_US = 5.0  # issue 47: per-rank attention within floor + 5 us a layer


def per_layer_us(run: dict, key: str) -> float | None:
    v = run.get(key)
    return None if v is None else 1e3 * v / run["layers_reported"]


def rows(one: dict, many: dict) -> list[dict]:
    base = {(r["context"], r["mode"]): r for r in one["runs"]}
    out = []
    for r in many["runs"]:
        b = base.get((r["context"], r["mode"]))
        attn, floor = per_layer_us(r, "attention_ms"), per_layer_us(r, "attention_floor_ms")
        out.append({
            "context": r["context"], "mode": r["mode"],
            "dcp1_attention_us_per_layer": per_layer_us(b, "attention_ms") if b else None,
            "dcp1_attention_floor_us_per_layer": per_layer_us(b, "attention_floor_ms") if b else None,
            "dcpN_attention_us_per_layer": attn, "dcpN_attention_floor_us_per_layer": floor,
            "dcpN_within_floor_plus_5us": None if attn is None else attn <= floor + SLACK_US,
            "dcp1_ms_per_step": b["ms_per_step"] if b else None,
            "dcpN_ms_per_step_measured": r["ms_per_step_measured"], "dcpN_ms_per_step": r["ms_per_step"],
            "dcpN_collectives_ms": (r.get("dcp") or {}).get("collectives_ms"),
        })
    return out


def slopes(one: dict, many: dict, n: int) -> dict:
    out = {}
    for mode, s in many["slopes"].items():
        s1 = one["slopes"].get(mode, {}).get("ms_per_1k")
        sn = s.get("ms_per_1k")
        out[mode] = {"dcp1_ms_per_1k": s1, "dcpN_ms_per_1k": sn, "dcp1_over_N": s1 / n if s1 else None,
                     "dcpN_over_dcp1": sn / s1 if s1 and sn else None}
    return out


def fmt(v, spec=".1f") -> str:
    return "-" if v is None else (str(v) if isinstance(v, bool) else format(v, spec))


def markdown(table: list[dict], sl: dict, n: int) -> str:
    lines = [f"| context | mode | attn us/layer DCP1 (floor) | attn us/layer DCP{n} (floor) | <= floor+5 | "
             f"ms/step DCP1 | ms/step DCP{n} (+collectives) |", "|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(
            f"| {r['context'] // 1024}k | {r['mode']} | {fmt(r['dcp1_attention_us_per_layer'])} "
            f"({fmt(r['dcp1_attention_floor_us_per_layer'])}) | {fmt(r['dcpN_attention_us_per_layer'])} "
            f"({fmt(r['dcpN_attention_floor_us_per_layer'])}) | {fmt(r['dcpN_within_floor_plus_5us'])} | "
            f"{fmt(r['dcp1_ms_per_step'], '.2f')} | {fmt(r['dcpN_ms_per_step_measured'], '.2f')} "
            f"(+{fmt(r['dcpN_collectives_ms'], '.2f')}) |")
    lines += ["", f"| mode | slope DCP1 ms/1k | DCP1 / {n} | slope DCP{n} ms/1k | DCP{n} / DCP1 |",
              "|---|---|---|---|---|"]
    for mode, s in sl.items():
        lines.append(f"| {mode} | {fmt(s['dcp1_ms_per_1k'], '.4f')} | {fmt(s['dcp1_over_N'], '.4f')} | "
                     f"{fmt(s['dcpN_ms_per_1k'], '.4f')} | {fmt(s['dcpN_over_dcp1'], '.3f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dcp1", help="sweep JSON without DCP")
    p.add_argument("dcpn", help="sweep JSON of --dcp-model N (same preset, contexts, modes)")
    p.add_argument("--out", required=True, help="JSON path; the markdown table goes beside it (.md)")
    args = p.parse_args(argv)
    one, many = json.loads(Path(args.dcp1).read_text()), json.loads(Path(args.dcpn).read_text())
    n = many.get("dcp", 1)
    if one.get("dcp", 1) != 1 or n == 1:
        raise SystemExit("give a DCP 1 sweep first, then a --dcp-model N sweep")
    table, sl = rows(one, many), slopes(one, many, n)
    out = Path(args.out)
    out.write_text(json.dumps({"dcp": n, "device": many["meta"]["device"], "preset": many["preset"],
                               "collective_us_per_layer": (many["runs"][0].get("dcp") or {}).get(
                                   "collective_us_per_layer"), "rows": table, "slopes": sl}, indent=1))
    md = markdown(table, sl, n)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
