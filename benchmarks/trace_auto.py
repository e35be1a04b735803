"""Why the shipped pair's auto budget ran at 0.23x spec off on the H200 (2026-12-02) while
fixed budgets ran at 1.4x: per request, its steps' wall times, the budgets the controller
chose, and the graphs captured meanwhile.

    python benchmarks/trace_auto.py [--device cuda] [--budgets 16,auto] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from treeflash import LLM, SamplingParams  # noqa: E402
from treeflash.bench.sweep import git_commit, sync  # noqa: E402
from treeflash.engine.llm import EMBEDDED  # noqa: E402


def graph_counts(llm: LLM) -> tuple[int, int]:
    g = llm.engine.executor.graphs
    dg = llm.engine.spec.draft_graphs
    return (0 if g is None else len(g.steps)), (0 if dg is None else dg.captures)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--budgets", default="16,auto")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    p.add_argument("--warmup", action="store_true",
                   help="LLM.warmup() first (every candidate budget compiled and captured), as serve does")
    args = p.parse_args()
    dev = torch.device(args.device)
    prompts = [q["text"] for q in json.loads((EMBEDDED / "heldout_prompts.json").read_text())["prompts"]]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    result = {"commit": git_commit(), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    for b in args.budgets.split(","):
        budget = b if b == "auto" else int(b)
        llm = LLM(spec="ddtree", tree_budget=budget, device=args.device, seed=0,
                  cuda_graphs=dev.type == "cuda")
        llm.generate(prompts[0], SamplingParams(max_tokens=8, ignore_eos=True))
        if args.warmup:
            print(f"budget={b} warmup {llm.warmup():.2f} s")
        rows = []
        for i, text in enumerate(prompts):
            v0, d0 = graph_counts(llm)
            req = llm.engine.add_request(llm.encode(text), params)
            times, budgets = [], []
            spec = llm.engine.spec
            while not req.finished:
                sync(dev)
                t0 = time.perf_counter()
                llm.engine.step()
                sync(dev)
                times.append(1e3 * (time.perf_counter() - t0))
                budgets.append(spec.controller.last_budget if spec.controller is not None else budget)
            v1, d1 = graph_counts(llm)
            row = {"request": i, "steps": len(times), "ms": round(sum(times), 1),
                   "max_step_ms": round(max(times), 1), "slow_steps": sum(t > 10 for t in times),
                   "median_step_ms": round(sorted(times)[len(times) // 2], 2),
                   "new_verify_graphs": v1 - v0, "new_draft_captures": d1 - d0,
                   "budgets": sorted(set(budgets))}
            print(f"budget={b} " + json.dumps(row))
            row.update(step_ms=[round(t, 3) for t in times], step_budgets=budgets)  # JSON only
            rows.append(row)
        ctrl = llm.engine.spec.controller
        if ctrl is not None:
            print("controller:", json.dumps(ctrl.summary([256]), default=str)[:1500])
        result[b] = rows
        llm.close()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
