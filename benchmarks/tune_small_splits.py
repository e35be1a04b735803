"""The verify attention of the shipped pair's geometry over its split counts (H200, 2026-12-03:
at ~1k keys each layer's call is a split kernel (~6.3 us) and an LSE combine (~2.3 us); one split
writes the output directly and launches no combine).

Embedded target geometry: 4 heads, latent 64 + rope 32 (D = 96, v_dim = 64), page 64, bf16; rows
= 4 x (1 | 16 | 32) (plain decode, budget 15, budget 31). Contexts 256-8192, the page table as wide
as the engine's CUDA graphs make it (`graphs.page_bucket`, a power of two of pages). For each
shape: the engine's own plan, then every forced split count in SPLITS that the plan allows,
each checked against the one-split output (bf16 tolerance) and timed as the per-call time of a
CUDA graph of 50 calls. Then the same for the shipped drafter's attention (`drafter_attn`: 4 query /
2 kv heads x 64, a block of 16 rows; the sliding layer's 511-slot ring, the full layer's context
in a static view of twice its length, the rest at position -1; measured 2 x 9.7 us a step at
~1k, then planned as 2-8 splits by MIN_SPLIT_TILES = 4, now 1). Prints tables (us per call, the best count
marked) and writes DIR/tune-small-splits-<date>.json.

    PYTHONPATH=src python3 benchmarks/tune_small_splits.py --out $OUT        (CUDA, ~40 s)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from benchutil import graph_us, write_rows  # noqa: E402  (this folder)

HEADS, V, D, PAGE = 4, 64, 96, 64
CONTEXTS = (256, 512, 1024, 2048, 4096, 8192)
NODES = (1, 16, 32)
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_small_splits needs a CUDA device", file=sys.stderr)
        return 2
    from treeflash.engine.graphs import page_bucket
    from treeflash.kernels.mla_verify import (
        dispatch,
        gpu_kind,
        mla_verify_attention_triton,
        num_sms,
        plan_splits,
        split_plan,
    )

    dev = torch.device("cuda")
    sms = num_sms(0)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out, bad = [], 0
    print(f"{'ctx':>5} {'N':>3} {'pages':>5} {'plan':>5} | " + " ".join(f"{s:>6}" for s in SPLITS))
    for ctx in (int(c) for c in args.contexts.split(",")):
        for n in NODES:
            pages = page_bucket(-(-(ctx + n) // PAGE))
            kv = torch.randn(pages, PAGE, D, device=dev, generator=gen).to(torch.bfloat16)
            table = torch.arange(pages, device=dev, dtype=torch.int32)[None]
            prefix = torch.tensor([ctx], device=dev, dtype=torch.int32)
            q = torch.randn(1, n, HEADS, D, device=dev, generator=gen).to(torch.bfloat16)
            mask = torch.tril(torch.ones(n, n, dtype=torch.bool, device=dev))[None] if n > 1 else None
            cfg = dispatch(n * HEADS, torch.bfloat16, gpu_kind(dev), PAGE, n, (D, V))
            cap = pages * PAGE
            plan = split_plan(cfg, 1, n * HEADS, cap, sms, None, V, D)[0]

            def call(s=None, args=(q, kv, table, prefix, mask)):  # this shape's tensors, bound
                return mla_verify_attention_triton(*args, 0.1, v_dim=V, num_splits=s)

            # a count the chunk rounding turns into another one is timed under that one
            allowed = [s for s in SPLITS if plan_splits(1, n * HEADS, cap, cfg, sms, s)[0] == s]
            times, best, cells, wrong = time_counts(lambda s=None: call(s)[0], allowed, f"ctx {ctx} N {n}")
            bad += wrong
            print(f"{ctx:>5} {n:>3} {pages:>5} {plan:>2}:{times['plan']:5.2f} | {cells}")
            rows_out.append({"context": ctx, "nodes": n, "heads": HEADS, "pages": pages, "kernel_version": cfg.version,
                             "block_m": cfg.block_m, "block_n": cfg.block_n, "plan_splits": plan,
                             "us": {str(k): v for k, v in times.items()}, "best_splits": best})
    bad += drafter_sweep(rows_out, [int(c) for c in args.contexts.split(",")])
    write_rows(args.out, "tune-small-splits", rows_out, geometry={"heads": HEADS, "d": D, "v_dim": V, "page": PAGE},
               method="CUDA graph of 50 calls, median of 7 replays, us per call")
    return 1 if bad else 0


def time_counts(call, allowed: list[int], label: str):
    """call(s) -> output with s splits (None: the plan). Each allowed count checked against one
    split (bf16 tolerance) and timed; the plan timed too. (times, best count, table cells,
    mismatches)."""
    ref = call(1).float()
    times, wrong = {"plan": graph_us(lambda: call())}, 0
    for s in allowed:
        err = (call(s).float() - ref).abs().max().item()
        if err > 2e-2:
            wrong += 1
            print(f"MISMATCH {label} splits {s}: max err {err:.3g}")
        times[s] = graph_us(lambda s=s: call(s))
    best = min((k for k in times if k != "plan"), key=lambda k: times[k])
    cells = " ".join((f"{times[s]:5.2f}" + ("*" if s == best else " ")) if s in times else "     -" for s in SPLITS)
    return times, best, cells, wrong


def drafter_sweep(rows_out: list, contexts: list[int]) -> int:
    from treeflash.kernels import drafter_attn as da

    dev, hq, hkv, d, nq, window = torch.device("cuda"), 4, 2, 64, 16, 512
    gen = torch.Generator(device=dev).manual_seed(1)
    bad = 0
    print(f"drafter attention (Hq {hq}, Hkv {hkv}, D {d}, Q {nq}); us per call")
    print(f"{'layer':>7} {'ctx':>5} {'slots':>5} {'plan':>5} | " + " ".join(f"{s:>6}" for s in SPLITS))
    for ctx in contexts:
        for kind in ("sliding", "full"):
            slots = window - 1 if kind == "sliding" else 2 * ctx
            valid = min(slots, ctx)
            rnd = lambda *shape: torch.randn(*shape, device=dev, generator=gen).to(torch.bfloat16)
            q, bk, bv = rnd(1, hq, nq, d), rnd(1, hkv, nq, d), rnd(1, hkv, nq, d)
            ck, cv = rnd(1, hkv, slots, d), rnd(1, hkv, slots, d)
            pos = torch.full((1, slots), -1, dtype=torch.int64, device=dev)
            pos[0, :valid] = torch.arange(ctx - valid, ctx, device=dev)
            qpos = torch.arange(ctx, ctx + nq, device=dev)[None]
            win = window if kind == "sliding" else None

            def call(s=None, args=(q, ck, cv, bk, bv, pos, qpos, False, win)):  # this shape's, bound
                return da.drafter_attention_triton(*args, 0.125, num_splits=s)

            plan = da.launch_plan(q, ck)[2]
            allowed = [s for s in SPLITS if da.launch_plan(q, ck, num_splits=s)[2] == s]
            times, best, cells, wrong = time_counts(call, allowed, f"drafter {kind} ctx {ctx}")
            bad += wrong
            print(f"{kind:>7} {ctx:>5} {slots:>5} {plan:>2}:{times['plan']:5.2f} | {cells}")
            rows_out.append({"drafter": kind, "context": ctx, "slots": slots, "plan_splits": plan,
                             "us": {str(k): v for k, v in times.items()}, "best_splits": best})
    return bad


if __name__ == "__main__":
    sys.exit(main())
