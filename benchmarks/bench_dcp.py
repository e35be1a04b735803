"""Decode context parallelism on a real group: the same greedy tokens and logits under TP N x DCP M as
under TP N alone, and what a decode step costs at a long context (benchmarks/gpu_multi_dcp.sh).

For each DCP size: start `LLM(tp=N, dcp=M)` on the checkpoint, decode a prompt greedily (plain and
DDTree), score a sequence, then prefill one request to --context and time plain decode steps.
Writes JSON: tokens equal to the first layout, the logits' max difference, ms a step, KV pages.

    python benchmarks/bench_dcp.py --model X/target --drafter X/drafter --tp 8 --dcp 1,8 --context 131072
    python benchmarks/bench_dcp.py --model X/target --drafter X/drafter --tp 2 --dcp 1,2 --device cpu \
        --dtype float32 --context 512   (the CPU rehearsal, gloo)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from treeflash import LLM, SamplingParams


def layout_run(args, dcp: int) -> dict:
    llm = LLM(args.model, args.drafter, spec="ddtree", tree_budget=args.budget, device=args.device,
              dtype=args.dtype, page_size=args.page_size, tp=args.tp, dcp=dcp,
              kv_cache_tokens=2 * (args.context + 4096), max_model_len=args.context + args.steps + 64)
    try:
        prompt = list(range(3, 3 + args.prompt))
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        spec = llm.generate([prompt], params)[0].token_ids
        llm.engine.spec = None  # plain decode on the same engine and group
        plain = llm.generate([prompt], params)[0].token_ids
        logits = llm.score(prompt + plain, chunk_size=16)  # (chunks after the first attend over dealt keys)
        ms = long_context_steps(llm, args)
        return {"dcp": dcp, "tokens_ddtree": spec, "tokens_plain": plain, "logits": logits,
                "pool_pages": llm.pool.num_pages, "tokens_per_page": llm.pool.tokens_per_page, "ms_per_step": ms}
    finally:
        llm.close()


def long_context_steps(llm, args) -> list[float]:
    """One request prefilled to --context, then --steps plain decode steps timed one by one (ms)."""
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, llm.config.vocab_size - 2, (args.context,), generator=g).tolist()
    req = eng.add_request(prompt, SamplingParams(max_tokens=args.steps + 1, ignore_eos=True))
    while not req.output_ids:
        eng.step()
    out = []
    while not req.finished:
        if llm.device.type == "cuda":
            torch.cuda.synchronize(llm.device)
        t0 = time.perf_counter()
        eng.step()
        if llm.device.type == "cuda":
            torch.cuda.synchronize(llm.device)
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--dcp", default="1,8", help="comma list of DCP sizes (the first is the reference)")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--budget", type=int, default=15)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    runs = [layout_run(args, int(d)) for d in args.dcp.split(",")]
    ref = runs[0]
    for r in runs:
        r["tokens_equal_first"] = (r["tokens_plain"], r["tokens_ddtree"]) == (ref["tokens_plain"], ref["tokens_ddtree"])
        r["logits_max_abs_diff_vs_first"] = float((r["logits"] - ref["logits"]).abs().max())
        r["logits_argmax_agree"] = float((r["logits"].argmax(-1) == ref["logits"].argmax(-1)).float().mean())
        steps = sorted(r["ms_per_step"][2:] or r["ms_per_step"])
        r["ms_per_step_median"] = steps[len(steps) // 2]
        print(f"tp {args.tp} dcp {r['dcp']}: tokens equal {r['tokens_equal_first']}, logits max |diff| "
              f"{r['logits_max_abs_diff_vs_first']:.3g}, argmax agree {r['logits_argmax_agree']:.3f}, "
              f"{r['ms_per_step_median']:.2f} ms a plain step at {args.context}, {r['pool_pages']} pages of "
              f"{r['tokens_per_page']} tokens", flush=True)
    for r in runs:
        del r["logits"]
    Path(args.out).write_text(json.dumps({"tp": args.tp, "context": args.context, "runs": runs}, indent=1))
    return 0 if all(r["tokens_equal_first"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
