"""Part 3 of benchmarks/gpu_k26_sweep.sh: the K2.6 preset's sweep beside the bf16 one, each one's
auto-against-the-rest tables, the declared-acceptance check and the whole model's memory plan per
GPU, into $OUT/report.md (+ beside.png); exit 1 if a run missed its declared acceptance.

    OUT=DIR PRESET=kimi-k2.6-tp8 BF16_PRESET=kimi-k2-tp8 CONTEXT=256k python benchmarks/k26_report.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

from treeflash.bench import compare
from treeflash.bench.plot import plot_beside
from treeflash.bench.sweep_table import acceptance_misses, beside
from treeflash.cli import main


def sweeps(out: Path, names: list[str]) -> tuple[list[dict], list[str]]:
    """(the sweeps' JSON that exist, partial ones included; the names of those missing), of
    1-<first>.json, 2-<second>.json."""
    paths = [out / f"{i}-{name}.json" for i, name in enumerate(names, 1)]
    return [json.loads(p.read_text()) for p in paths if p.is_file()], [p.name for p in paths if not p.is_file()]


def memory_plan(preset: str, context: str) -> str:
    """`doctor --memory-plan` of the model `preset` slices, at the TP it is a slice of (kimi-k2.6-tp8:
    8): against an H100 and an H200, then this machine's GPU (its total as CUDA reports it; on a CPU
    the two again). A refusal is kept in the text, as the command prints it."""
    args = ["doctor", "--preset", preset, "--memory-plan", "--context", context]
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        for argv in ([*args, "--gpu-memory", "h100,h200"], args):
            print("$ treeflash " + " ".join(argv))
            try:
                print(f"(exit {main(argv)})")
            except SystemExit as e:
                print(f"(exit {e.code})")
    return text.getvalue().rstrip()


def measured_memory(res: dict) -> str | None:
    """A CUDA sweep's peak beyond its built weights and each run's KV pool (graphs, workspace, the
    drafter's rings, whatever else a step holds), the most over its runs, beside what
    `memory_plan` estimates for that slice at TP 1 (None: no CUDA figures in `res`)."""
    import torch

    from treeflash.bench.presets import PRESETS
    from treeflash.config import DrafterConfig, ModelConfig
    from treeflash.memory_plan import plan_model

    runs = [r for r in res["runs"] if r.get("memory")]
    if not runs or res.get("preset") not in PRESETS:
        return None
    worst = max(runs, key=lambda r: r["memory"]["peak_allocated_bytes"] - r["memory"]["kv_pool_bytes"])
    rest = worst["memory"]["peak_allocated_bytes"] - worst["memory"]["kv_pool_bytes"] - res["weights_bytes"]
    p = PRESETS[res["preset"]]
    plan = plan_model(ModelConfig.from_hf(p.target), DrafterConfig.from_hf(p.drafter), dtype=torch.bfloat16)
    return (f"{res['preset']}: weights built {res['weights_bytes'] / 1e9:.2f} GB; peak beyond them and the KV pool "
            f"{rest / 1e9:.2f} GB (most at {worst['context']} {worst['mode']}); memory_plan for this slice: "
            f"workspace {plan.workspace / 1e9:.2f} + graphs {plan.graphs / 1e9:.2f} + drafter window "
            f"{plan.drafter_window / 1e9:.2f} GB")


def report(out: Path, preset: str, bf16: str, context: str) -> tuple[str, bool]:
    """(report.md's text, whether every sweep ran and reached its declared acceptance)."""
    results, missing = sweeps(out, [preset, bf16])
    lines = [f"no result: {name} (its sweep stopped before its first context: see run.log)" for name in missing]
    misses = []
    if results:
        lines += ["## Side by side", "", beside(results), ""]
        print(f"wrote {plot_beside(results, out / 'beside.png')}")
    for res in results:
        cut = f" (cut short: {res['partial']})" if res.get("partial") else ""
        lines += [f"## {res['preset']} ({res['expert_format']}): auto against off and the fixed budget{cut}", "",
                  compare.table(compare.comparison(res)), ""]
        misses += acceptance_misses(res)
    check = ("MISMATCH:\n" + "\n".join(misses) if misses else
             "ok: every dflash / ddtree-N run reached its declared acceptance" if results else "no sweep result")
    lines += ["## Acceptance check", "", check, ""]
    measured = [m for m in map(measured_memory, results) if m]
    if measured:
        lines += ["## Memory measured (CUDA peak of the sweeps' runs)", "", *measured, ""]
    lines += ["## Memory plan: the whole model, per GPU", "", "```", memory_plan(preset, context), "```"]
    return "\n".join(lines) + "\n", not missing and not misses


if __name__ == "__main__":
    out = Path(os.environ["OUT"])
    text, ok = report(out, os.environ["PRESET"], os.environ["BF16_PRESET"], os.environ.get("CONTEXT", "256k"))
    (out / "report.md").write_text(text)
    print(text, end="")
    raise SystemExit(0 if ok else 1)
