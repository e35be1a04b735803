"""The shipped pair on the CPU under a declared acceptance: decode tok/s of spec off, fixed
budgets and auto, rounds interleaved, medians (issue 42's CPU figure: auto with an always-wrong
drafter against plain decode).

Each prompt's reference is the target's own greedy continuation (spec off); the drafter is the
shipped one wrapped in `DeclaredDrafter` (its real compute, then the reference for `--accept`
depths and a confident wrong token after: 0 = always wrong). Decode tok/s = tokens after the
first / seconds after the first token, per request; each mode's figure is the median over
prompts x rounds. Writes JSON (device, date, commit, every sample) with --out.

    python benchmarks/cpu_spec_cost.py --accept 0 --modes off,auto,7,15 --rounds 3
    python benchmarks/cpu_spec_cost.py --accept drafter --modes off,auto,3,7,15,31 --prompt-len 1024
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from treeflash import LLM, SamplingParams
from treeflash.bench.presets import DeclaredDrafter
from treeflash.bench.sweep import git_commit
from treeflash.engine.llm import EMBEDDED


def _prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens: held-out text i, then the texts after it, cycled (for long ones)."""
    texts = [p["text"] for p in json.loads((EMBEDDED / "heldout_prompts.json").read_text())["prompts"]]
    ids = [llm.encode(t) for t in texts]
    out = []
    for i in range(n):
        p: list[int] = []
        for k in range(64 * len(ids)):
            p += ids[(i + k) % len(ids)]
            if len(p) >= length:
                break
        if len(p) < length:
            raise ValueError(f"the held-out prompts hold {len(p)} tokens, fewer than --prompt-len {length}")
        out.append(p[:length])
    return out


def _budget(mode: str):
    return mode if mode == "auto" else int(mode)


def _decode_tok_s(out) -> float:
    t = out.metrics["timing"]
    return t["decode_tokens"] / t["decode_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accept", default="0",
                    help="declared accepted depths (0: always wrong), or 'drafter': the shipped drafter's own")
    ap.add_argument("--modes", default="off,auto,7,15", help="off, auto and fixed budgets")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (heldout prompts, cut)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", action="store_true", help="LLM.warmup(max tokens) each engine first")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.accept != "drafter" and not args.accept.isdigit():
        ap.error(f"--accept must be a number of depths or 'drafter', got {args.accept!r}")
    torch.set_num_threads(args.threads)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    plain = LLM(spec="off", device="cpu", dtype="float32")
    prompts = _prompts(plain, args.prompts, args.prompt_len)
    refs = [p + o.token_ids for p, o in zip(prompts, plain.generate(prompts, params), strict=True)]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    llms = {m: plain if m == "off" else LLM(drafter=EMBEDDED / "drafter", spec="ddtree", tree_budget=_budget(m),
                                             device="cpu", dtype="float32") for m in modes}
    if args.warmup:
        for llm in llms.values():
            llm.warmup(max_tokens=args.max_tokens)
    samples: dict[str, list[float]] = {m: [] for m in modes}
    extra: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:
            llm = llms[m]
            for prompt, ref in zip(prompts, refs, strict=True):
                spec = llm.engine.spec
                if spec is not None and args.accept != "drafter":
                    inner = getattr(spec.drafter, "inner", spec.drafter)
                    spec.drafter = DeclaredDrafter(inner, ref, 0, int(args.accept))
                out = llm.generate(prompt, params)[0]
                assert out.token_ids == ref[len(prompt):], f"{m}: not the greedy text"
                samples[m].append(_decode_tok_s(out))
                sd = out.metrics.get("speculative_decoding")
                if sd is not None:
                    extra[m].append({k: sd.get(k) for k in ("num_spec_steps", "num_plain_steps", "steps_by_budget",
                                                             "mean_acceptance_length") if k in sd})
            print(f"round {r + 1}/{args.rounds} {m:>5}: {statistics.median(samples[m][-len(prompts):]):.1f} tok/s "
                  f"{extra[m][-1] if extra[m] else ''}", flush=True)
    off = statistics.median(samples["off"]) if "off" in samples else None
    accept = "the real drafter" if args.accept == "drafter" else f"declared acceptance {args.accept}"
    print(f"\nshipped pair, CPU float32, {accept}, prompts of {args.prompt_len}, {args.max_tokens} tokens, "
          f"{len(prompts)} prompts x {args.rounds} rounds (median decode tok/s):")
    meds = {m: statistics.median(samples[m]) for m in modes}
    fixed = {m: v for m, v in meds.items() if m not in ("off", "auto")}
    best = max(fixed, key=fixed.get) if fixed else None
    for m in modes:
        rel = f" ({meds[m] / off:.2f}x off)" if off else ""
        if m == "auto" and best is not None:
            rel += f" ({meds[m] / fixed[best]:.2f}x the best fixed budget, {best})"
        print(f"  {m:>5}: {meds[m]:7.1f}{rel}")
    if args.out:
        result = {"device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "commit": git_commit(), "accept": args.accept, "prompt_len": args.prompt_len,
                  "max_tokens": args.max_tokens,
                  "samples": samples, "spec": extra, "time": time.time()}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
