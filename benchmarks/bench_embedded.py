"""End-to-end decode of the shipped pair: spec off vs DFlash chain vs DDTree, same prompts, one run.

    python benchmarks/bench_embedded.py [--device cpu|cuda] [--max-tokens 128] [--budgets 8,16,32] [--repeats 5]

--runtime-option overlap=0 / =1 runs the speculative modes with the sequential / overlapped step
(speculative/decoder.py; by default overlapped on CUDA, sequential on the CPU); the JSON's meta says which
and records every runtime option set away from its default.

Prompts are the held-out ones shipped beside the model (assets/heldout_prompts.json), greedy
(T=0). Prints a table and writes JSON under benchmarks/results/ (machine, date, commit, every
figure). Each mode runs the prompts one at a time (batch 1, the latency case) after a warm-up;
--repeats R interleaves R timed passes of every mode and reports medians (off's speed drifted
1400-1860 decode tok/s between calls on the H200, so one pass each was a noisy ratio).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from treeflash import LLM, SamplingParams
from treeflash.bench.sweep import git_commit
from treeflash.engine.llm import EMBEDDED
from treeflash.flags import add_runtime_option_flag
from treeflash.runtime import RuntimeOptions
from treeflash.speculative.overlap import overlap_enabled


def prepare(spec: str, budget, prompts: list[str], args) -> LLM:
    llm = LLM(spec=spec, tree_budget=budget, device=args.device, dtype=args.dtype, seed=0, cuda_graphs=args.graphs,
              runtime_options=args.runtime_options)
    llm.warmup()  # every budget it may use compiled and captured, as `treeflash serve` does
    # ...and every prompt's prefill shape compiled: the modes share one process, so without
    # this the first mode (off) paid the Triton compiles of every later mode's prefill too
    # (H200, 2026-12-02: off's mean TTFT 208 ms against ddtree's 14 ms)
    for p in prompts:
        llm.generate(p, SamplingParams(max_tokens=16, ignore_eos=True))
    return llm


def timed_pass(llm: LLM, spec: str, budget, prompts: list[str], args) -> dict:
    """One pass over the prompts (batch 1, one at a time), timed."""
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    tokens, seconds, outs = 0, 0.0, []
    for p in prompts:
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = llm.generate(p, params)[0]
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
        outs.append(out)
    timing = [o.metrics["timing"] for o in outs]
    dec_s = sum(t["decode_s"] for t in timing)
    dec_tok = sum(t["decode_tokens"] for t in timing)
    row = {"spec": spec, "tree_budget": budget, "tokens": tokens, "seconds": round(seconds, 3),
           "tok_s": round(tokens / seconds, 2),
           # decode only: from each request's first token (prefill's) to its last
           "decode_tokens": dec_tok, "decode_seconds": round(dec_s, 4),
           "decode_tok_s": round(dec_tok / dec_s, 2) if dec_s > 0 else None,
           "ttft_ms_mean": round(1e3 * sum(t["ttft_s"] for t in timing) / len(timing), 3),
           "token_ids": [o.token_ids for o in outs]}
    spec_m = [o.metrics.get("speculative_decoding") for o in outs]
    if spec_m[0]:
        steps = sum(m["num_spec_steps"] for m in spec_m)
        acc = sum(m["num_accepted_draft_tokens"] for m in spec_m)
        row["mean_acceptance_length"] = round(1 + acc / steps, 3)
        row["num_spec_steps"] = steps
    return row


def combine_passes(passes: list[list[dict]]) -> list[dict]:
    """passes[r][m]: pass r of mode m (mode 0 = off). A mode's row is its first pass (tokens and
    acceptance are the same every pass) with tok/s, decode tok/s and TTFT replaced by their
    medians over the passes, and the speedups by the median of the same-round ratios against
    off (off's speed drifts between rounds on the device; a ratio taken within one round
    cancels that drift). Every pass's figures stay in the row."""
    rows = []
    for m in range(len(passes[0])):
        row = dict(passes[0][m])
        for key in ("tok_s", "decode_tok_s", "ttft_ms_mean"):
            vals = [p[m][key] for p in passes]
            row[key] = round(statistics.median(vals), 2)
            row[f"{key}_passes"] = vals
        for key, out in (("tok_s", "speedup_vs_off"), ("decode_tok_s", "decode_speedup_vs_off")):
            ratios = [p[m][key] / p[0][key] for p in passes]
            row[out] = round(statistics.median(ratios), 3)
            row[f"{out}_passes"] = [round(x, 3) for x in ratios]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--budgets", default="8,16,32")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16")
    ap.add_argument("--graphs", action="store_true", help="replay CUDA graphs of decode/verify")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed passes per mode, interleaved (off, dflash, ddtree..., off, ...); figures "
                         "are medians, speedups the median of same-round ratios")
    ap.add_argument("--out", default=None)
    add_runtime_option_flag(ap)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    try:
        args.runtime_options = RuntimeOptions.parse(args.runtime_option)
    except ValueError as e:
        ap.error(str(e))
    shipped = json.loads((EMBEDDED / "heldout_prompts.json").read_text())["prompts"]
    prompts = [p["text"] for p in shipped]
    modes = [("off", None), ("dflash", None)] + [
        ("ddtree", b if b == "auto" else int(b)) for b in args.budgets.split(",")]
    llms = [prepare(s, b, prompts, args) for s, b in modes]
    passes = []
    for r in range(args.repeats):
        passes.append([timed_pass(llm, s, b, prompts, args) for llm, (s, b) in zip(llms, modes, strict=True)])
        if args.repeats > 1:
            print(f"pass {r + 1}/{args.repeats}: " + ", ".join(
                f"{p['spec']}{p['tree_budget'] or ''} {p['decode_tok_s']:.0f}" for p in passes[-1]) + " decode tok/s",
                flush=True)
    rows = combine_passes(passes)
    base = rows[0]
    print("| spec | budget | tok/s | x off | decode tok/s | decode x off | TTFT ms | accept len | same tokens as off |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        r["lossless"] = r["token_ids"] == base["token_ids"]
        # bf16: a verify of N rows rounds differently from a 1-row decode, so a near-tie may
        # flip; where each prompt first differs tells a flip (late, rare) from a bug (early).
        r["first_divergence"] = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None)
                                 for x, y in zip(r["token_ids"], base["token_ids"], strict=True)]
        print(f"| {r['spec']} | {r['tree_budget'] or '-'} | {r['tok_s']:.1f} | {r['speedup_vs_off']:.2f} | "
              f"{r['decode_tok_s']:.1f} | {r['decode_speedup_vs_off']:.2f} | {r['ttft_ms_mean']:.1f} | "
              f"{r.get('mean_acceptance_length', 1.0):.2f} | {r['lossless']} |")
    device = LLM(spec="off", device=args.device).device
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.machine()} CPU, "
                   f"{torch.get_num_threads()} threads",
        "torch": torch.__version__, "prompts": len(prompts), "max_tokens": args.max_tokens, "temperature": 0.0,
        "repeats": args.repeats,
        "overlap": overlap_enabled(device, args.runtime_options),
        "runtime_options": args.runtime_options.changed(),
        "command": "python benchmarks/bench_embedded.py " + " ".join(
            [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
             for k, v in vars(args).items()
             if v is not None and v is not False and k not in ("runtime_option", "runtime_options")]
            + [f"--runtime-option {item}" for item in args.runtime_option]),
    }
    for r in rows:
        r.pop("token_ids")
    out = Path(args.out or f"benchmarks/results/embedded-e2e-{device.type}-{datetime.date.today():%Y%m%d}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
