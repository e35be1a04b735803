"""Issue 7's end-to-end pieces on one GPU, in one call, each next to its floor; JSON out.

    python benchmarks/bench_e2e.py --device cuda --out benchmarks/results/e2e-<stamp>.json
    python benchmarks/bench_e2e.py --device cpu --preset tiny --quick      # smoke test

1. moe:   grouped expert GEMM (Triton) vs the per-expert loop it replaced (a host sync per
          layer) vs the torch twin, at the preset's expert geometry for 1..257 rows; checked
          against the twin first. Floor = touched experts' bytes / bandwidth.
2. syncs: spec steps with the real (random) drafter under torch.cuda.set_sync_debug_mode
          ("warn"): synchronising calls per step (target: 1, the packed copy at the end).
3. step:  the preset at each context (random-filled KV), ddtree with declared acceptance,
          budgets 8..128 and auto, CUDA graphs off and on: median ms/step, tokens/step,
          tok/s, the step floor (bench/floors.py).
benchmarks/DESIGN_NOTES.md sections 3 and 5 read its figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from treeflash import kernels  # noqa: E402
from treeflash.bench import floors  # noqa: E402
from treeflash.bench.presets import DeclaredDrafter, build_preset, load_rig  # noqa: E402
from treeflash.bench.sweep import RunConfig, decode_run, git_commit, place_request, sync  # noqa: E402
from treeflash.kernels.testing import assert_close  # noqa: E402


def timed(fn, device, reps: int) -> float:
    """Median seconds of fn() (CUDA events on the GPU)."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def loop_moe(x, w, ids, wg, wu, wd):
    """MoE.forward before this change: nonzero().tolist() (a host sync), then per expert."""
    out = torch.zeros_like(x)
    counts = torch.bincount(ids.reshape(-1), minlength=wg.shape[0])
    for e in torch.nonzero(counts).flatten().tolist():
        tok, slot = torch.where(ids == e)
        h = x[tok]
        h = F.silu(h @ wg[e].T) * (h @ wu[e].T)
        out.index_add_(0, tok, (h @ wd[e].T) * w[tok, slot, None].to(h.dtype))
    return out


def bench_moe(model, device, dtype, rows_list, reps, bandwidth) -> list[dict]:
    moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts_gate"))
    wg, wu, wd = moe.experts_gate, moe.experts_up, moe.experts_down
    e, inter, hid = wg.shape
    k = moe.gate.cfg.num_experts_per_tok
    per_expert = 3 * inter * hid * wg.element_size()
    out = []
    for t in rows_list:
        x = torch.randn(t, hid, device=device, dtype=dtype)
        weights, ids = moe.gate(x)
        touched = int((torch.bincount(ids.reshape(-1), minlength=e) > 0).sum())
        ref = kernels.moe_experts(x, weights, ids, wg, wu, wd, impl="torch")
        row = {"rows": t, "pairs": t * k, "touched_experts": touched,
               "touched_mb": touched * per_expert / 1e6, "floor_us": 1e6 * touched * per_expert / bandwidth}
        args = (x, weights, ids, wg, wu, wd)
        for name, fn in [("grouped", partial(kernels.moe_experts, *args, impl="triton")),
                         ("loop", partial(loop_moe, *args)),
                         ("torch_twin", partial(kernels.moe_experts, *args, impl="torch"))]:
            if name == "torch_twin" and t * k > e and device.type == "cuda" and e > 64:
                continue  # the twin's dense branch runs every expert: not a contender
            if name == "grouped":
                assert_close(fn(), ref, dtype, f"moe grouped rows={t}")
            s = timed(fn, device, reps)
            row[f"{name}_us"] = 1e6 * s
            row[f"{name}_x_floor"] = 1e6 * s / row["floor_us"]
        out.append(row)
        print(f"moe rows={t:4d} touched={touched:3d} floor={row['floor_us']:8.1f}us "
              + " ".join(f"{n}={row.get(n + '_us', float('nan')):8.1f}us" for n in ("grouped", "loop", "torch_twin")))
    return out


