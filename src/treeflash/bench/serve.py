"""`treeflash bench serve`: throughput at 1, 8, 32, 64 concurrent requests with speculation off, at
fixed node budgets and auto, driving the engine's batch loop as the server's engine thread does
(admit, prefill, one step for the whole running batch, repeat).

Per (budget, concurrency): one engine per budget, kept across concurrencies (its CUDA graphs and,
under auto, its sizing warm as a serving engine's are), warmed first at every batch size the round
may pass through (every plan at every batch bucket, as `LLM.warmup` does: `_warm`), then the timed
round: `concurrency` greedy requests admitted together, each `max_tokens` long; the graphs it still
captured are counted (`captures`: 0 when the warm-up covered it). Reports generated tokens / wall
second (prefill included), decode tok/s (after every request's first token), steps, auto's steps by
budget and plain, the warm-up's seconds and the captures' (count and seconds), and whether each
request's tokens equal spec off's: in bf16 a near-tie may flip, so each differing request's equal
tokens before its first difference are kept, beside spec off against itself at another batch (the
dtype's noise floor; benchmarks/notes/serve-batch.md). Table + JSON (device, date, commit).
"""

from __future__ import annotations

import datetime
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from treeflash import costs, knobs
from treeflash.bench.presets import Rig
from treeflash.graph_capture import capture_seconds, graph_captures
from treeflash.sampling import SamplingParams


@dataclass
class ServeConfig:
    concurrency: list[int]
    budgets: list  # "off", ints, "auto"
    max_tokens: int = 64
    prompt_len: int = 128
    progress: bool = True


