"""Issue 9 on N GPUs (or N CPU processes with gloo): tensor vs expert parallel, one JSON.

    python benchmarks/bench_tp.py --model OUT/target --drafter OUT/drafter --layouts 1x1,8x1,8x8 \\
        --device cuda --out benchmarks/results/tp-<stamp>.json
    (OUT from `treeflash bench export --preset kimi-k2 --out OUT`; layouts are TPxEP)

For each layout, in one process group:
1. equality: greedy tokens of plain decode and of ddtree with the declared (oracle) drafter
   at a short context, against the first layout's (normally 1x1);
2. decode steps at batch 1 and batch B (default 16), plain decode: median ms/step,
   rank 0's all-reduce time per step (waiting for the slowest rank included), and the MoE
   load (worst layer's tokens per expert and per EP rank, max/mean), from the sweep's own
   instrumented step.
Prints a table and writes every figure to JSON. Prompts are random token ids (the exported
presets have no tokenizer); the context is reached by a real prefill on every rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from treeflash import SamplingParams  # noqa: E402
from treeflash.bench.presets import DeclaredDrafter, load_rig  # noqa: E402
from treeflash.bench.sweep import RunConfig, decode_run, git_commit, instrument, sync  # noqa: E402
from treeflash.parallel.stats import moe_load  # noqa: E402


def batch_steps(rig, batch: int, context: int, tokens: int, seed: int = 0) -> dict:
    """Plain decode of `batch` requests at `context`: ms/step, all-reduce ms, MoE load."""
    engine = rig.engine("off", context + tokens + 8, max_running=batch)
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(2, rig.cfg.vocab_size - 2, (context,), generator=g).tolist(), params)
    while engine.waiting or any(r.num_cached < len(r.prompt_ids) for r in engine.running):
        engine.step()  # prefill (chunked), until every request decodes
    times = []
    for _ in range(3):  # warm-up
        engine.step()
    while engine.has_unfinished() and len(times) < tokens - 6:
        sync(rig.device)
        t0 = time.perf_counter()
        engine.step()
        sync(rig.device)
        times.append(time.perf_counter() - t0)
    with instrument(engine.model, rig.device) as clock:
        sync(rig.device)
        engine.step()
        sync(rig.device)
    parts = {k: 1e3 * sum(v) for k, v in clock.collect().items()}
    load = moe_load(engine.model)
    while engine.has_unfinished():
        engine.step()
    return {"batch": batch, "context": context, "ms_per_step": 1e3 * statistics.median(times),
            "steps": len(times), "all_reduce_ms": parts.get("all_reduce", 0.0),
            "target_forward_ms": parts.get("target_forward"),
            "moe_expert_max_over_mean": max((lay["expert_max_over_mean"] for lay in load["layers"]), default=None),
            "moe_rank_max_over_mean": load["worst_rank_max_over_mean"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--layouts", default="1x1,2x1,2x2", help="TPxEP list; the first is the reference")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=1024, help="context of the timed decode steps")
    p.add_argument("--batch", type=int, default=16, help="the large batch (batch 1 is always timed)")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    layouts = [tuple(int(x) for x in lay.split("x")) for lay in args.layouts.split(",")]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "model": args.model, "dtype": args.dtype,
              "command": "python benchmarks/bench_tp.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "layouts": []}
    out = Path(args.out or f"benchmarks/results/tp-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    reference = None
    with torch.inference_mode():
        for tp, ep in layouts:
            rig = load_rig(args.model, args.drafter, None, device, dtype, tree_budget=16, tp=tp, ep=ep)
            try:
                rc = RunConfig([64], ["off"], max_tokens=20, fill="prefill", progress=False)
                off = decode_run(rig, 64, "off", rc).token_ids
                spec = decode_run(rig, 64, "ddtree", rc, drafter=DeclaredDrafter(rig.drafter, off, 64)).token_ids
                row = {"tp": tp, "ep": ep, "tokens_off": off, "tokens_ddtree": spec}
                if reference is None:
                    reference = off
                row["equal_to_reference"] = off == reference and spec == reference
                row["steps"] = [batch_steps(rig, b, args.context, args.tokens) for b in (1, args.batch)]
            finally:
                rig.close()
            result["layouts"].append(row)
            out.write_text(json.dumps(result, indent=1))
            for s in row["steps"]:
                print(f"tp={tp} ep={ep} batch={s['batch']:3d}: {s['ms_per_step']:8.2f} ms/step, all-reduce "
                      f"{s['all_reduce_ms']:6.2f} ms, MoE expert max/mean {s['moe_expert_max_over_mean']}, "
                      f"rank max/mean {s['moe_rank_max_over_mean']:.2f}; tokens equal to reference: "
                      f"{row['equal_to_reference']}", flush=True)
    print(f"wrote {out}")
    return 0 if all(r["equal_to_reference"] for r in result["layouts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