def count_syncs(rig, context: int, steps: int) -> dict:
    """Synchronising calls per spec step with the preset's own (random) drafter."""
    if rig.device.type != "cuda":
        return {"skipped": "needs CUDA (torch.cuda.set_sync_debug_mode)"}
    rc = RunConfig([context], ["ddtree"], max_tokens=steps * 2 + 2, acceptance="drafter")
    engine = rig.engine("ddtree", context + rc.max_tokens + 64)
    req = place_request(engine, rig, context, rc.max_tokens, "random", 0, progress=False)
    engine.step()  # warm-up (Triton compiles)
    per_step = []
    for _ in range(steps):
        if req.finished:
            break
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        per_step.append([str(w.message).splitlines()[0] for w in caught])
    return {"syncs_per_step": [len(s) for s in per_step], "first_step_messages": per_step[:1]}


def bench_steps(rig, contexts, budgets, graphs_modes, tokens, accept, on_row=lambda rows: None,
                warmup: int = 0) -> list[dict]:
    ceilings = floors.default_ceilings(rig.device, rig.dtype)
    rows = []
    for context in contexts:
        ref = decode_run(rig, context, "off", RunConfig([context], ["off"], max_tokens=tokens + 20,
                                                          progress=False)).token_ids
        for graphs in graphs_modes:
            for budget in budgets:
                rig.tree_budget = budget
                drafter = DeclaredDrafter(rig.drafter, ref, context, accept)
                engine = rig.engine("ddtree", context + tokens + 200, drafter=drafter)
                if graphs:
                    gmode = "cuda" if rig.device.type == "cuda" else "eager"
                    engine.executor.enable_graphs(gmode, max_rows=engine.verify_width, max_batch=1)
                    if graphs == "all":  # the draft half too (speculative/draft_graphs.py)
                        engine.spec.enable_graphs(gmode)
                if warmup:  # a served engine has captured its graphs (and trained auto) already
                    # auto: every candidate compiled and captured first, as LLM.warmup does for
                    # `serve` (without it, auto's probes of unseen budgets compiled inside the
                    # timing: H200, 2026-12-03, 57 tok/s at 1k against 5212 pinned at 16)
                    spec = engine.spec
                    for forced in (spec.candidates if spec.auto else ()):
                        spec.forced_budget = forced
                        w = place_request(engine, rig, context, min(warmup, 32), "random", 0, progress=False)
                        while not w.finished:
                            engine.step()
                    spec.forced_budget = None
                    w = place_request(engine, rig, context, warmup, "random", 0, progress=False)
                    while not w.finished:
                        engine.step()
                req = place_request(engine, rig, context, tokens, "random", 0, progress=False)
                times, toks = [], []
                while not req.finished:
                    before = len(req.output_ids)
                    sync(rig.device)
                    t0 = time.perf_counter()
                    engine.step()
                    sync(rig.device)
                    times.append(time.perf_counter() - t0)
                    toks.append(len(req.output_ids) - before)
                steady = slice(3, None) if len(times) > 6 else slice(None)
                ms = 1e3 * statistics.median(times[steady])
                tps = sum(toks[steady]) / sum(times[steady])
                m = req.metrics.get("speculative_decoding", {})
                nodes = m.get("num_draft_tokens", 0) / max(1, m.get("num_spec_steps", 1))
                fl = floors.step_floor(rig.model, rig.drafter, ceilings, context, int(round(nodes)) + 1,
                                       (m.get("mean_acceptance_length") or 1) - 1, None)
                got = req.output_ids
                same = sum(a == b for a, b in zip(got, ref)) / max(1, len(got))
                row = {"context": context, "budget": budget, "graphs": graphs, "ms_per_step": ms,
                       "tokens_equal_off_run": same,  # bf16 near-ties may flip a token: < 1 is a flag
                       "tok_s": tps, "mean_acceptance_length": m.get("mean_acceptance_length"),
                       "overlap": bool(getattr(engine.spec, "overlap", False)),
                       "nodes_per_step": nodes, "floor_ms_built": 1e3 * fl["step_s"],
                       "x_floor_built": ms / (1e3 * fl["step_s"])}
                row["step_ms_all"] = [round(1e3 * t, 3) for t in times]  # capture steps included
                row["tokens_per_step_all"] = toks
                g = engine.executor.graphs
                if g is not None:
                    row["graph_keys"] = [str(k) for k in g.steps]
                dg = getattr(engine.spec, "draft_graphs", None)
                if dg is not None:
                    row["draft_graph_captures"], row["draft_graph_failure"] = dg.captures, dg.failure
                ctrl = engine.spec.controller
                if ctrl is not None:
                    row["auto"] = {"history": ctrl.history, "choice": ctrl.choice}
                rows.append(row)
                on_row(rows)
                print(f"step ctx={context:7d} budget={budget!s:>4} graphs={graphs!s:5} {ms:8.2f} ms/step "
                      f"{tps:8.1f} tok/s accept={row['mean_acceptance_length']} x_floor={row['x_floor_built']:.2f}")
                engine.executor.graphs and engine.executor.graphs.release()
                rig.tree_budget = None
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="kimi-k2-tp8")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--contexts", default="1024,8192,32768,131072,262144")
    p.add_argument("--budgets", default="8,16,32,64,128,auto")
    p.add_argument("--accept", type=int, default=None, help="declared accepted depths (default: all)")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--warmup", type=int, default=0,
                   help="tokens of a first request through the same engine before the timed one "
                        "(graph captures and the auto budget's probes out of the timing)")
    p.add_argument("--parts", default="moe,syncs,step")
    p.add_argument("--graphs", default="off,on",
                   help="CUDA graph modes to time, comma list: off, target (verify forward only), "
                        "on (verify forward + drafter proposal and tree build)")
    p.add_argument("--quick", action="store_true", help="two contexts, two budgets, few reps")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    parts = set(args.parts.split(","))
    contexts = [int(c) for c in args.contexts.split(",")]
    budgets = [b if b == "auto" else int(b) for b in args.budgets.split(",")]
    if args.quick:
        contexts, budgets = contexts[:2], budgets[:1] + budgets[-1:]
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "device": floors.device_name(device), "preset": args.preset,
              "dtype": args.dtype, "torch": torch.__version__,
              "command": "python benchmarks/bench_e2e.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"benchmarks/results/e2e-{args.preset}-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(*_):  # after every part and row: a run cut short keeps what it measured
        out.write_text(json.dumps(result, indent=1, default=str))

    ceilings = floors.default_ceilings(device, dtype)
    result["ceilings"] = ceilings.to_dict()
    with torch.inference_mode():
        if "moe" in parts:
            model, _, _ = build_preset(args.preset, device, dtype)
            rows = [1, 9, 17, 33, 65, 129, 257] if not args.quick else [1, 17]
            result["moe"] = bench_moe(model, device, dtype, rows, 5 if args.quick else 30, ceilings.bandwidth)
            save()
            del model
        rig = load_rig(None, None, args.preset, device, dtype) if parts & {"syncs", "step"} else None
        if "syncs" in parts:
            result["syncs"] = count_syncs(rig, contexts[0], 4)
            save()
            print("syncs:", result["syncs"])
        if "step" in parts:
            modes = [{"off": False, "on": "all", "target": "target"}[m] for m in args.graphs.split(",")]
            result["step"] = []
            result["step"] = bench_steps(rig, contexts, budgets, modes, args.tokens, args.accept,
                                         on_row=lambda rows: (result.__setitem__("step", rows), save()),
                                         warmup=args.warmup)
    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