def prompts(rig: Rig, n: int, length: int) -> list[list[int]]:
    """n distinct prompts of `length` tokens: the shipped held-out texts where the rig has the
    shipped tokenizer and they are long enough, else seeded random ids."""
    out: list[list[int]] = []
    if rig.tokenizer is not None:
        from treeflash.engine.llm import EMBEDDED

        texts = [p["text"] for p in json.loads((EMBEDDED / "heldout_prompts.json").read_text())["prompts"]]
        ids = [rig.tokenizer.encode(t) for t in texts]
        ids = [x for x in ids if max(x, default=-1) < rig.cfg.vocab_size and len(x) >= length]
        for i in range(n if ids else 0):  # distinct windows of the texts
            src = ids[i % len(ids)]
            start = (i // len(ids)) * 7 % max(1, len(src) - length + 1)
            out.append(src[start:start + length])
    g = torch.Generator().manual_seed(0)
    while len(out) < n:
        out.append(torch.randint(2, max(3, rig.cfg.vocab_size - 2), (length,), generator=g).tolist())
    return out


def _engine(rig: Rig, budget, cfg: ServeConfig):
    mode = "off" if budget == "off" else "ddtree"
    kv = cfg.prompt_len + cfg.max_tokens + 2 * (rig.drafter.block_size if rig.drafter is not None else 1)
    return rig.engine(mode, kv, max_running=max(cfg.concurrency), budget=None if budget == "off" else budget)


def _round(engine, batch: list[list[int]], max_tokens: int) -> dict:
    """Admit every prompt at once, step until all finish; the requests and the timings."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in batch]
    dev = engine.device
    _sync(dev)
    t0 = time.perf_counter()
    first, steps = None, 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if first is None and all(r.output_ids for r in reqs):
            _sync(dev)
            first = time.perf_counter()
    _sync(dev)
    t1 = time.perf_counter()
    return {"reqs": reqs, "wall_s": t1 - t0, "decode_s": t1 - (first or t0), "steps": steps}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm(engine, batch: list[list[int]], cfg: ServeConfig, warmed: set[int]) -> None:
    """Before a configuration is timed: every plan its decoder may run (auto: each bucket, built
    as itself and wide, and plainly; a pinned budget and spec off: their own) at every batch
    bucket up to this concurrency that this engine has not run yet, over requests of the served
    prompt length and max tokens (engine/warmup.py: kernels compiled, graphs captured, auto's
    steps priced, its calibration taught nothing). Every configuration, the first included: the
    first GPU run (results/h100-20261207-spec-cost) timed off x1 with the process's warm-up in
    it, 275 tok/s against budget 31's 5019."""
    from treeflash.engine.warmup import warm, warm_buckets

    buckets = [b for b in warm_buckets(len(batch)) if b not in warmed]
    if buckets:
        warm(engine, batch, cfg.max_tokens, buckets)
        warmed.update(buckets)


def serve_bench(rig: Rig, cfg: ServeConfig, log=print) -> dict:
    """Every (budget, concurrency) round; off first (the other budgets' tokens are checked against it)."""
    budgets = ["off", *[b for b in cfg.budgets if b != "off"]]
    batches = {c: prompts(rig, c, cfg.prompt_len) for c in cfg.concurrency}
    reference: dict[int, list[list[int]]] = {}
    first_off: dict[tuple[int, ...], tuple[int, list[int]]] = {}  # prompt -> (concurrency, spec off's tokens)
    rows = []
    for budget in budgets:
        engine, warmed = _engine(rig, budget, cfg), set()
        for c in cfg.concurrency:
            t_warm = time.perf_counter()
            _warm(engine, batches[c], cfg, warmed)
            warm_s = time.perf_counter() - t_warm
            captured, capture_s = graph_captures(), capture_seconds()
            out = _round(engine, batches[c], cfg.max_tokens)
            row = _row(budget, c, out, reference)
            row["captures"] = graph_captures() - captured  # graphs the timed round captured (0 when warm)
            row["capture_s"] = capture_seconds() - capture_s  # host seconds those captures took
            row["warm_s"] = warm_s
            if budget == "off":  # spec off against itself at another batch: the dtype's own noise floor
                row["off_vs_other_batch"] = _self_agreement(batches[c], out["reqs"], first_off)
            if budget in cfg.budgets:
                rows.append(row)
                log(_line(row, rig.dtype))
        del engine
    return {"meta": _meta(rig), "model": rig.source, "preset": rig.preset.name if rig.preset else None,
            "max_tokens": cfg.max_tokens, "prompt_len": cfg.prompt_len, "cuda_graphs": rig.cuda_graphs,
            "rows": rows}


def _line(row: dict, dtype: torch.dtype) -> str:
    """A round's progress line: throughput, steps, the warm-up's and the captures' seconds and, where
    tokens differ from spec off, how many requests and how far they agreed first."""
    c = row["concurrency"]
    line = (f"  {str(row['budget']):>5} x{c:<3}: {row['tok_s']:.1f} tok/s ({row['decode_tok_s']:.1f} decode), "
            f"{row['steps']} steps, warm-up {row['warm_s']:.1f} s")
    noise = row.get("off_vs_other_batch")
    if noise and noise["compared"]:
        line += f", {noise['same']}/{noise['compared']} requests' tokens equal spec off's at a smaller batch"
    if row["captures"]:
        line += f", {row['captures']} graph(s) captured in the timed round ({row['capture_s']:.3f} s)"
    if not row["lossless"]:
        agreed = row["agreed_before_divergence"]
        line += (f", {c - row['same_as_off']}/{c} requests' tokens differ from spec off "
                 f"({str(dtype).replace('torch.', '')}; first difference after {min(agreed)}-{max(agreed)} "
                 f"equal tokens of {row['generated'] // c})")
    return line


def _self_agreement(batch: list[list[int]], reqs, seen: dict) -> dict:
    """Spec off's tokens for the prompts it already ran at a smaller concurrency, against those
    (the first prompts of every round are the same: `prompts`): in float32 equal; in bf16 a
    batch of another size runs other GEMM and attention shapes, and a near-tie may flip. The
    noise floor for "differ from spec off"."""
    compared, same, agreed = 0, 0, []
    for prompt, req in zip(batch, reqs, strict=True):
        key, tokens = tuple(prompt), list(req.output_ids)
        if key not in seen:
            seen[key] = (len(batch), tokens)
            continue
        compared += 1
        d = first_divergence(tokens, seen[key][1])
        same += d is None
        if d is not None:
            agreed.append(d)
    return {"compared": compared, "same": same, "agreed_before_divergence": agreed}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where a and b differ (a length difference counts), None if equal."""
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return None if i == len(a) == len(b) else i


def _row(budget, c: int, out: dict, reference: dict) -> dict:
    reqs = out["reqs"]
    tokens = [list(r.output_ids) for r in reqs]
    if budget == "off":
        reference[c] = tokens
    generated = sum(len(t) for t in tokens)
    spec = [r.metrics.get("speculative_decoding") for r in reqs]
    by: dict[str, int] = {}
    for s in spec:
        for b, n in ((s or {}).get("steps_by_budget") or {}).items():
            by[b] = by.get(b, 0) + n
    return {"budget": budget, "concurrency": c, "generated": generated, "wall_s": out["wall_s"],
            "tok_s": generated / out["wall_s"], "decode_tok_s": (generated - c) / max(out["decode_s"], 1e-9),
            "steps": out["steps"], "lossless": tokens == reference.get(c),
            # requests whose tokens equal spec off's (in 16-bit a different kernel shape may flip a
            # near-tie: the lossless proof is float32, tests/engine)
            "same_as_off": sum(a == b for a, b in zip(tokens, reference.get(c) or [], strict=False)),
            # per request that differs: the tokens it shared with spec off before the first difference
            "agreed_before_divergence": [d for a, b in zip(tokens, reference.get(c) or [], strict=False)
                                         if (d := first_divergence(a, b)) is not None],
            "spec_steps_by_budget": by, "plain_steps": sum((s or {}).get("num_plain_steps", 0) for s in spec),
            "mean_acceptance_length": _mean([s["mean_acceptance_length"] for s in spec
                                             if s and s.get("mean_acceptance_length")])}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _meta(rig: Rig) -> dict:
    from treeflash.bench.sweep import git_commit

    return {"device": costs.device_name(rig.device), "device_type": rig.device.type,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "torch": torch.__version__, "python": platform.python_version(),
            "dtype": str(rig.dtype).replace("torch.", ""),
            "switches": {**knobs.switched(), **rig.model.options.changed()}}  # env switches, --runtime-option


def table(result: dict) -> str:
    """tok/s per concurrency (rows) and budget (columns), auto against the best of the others."""
    rows = result["rows"]
    budgets = list(dict.fromkeys(r["budget"] for r in rows))
    by = {(r["budget"], r["concurrency"]): r for r in rows}
    head = ["concurrency", *(f"{b} tok/s" for b in budgets)]
    if "auto" in budgets and len(budgets) > 1:
        head += ["auto/best other", "auto's steps (budget: steps, plain)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for c in dict.fromkeys(r["concurrency"] for r in rows):
        cells = [str(c)]
        for b in budgets:
            r = by.get((b, c))
            cells.append("-" if r is None else f"{r['tok_s']:.1f}" + (
                "" if r["lossless"] else f" ({c - r['same_as_off']}/{c} differ from off)"))
        auto = by.get(("auto", c))
        others = [by[(b, c)]["tok_s"] for b in budgets if b != "auto" and (b, c) in by]
        if auto is not None and others:
            by_budget = sorted(auto["spec_steps_by_budget"].items(), key=lambda x: int(x[0]))
            steps = " ".join(f"{b}:{n}" for b, n in by_budget)
            cells += [f"{auto['tok_s'] / max(others):.2f}x", f"{steps}, plain {auto['plain_steps']}"]
        lines.append("| " + " | ".join(cells) + " |")
    meta = result["meta"]
    lines.append(f"({result['model']}, {meta['device']}, {meta['dtype']}, commit {meta['commit'][:10]}, "
                 f"{meta['date']}; {result['max_tokens']} tokens a request, prompts of {result['prompt_len']}, "
                 f"greedy; tok/s = generated tokens / wall seconds, prefill included; graphs captured "
                 f"inside timed rounds: {sum(r.get('captures', 0) for r in rows)}; tokens compared with spec off "
                 f"in {meta['dtype']}{_noise_note(rows)})")
    return "\n".join(lines)


def _noise_note(rows: list[dict]) -> str:
    """What spec off's own tokens did across batch sizes (the dtype's noise floor), for the footer."""
    noise = [r["off_vs_other_batch"] for r in rows if r.get("off_vs_other_batch", {}).get("compared")]
    if not noise:
        return ""
    same, n = sum(x["same"] for x in noise), sum(x["compared"] for x in noise)
    return f"; spec off against itself at a smaller batch: {same}/{n} requests equal"


def write_json(result: dict, path: str | Path | None) -> Path:
    if path is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path("benchmarks/results") / f"serve-{result['preset'] or 'model'}-{stamp}.json"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return path
