"""Why a ddtree step with a narrow tree (budget 8/16, or a dflash chain) costs ~80 ms more
than budget 32 under CUDA graphs (e2e-step, 2026-12-02): torch.profiler of steady steps.

    python benchmarks/profile_spec_graphs.py --out DIR
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from treeflash.bench.presets import DeclaredDrafter, load_rig  # noqa: E402
from treeflash.bench.sweep import RunConfig, decode_run, place_request  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="ddtree:8,ddtree:32,dflash:0,ddtree:8",
                   help="the first case again last: the slow runs of 2026-12-02 were the first after the off run")
    p.add_argument("--draft-graphs", action="store_true", help="also replay the drafter + tree build")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    with torch.inference_mode():
        rig = load_rig(None, None, "kimi-k2-tp8", dev, torch.bfloat16)
        ctx = 1024
        ref = decode_run(rig, ctx, "off", RunConfig([ctx], ["off"], max_tokens=400, progress=False)).token_ids
        for case in args.cases.split(","):
            mode, budget = case.split(":")
            rig.tree_budget = int(budget) if mode == "ddtree" else None
            engine = rig.engine(mode, ctx + 600, drafter=DeclaredDrafter(rig.drafter, ref, ctx, None))
            engine.executor.enable_graphs("cuda", max_rows=engine.verify_width, max_batch=1)
            if args.draft_graphs:
                engine.spec.enable_graphs("cuda")
            place_request(engine, rig, ctx, 380, "random", 0, progress=False)
            for _ in range(4):
                engine.step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
            ms = 1e3 * (time.perf_counter() - t0) / 3
            timer = engine.spec.timer
            timer.enabled = True
            timer.seconds.clear()
            engine.step()
            phases = {k: round(1e3 * sum(v) if isinstance(v, list) else 1e3 * v, 3) for k, v in timer.seconds.items()}
            timer.enabled = False
            print(case, "phases ms:", phases)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
            ka = prof.key_averages()
            text = (f"== {case}: {ms:.2f} ms/step, phases (ms, synced): {phases}\n"
                    + ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70) + "\n"
                    + ka.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
            (out / f"spec-{len(list(out.glob('spec-*')))}-{mode}-{budget}.txt").write_text(text)
            print(text[:7000])
            engine.executor.graphs.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
