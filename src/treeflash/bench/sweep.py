"""`treeflash bench sweep`: decode speed against context, every part of a step beside its floor.

For each context: bring one request to that context (a real chunked prefill, or for presets
random latents written straight into its KV pages), decode `max_tokens` tokens per spec
mode, and time the steps: median ms/step untouched, then a breakdown of further steps
(drafter, tree build, verify attention in situ, MLA projections, MoE/MLP, the rest of the
target and the LM head, walk/commit, drafter extend, host) with each part's floor from
`treeflash/costs.py`. Preset runs extrapolate per-layer times to the real layer count and say so.
"""

from __future__ import annotations

import contextlib
import datetime
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from treeflash import costs as floors  # the floor model (costs.py), under the name the sweep reports it by
from treeflash import knobs
from treeflash.bench import compare
from treeflash.bench.presets import DeclaredDrafter, Rig
from treeflash.bench.sweep_steps import instrument, place_request, sync
from treeflash.bench.sweep_table import (  # noqa: F401 - the sweep's printing, under its old names
    _host_spread,
    _one_line,
    side_by_side,
    table,
    write_json,
)
from treeflash.engine.request import Request
from treeflash.graph_capture import capture_seconds, graph_captures
from treeflash.parallel.stats import moe_load

DEFAULT_CONTEXTS = "1k,8k,32k,64k,128k,185k,256k"
WARMUP_STEPS = 2


# ---- one (context, mode) run --------------------------------------------------------------------
@dataclass
class StepSample:
    wall_s: float
    tokens: int
    nodes: int  # draft nodes verified (root excluded); 0 without speculation
    accepted: int
    touched_experts: float | None  # mean distinct routed experts per MoE layer
    expert_counts: list[list[int]] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)  # seconds per part (instrumented)
    graph_s: float | None = None  # device seconds of the target's CUDA-graph replay (graph mode)
    expert_max_over_mean: float | None = None  # worst MoE layer: tokens per expert, max/mean
    rank_max_over_mean: float | None = None  # worst MoE layer: pairs per expert-parallel rank
    # the step that finished the request: its wall also holds the request's teardown (its pages
    # freed: ~100 ms for 190k scattered pages of 1 on a 2-core host), so the figures leave it out
    finishing: bool = False
    captures: int = 0  # CUDA graphs the step captured (or, eager, would have: graph_capture.graph_captures)
    # a plain decode step's forward: "off" (spec off), "untapped" / "tapped" (the auto budget's)
    plain_forward: str | None = None
    hooked: bool = False  # its model's modules were timed one by one (instrumented, eager)


def _touched(model) -> tuple[float | None, list[list[int]]]:
    counts = [c.tolist() for c in model.moe_expert_counts()]
    if not counts:
        return None, []
    return sum(sum(1 for x in c if x) for c in counts) / len(counts), counts


def expert_format(model) -> str:
    """How the routed experts are stored: "int4" (W4A16, packed), "bf16" (the dtype's short name),
    "dense" for a model without routed experts; "+"-joined if its layers differ."""
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    fmts = dict.fromkeys(short.get(f, f) for layer in model.model.layers
                         if (f := getattr(layer.mlp, "expert_format", None)) is not None)
    return "+".join(fmts) or "dense"


def _cuda_graphs(engine):
    """The engine's CUDA-graph runner when it replays real graphs (None: eager)."""
    graphs = getattr(engine.executor, "graphs", None)
    return graphs if graphs is not None and getattr(graphs, "mode", None) == "cuda" else None


def run_steps(engine, req: Request, *, instrumented: bool) -> StepSample | None:
    """One engine step for `req`; None when it has finished."""
    if req.finished:
        return None
    spec, dev = engine.spec, engine.device
    metrics = req.spec_state.metrics if req.spec_state is not None else None  # kept past finish
    if spec is not None:
        spec.timer.enabled = instrumented
        spec.timer.seconds.clear()
    before = len(req.output_ids)
    trees = len(metrics.per_step_drafted) if metrics is not None else 0
    plain = dict(getattr(spec, "plain_forwards", {})) if spec is not None else None
    graphs = _cuda_graphs(engine)
    if graphs is not None:
        graphs.time_replays = True
        graphs.mark_replays()
    # Under CUDA graphs module hooks see nothing inside a replay (and must not sync inside a
    # capture): instrumented steps then time only the spec phases, the replay is timed apart.
    hooks = instrumented and graphs is None
    ctx = instrument(engine.model, dev) if hooks else contextlib.nullcontext()
    with ctx as clock:
        sync(dev)
        captured, keys = capture_seconds(), graph_captures()
        t0 = time.perf_counter()
        engine.step()
        sync(dev)
        # a step that captured CUDA graphs (the auto budget meets a bucket for the first time
        # mid-run) is timed without its capture, as the sizing times it (speculative/decoder.py)
        wall = time.perf_counter() - t0 - (capture_seconds() - captured)
    touched, counts = _touched(engine.model)
    sample = StepSample(wall, len(req.output_ids) - before, 0, 0, touched, counts, finishing=req.finished,
                        captures=graph_captures() - keys, hooked=hooks)
    sample.plain_forward = "off" if spec is None else next(
        (k for k, n in getattr(spec, "plain_forwards", {}).items() if n > plain.get(k, 0)), None)
    if counts:
        load = moe_load(engine.model)
        sample.expert_max_over_mean = max(lay["expert_max_over_mean"] for lay in load["layers"])
        sample.rank_max_over_mean = load["worst_rank_max_over_mean"]
    if graphs is not None:
        sample.graph_s = graphs.replays_s()
    if metrics is not None and len(metrics.per_step_drafted) > trees:  # (auto: else a plain step)
        sample.nodes, sample.accepted = metrics.per_step_drafted[-1], metrics.per_step_accepted[-1]
    if instrumented:
        sample.parts = {k: sum(v) for k, v in clock.collect().items()} if hooks else {}
        if spec is not None:
            for k in ("drafter", "tree_build", "walk_commit", "drafter_extend") + (("verify",) if not hooks else ()):
                sample.parts[k] = spec.timer.seconds.get(k, 0.0)
            spec.timer.enabled = False
    return sample


@dataclass
class RunConfig:
    contexts: list[int]
    modes: list[str]
    max_tokens: int = 128
    fill: str = "random"
    acceptance: str = "oracle"  # "oracle" | an int k | "drafter" (the real drafter's)
    seed: int = 0
    progress: bool = True
    # A budget table (bench/compare.py): ddtree at each of these node budgets (ints, "auto"), under
    # each of these acceptances; None: the rig's budget, `acceptance`. Modes are then labelled
    # ddtree-<budget>; no step is instrumented (every step timed as served).
    budgets: list | None = None
    acceptances: list[str] | None = None

    @property
    def table(self) -> bool:
        return self.budgets is not None or self.acceptances is not None

    @property
    def runs_per_context(self) -> int:
        """The runs `sweep` summarises at each context (off once, the others once an acceptance)."""
        spec = [r for r in _spec_runs(self) if r[0] != "off"]
        return ("off" in self.modes) + len(self.acceptances or [self.acceptance]) * len(spec)


@dataclass
class DecodeRun:
    samples: list[StepSample]
    token_ids: list[int]  # the request's output (first token from the prefill included)
    metrics: object | None  # its SpecMetrics (kept past the finish), None without speculation
    pages: list[int]  # its KV pages while it ran
    kv_page_rows: int = 0  # rows a page of the KV its steps read (64 at page 1 read coarse)
    spec: object | None = None  # the engine's SpecDecoder (its sizing, under the auto budget)
    sizing: object | None = None  # the request's own sizing state (auto)
    memory: dict | None = None  # CUDA: the run's peak allocated bytes and its KV pool's bytes


def decode_run(rig: Rig, context: int, mode: str, rc: RunConfig, drafter=None,
               tokens: int | None = None, budget=None, sizer=None, acceptance: str | None = None) -> DecodeRun:
    """Decode one request at `context` for `tokens` tokens (default rc.max_tokens). budget: the
    ddtree node budget (None: the rig's); sizer: the auto budget's `TreeSizer` to run with (one
    warm from earlier runs, as a serving engine's is)."""
    tokens = tokens or rc.max_tokens
    kv_tokens = context + tokens + 2 * (rig.drafter.block_size if rig.drafter is not None else 1)
    if rig.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rig.device)
    engine = rig.engine(mode, kv_tokens, drafter=drafter, budget=budget)
    if sizer is not None and engine.spec is not None:
        engine.spec.sizer = sizer
    _extrapolate_sizing(rig, engine)
    if budget == "auto" and engine.spec is not None:
        warm_plans(engine, rig, context, tokens, rc.seed)
    req = place_request(engine, rig, context, tokens, rc.fill, rc.seed, rc.progress)
    metrics = req.spec_state.metrics if req.spec_state is not None else None
    sizing = getattr(req.spec_state, "sizing", None)
    pages = list(req.pages)
    page_rows = engine.executor.paged([req.pages]).kv.shape[2]
    split = WARMUP_STEPS + max(1, _planned_steps(rig, mode, tokens, acceptance or rc.acceptance) // 2)
    if (_cuda_graphs(engine) is not None and mode == "off") or rc.table:
        split = 1 << 30  # no spec phases to time, and module timers see nothing in a replay
    samples = []
    while not req.finished:
        # plain steps first (the headline timing), then instrumented ones (the breakdown)
        s = run_steps(engine, req, instrumented=len(samples) >= split)
        if s is None:
            break
        samples.append(s)
    memory = None
    if rig.device.type == "cuda":  # graphs + workspace = peak - weights - this pool (weights: the result's)
        memory = {"peak_allocated_bytes": torch.cuda.max_memory_allocated(rig.device),
                  "kv_pool_bytes": engine.pool.kv.numel() * engine.pool.kv.element_size()}
    return DecodeRun(samples, list(req.output_ids), metrics, pages, page_rows, engine.spec, sizing, memory)


def warm_plans(engine, rig: Rig, context: int, tokens: int, seed: int) -> int:
    """Every plan the auto budget may run (`SpecDecoder.warmup_plans`), STEPS_PER_PLAN steps
    each, on throw-away requests at this context and max tokens (random fill: the same page
    table and drafter buffers as the timed request's), so that no graph is captured and no
    kernel compiled inside a timed step; the steps price each plan, the calibration learns
    nothing (the first GPU run, results/h100-20261207-spec-cost: the shipped pair's auto at
    0.09x the best fixed budget at 1k, its new plans' graphs met inside timed steps). Returns
    the steps run."""
    from treeflash.engine.warmup import STEPS_PER_PLAN, forced

    spec, req, steps = engine.spec, None, 0
    for plan in spec.warmup_plans:
        for _ in range(STEPS_PER_PLAN):
            if req is None or req.finished:
                req = place_request(engine, rig, context, tokens, "random", seed + 1, progress=False)
            with forced(spec, plan):
                engine.step()
            steps += 1
    if req is not None and not req.finished:
        engine.abort(req.request_id)
    return steps


def _extrapolate_sizing(rig: Rig, engine) -> None:
    """A preset keeps a few of the real model's layers and the sweep reports its steps
    extrapolated to all of them (the forward's replay scaled by the layer count); the auto
    budget then sizes trees for the real model too: each step it measures gets the same
    extrapolation (CUDA graphs; eager preset steps have no device time per forward)."""
    graphs, spec = _cuda_graphs(engine), engine.spec
    plan, built = layer_plan(rig), floors.LayerPlan.of(rig.model)
    if graphs is None or spec is None or not getattr(spec, "auto", False) or plan.total == built.total:
        return
    graphs.time_replays = True
    scale = plan.total / built.total
    spec.seconds_hook = lambda seconds: seconds + (scale - 1) * graphs.replays_s()


def _planned_steps(rig: Rig, mode: str, tokens: int, acceptance: str) -> int:
    if mode == "off" or rig.drafter is None:
        return tokens - 1
    per = rig.drafter.block_size if acceptance in ("oracle",) else (
        int(acceptance) + 1 if acceptance.isdigit() else 2)
    return max(1, (tokens - 1) // per)


# ---- summarising ---------------------------------------------------------------------------------
def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarise(rig: Rig, context: int, mode: str, samples: list[StepSample], ceilings, plan,
              declared: str | None) -> dict:
    """Figures of one (context, mode) run, with floors, per part, extrapolated if a preset."""
    timed = samples[WARMUP_STEPS:] or samples
    timed = [s for s in timed if not s.finishing] or timed  # not the request's teardown
    plain = [s for s in timed if not s.parts] or timed
    inst = [s for s in timed if s.parts]
    ms_step = 1e3 * statistics.median(s.wall_s for s in plain)
    tok_per_step = sum(s.tokens for s in timed) / len(timed)
    # tokens over seconds of the plain-timed steps: the figure for steps unlike each other (the
    # auto budget's trees of several sizes and plain steps), where a median step is no step;
    # extrapolated step by step (each step's own forward replays scaled by the layer count)
    tok_s_mean = sum(s.tokens for s in plain) / sum(s.wall_s for s in plain)
    scale_all = layer_plan_scale(rig, plan)
    tok_s_mean_full = sum(s.tokens for s in plain) / sum(
        s.wall_s + (scale_all - 1) * (s.graph_s or 0.0) for s in plain)
    nodes = statistics.mean(s.nodes for s in timed)
    accepted = statistics.mean(s.accepted for s in timed)
    touched = [s.touched_experts for s in timed if s.touched_experts is not None]
    touched_mean = statistics.mean(touched) if touched else None
    rows = int(round(nodes)) + 1
    drafter = getattr(rig.drafter, "inner", rig.drafter) if mode != "off" else None
    built = floors.LayerPlan.of(rig.model)
    row_bytes = rig.kv_format.row_bytes  # the cache's row (fp8_e4m3: 656 B at D 576)
    floor_built = floors.step_floor(rig.model, drafter, ceilings, context, rows, accepted, touched_mean, built,
                                    row_bytes)
    floor_full = floors.step_floor(rig.model, drafter, ceilings, context, rows, accepted, touched_mean, plan,
                                   row_bytes)
    parts, extra_ms, host_each = _timed_parts(plain, inst, built, plan)
    dcp = dcp_model_fields(rig, plan.total)
    ms_full = ms_step + extra_ms + (dcp["collectives_ms"] if dcp else 0.0)
    attn_floor_ms = 1e3 * floor_full["attention"]["s"]
    kv_bytes = floor_full["attention"]["bytes"]
    attn_ms = parts.get("attention_kernel", {}).get("ms")
    out = {
        "context": context, "mode": mode, "expert_format": expert_format(rig.model), "steps": len(timed),
        "captures_timed": sum(s.captures for s in timed),  # graphs met first inside timed steps (warm: 0)
        "ms_per_step_measured": ms_step, "ms_per_step": ms_full,
        "tokens_per_step": tok_per_step, "tok_s": tok_per_step / (ms_full / 1e3),
        "tok_s_measured": tok_per_step / (ms_step / 1e3),
        "tok_s_mean_measured": tok_s_mean, "tok_s_mean": tok_s_mean_full,
        "mean_acceptance_length": 1 + accepted if mode != "off" else 1.0,
        "declared_acceptance": declared,
        "nodes_verified": nodes, "rows_verified": rows,
        "touched_experts_per_moe_layer": touched_mean,
        # MoE load per step (median over steps of the worst layer): what makes a batch-1 step
        # wait on one expert (or, under --ep, one rank); 1.0 = balanced
        "moe_expert_max_over_mean": _median([s.expert_max_over_mean for s in timed
                                             if s.expert_max_over_mean is not None]),
        "moe_rank_max_over_mean": _median([s.rank_max_over_mean for s in timed
                                           if s.rank_max_over_mean is not None]),
        "floor_ms": 1e3 * floor_full["step_s"], "floor_ms_built": 1e3 * floor_built["step_s"],
        "x_floor": ms_full / (1e3 * floor_full["step_s"]),
        "floors": floor_full, "parts": parts,
        "attention_ms": attn_ms, "attention_floor_ms": attn_floor_ms,
        "kv_gbps": kv_bytes / (attn_ms / 1e3) / 1e9 if attn_ms else None,
        "floor_slope_ms_per_1k": floors.floor_slope_ms_per_1k(
            rig.model, drafter, ceilings, context, rows, accepted, touched_mean, plan, row_bytes),
        "kv_cache_dtype": rig.kv_format.label,
        "layers_measured": built.total, "layers_reported": plan.total,
        # every timed step, so that an outlier behind a median is visible: wall ms of the
        # plain steps, and of the instrumented ones with their untimed remainder (host ms)
        "step_wall_ms": [1e3 * s.wall_s for s in timed if not s.parts],
        "instrumented_wall_ms": [1e3 * s.wall_s for s in inst],
        "instrumented_host_ms": host_each,
        # plain decode steps by forward (spec off's; auto's untapped and tapped), measured and extrapolated
        "plain_step_ms": compare.plain_step_ms(timed, scale_all),
    }
    if dcp:
        per_layer = 1e3 / plan.total
        dcp["attention_us_per_layer"] = attn_ms * per_layer if attn_ms else None
        dcp["attention_floor_us_per_layer"] = attn_floor_ms * per_layer
        out["dcp"] = dcp
    return out


def dcp_model_fields(rig: Rig, layers: int) -> dict | None:
    """A preset modelling one rank of a DCP group (`bench sweep --dcp-model N`): its size, the declared
    collective latency a layer and what it adds to a step (in ms_per_step; not in the measured)."""
    us = rig.extra.get("dcp_collective_us")
    if rig.dcp == 1 or us is None:
        return None
    return {"size": rig.dcp, "modelled": True, "collective_us_per_layer": us, "collectives_ms": layers * us / 1e3,
            "note": "one rank of the group on this device: its 1/N share of the cache, N x its heads, the LSE "
                    "merge (measured); the all-gather + all-to-all a layer at the declared latency (added)"}


def _timed_parts(plain: list[StepSample], inst: list[StepSample], built, plan) -> tuple[dict, float, list[float]]:
    """(each part's ms measured and scaled to `plan`'s layers, the ms that scaling adds to a step,
    each instrumented step's host ms). Under CUDA graphs the target forward is one replay."""
    parts = _parts(inst, built, plan) if inst else {}
    extra_ms = parts.pop("_extrapolation_ms", 0.0)
    replays = [s.graph_s for s in plain if s.graph_s is not None]
    if replays:
        # CUDA graphs: the target forward is one replay, timed on the device. Every part of
        # it (embedding and lm_head too, so this errs slow) scales with the layer count;
        # the spec phases (synced host timers on the instrumented steps) do not.
        fwd = statistics.median(replays)
        scale = plan.total / built.total
        extra_ms = 1e3 * fwd * (scale - 1)
        parts = {"target_forward_graph": {"ms": 1e3 * fwd * scale, "ms_measured": 1e3 * fwd}}
        if inst:
            med = {k: statistics.median(s.parts.get(k, 0.0) for s in inst) for k in inst[0].parts}
            for k, v in med.items():  # "verify" holds the replay: scale that share of it
                full = v + (fwd * (scale - 1) if k == "verify" else 0.0)
                parts[k] = {"ms": 1e3 * full, "ms_measured": 1e3 * v}
            wall = statistics.median(s.wall_s for s in inst)
            parts["host_other"] = {"ms": 1e3 * max(0.0, wall - sum(med.values())),
                                   "ms_measured": 1e3 * max(0.0, wall - sum(med.values()))}
        host_each = [1e3 * max(0.0, s.wall_s - sum(s.parts.values())) for s in inst]
    else:
        host_each = [_parts([s], built, plan)["host_other"]["ms_measured"] for s in inst]
    return parts, extra_ms, host_each


def _parts(inst: list[StepSample], built, plan) -> dict:
    """Median seconds per part over the instrumented steps -> ms, scaled to `plan` layers."""
    keys = {k for s in inst for k in s.parts}
    med = {k: statistics.median(s.parts.get(k, 0.0) for s in inst) for k in keys}
    wall = statistics.median(s.wall_s for s in inst)
    moe_layers = built.total - built.dense
    scale = {
        "attention_kernel": plan.total / built.total,
        "mla_block": plan.total / built.total,
        "dense_mlp": plan.dense / built.dense if built.dense else 0.0,
        "moe": (plan.total - plan.dense) / moe_layers if moe_layers else 0.0,
        "all_reduce": plan.total / built.total,
    }
    attn, block = med.get("attention_kernel", 0.0), med.get("mla_block", 0.0)
    fwd = med.get("target_forward", 0.0)
    mlp = med.get("dense_mlp", 0.0) + med.get("moe", 0.0)
    out = {
        "drafter": med.get("drafter", 0.0), "tree_build": med.get("tree_build", 0.0),
        "attention_kernel": attn, "mla_projections": block - attn,
        "dense_mlp": med.get("dense_mlp", 0.0), "moe": med.get("moe", 0.0),
        "target_other": fwd - block - mlp - med.get("all_reduce", 0.0), "lm_head": med.get("lm_head", 0.0),
        "walk_commit": med.get("walk_commit", 0.0), "drafter_extend": med.get("drafter_extend", 0.0),
        "all_reduce": med.get("all_reduce", 0.0),
    }
    # host = what no timer saw; spec phases already contain the target forward (verify)
    seen = sum(v for k, v in out.items())
    out["host_other"] = max(0.0, wall - seen)
    full = dict(out)
    full["attention_kernel"] = attn * scale["attention_kernel"]
    full["mla_projections"] = (block - attn) * scale["mla_block"]
    full["dense_mlp"] = out["dense_mlp"] * scale["dense_mlp"]
    full["moe"] = out["moe"] * scale["moe"]
    full["all_reduce"] = out["all_reduce"] * scale["all_reduce"]
    extra = sum(full.values()) - sum(out.values())
    result = {k: {"ms": 1e3 * full[k], "ms_measured": 1e3 * out[k]} for k in out}
    result["_extrapolation_ms"] = 1e3 * extra
    return result


def attach_part_floors(r: dict) -> None:
    """Each part next to its floor: attention, target weights (projections + MLP/MoE + head), drafter."""
    f = r["floors"]
    p = r["parts"]
    if not p or "target_forward_graph" in p:  # graphs: one replay, no per-part split
        return
    groups = {
        "attention": ["attention_kernel"],
        "target_weights": ["mla_projections", "dense_mlp", "moe", "target_other", "lm_head"],
        "drafter": ["drafter", "drafter_extend"],
    }
    r["part_floors"] = {}
    for g, keys in groups.items():
        ms = sum(p[k]["ms"] for k in keys if k in p)
        fl = 1e3 * f[g]["s"]
        r["part_floors"][g] = {"ms": ms, "floor_ms": fl, "x_floor": ms / fl if fl else None}


def slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares ms per +1024 tokens of context."""
    if len(points) < 2:
        return None
    xs = [c / 1024 for c, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


# ---- the sweep ------------------------------------------------------------------------------
def sweep(rig: Rig, rc: RunConfig, ceilings, log=print, on_context=None) -> dict:
    """Every (context, mode, budget, acceptance) run of `rc`, summarised; `on_context` gets the
    result so far after each context (marked "partial"), so a sweep stopped midway keeps what it ran."""
    plan = layer_plan(rig)
    acceptances = rc.acceptances or [rc.acceptance]
    declared = {a: _declared(rig, a) for a in acceptances}
    sizers: dict = {}  # acceptance -> the auto runs' sizing, shared across contexts
    runs = []
    for done, context in enumerate(rc.contexts, 1):
        reference = None
        if any(declared.values()) and any(m != "off" for m in rc.modes):
            depth = rig.drafter.block_size
            run = decode_run(rig, context, "off", rc, tokens=rc.max_tokens + depth + 1)
            samples, reference = run.samples, run.token_ids
            if "off" in rc.modes:
                runs.append(summarise(rig, context, "off", samples, ceilings, plan, None))
                runs[-1].update(kv_page_rows=run.kv_page_rows, memory=run.memory)
        for acceptance in acceptances:
            for mode, budget in _spec_runs(rc):
                if mode == "off" and (reference is not None or acceptance != acceptances[0]):
                    continue
                runs.append(_one_run(rig, rc, ceilings, plan, context, mode, budget, acceptance,
                                     declared[acceptance], reference, sizers, len(acceptances) > 1))
        for r in runs:
            if r["context"] == context:
                attach_part_floors(r)
                log(_one_line(r))
        if on_context is not None and done < len(rc.contexts):
            on_context(_result(rig, rc, ceilings, plan, runs, _declared_text(declared, acceptances))
                       | {"partial": f"{done} of {len(rc.contexts)} contexts"})
    return _result(rig, rc, ceilings, plan, runs, _declared_text(declared, acceptances))


def _declared_text(declared: dict, acceptances: list[str]) -> str | None:
    if len(acceptances) == 1:
        return declared[acceptances[0]]
    return "; ".join(f"{a}: {d or 'the real drafter'}" for a, d in declared.items())


def _spec_runs(rc: RunConfig) -> list[tuple[str, object]]:
    """(mode, budget) of each run at a context: ddtree once per budget of a budget table."""
    out = []
    for mode in rc.modes:
        budgets = rc.budgets if mode == "ddtree" and rc.budgets else [None]
        out += [(mode, b) for b in budgets]
    return out


def _one_run(rig, rc, ceilings, plan, context, mode, budget, acceptance, declared, reference, sizers,
             several: bool) -> dict:
    """One (context, mode, budget, acceptance) run, summarised. Auto runs of one acceptance share
    their sizing across contexts, warmed first by one untimed request (a serving engine's
    sizing is warm from the requests before; each request's own state starts cold)."""
    drafter = None
    if mode != "off" and declared:
        accept = None if acceptance == "oracle" else int(acceptance)
        drafter = DeclaredDrafter(rig.drafter, reference, context, accept)
    sizer = None
    if budget == "auto":
        if acceptance not in sizers:
            warm = decode_run(rig, context, mode, rc, drafter=drafter, budget=budget,
                              tokens=max(16, rc.max_tokens // 2), acceptance=acceptance)
            sizers[acceptance] = warm.spec.sizer
        sizer = sizers[acceptance]
    run = decode_run(rig, context, mode, rc, drafter=drafter, budget=budget, sizer=sizer, acceptance=acceptance)
    r = summarise(rig, context, mode, run.samples, ceilings, plan, declared if mode != "off" else None)
    r.update(kv_page_rows=run.kv_page_rows, memory=run.memory)
    if rc.table:  # one label a (mode, budget, acceptance): ddtree-7, or ddtree-7@3 under several acceptances
        label = mode if mode != "ddtree" or budget is None else f"ddtree-{budget}"
        r["mode"] = label + (f"@{acceptance}" if several and mode != "off" else "")
        r["spec"], r["tree_budget"] = mode, budget
        r["acceptance"] = acceptance if mode != "off" else None
    if run.metrics is not None:
        r["steps_by_budget"] = run.metrics.steps_by_budget
        r["plain_steps"] = run.metrics.num_plain_steps
    return r


def layer_plan_scale(rig: Rig, plan) -> float:
    """Layers reported / layers built (1.0 unless a preset is extrapolated)."""
    return plan.total / floors.LayerPlan.of(rig.model).total


def layer_plan(rig: Rig):
    """The layers figures are reported for: a preset's real model (extrapolated), else the built one."""
    if rig.preset is None:
        return floors.LayerPlan.of(rig.model)
    return floors.LayerPlan(rig.preset.full_layers, rig.preset.full_dense_layers)


def _declared(rig: Rig, acceptance: str) -> str | None:
    """The acceptance source of spec runs: None = the real drafter's own proposals."""
    if acceptance == "drafter":
        if rig.preset is not None:
            raise ValueError("a preset's random drafter accepts nothing: use --acceptance oracle or K")
        return None
    if acceptance == "oracle":
        return "oracle: the target's own greedy continuation at every depth (full acceptance)"
    if not acceptance.isdigit():
        raise ValueError(f"--acceptance must be oracle, drafter or an integer, got {acceptance!r}")
    return f"fixed: the target's own tokens for {int(acceptance)} depths, then a wrong one"


def _result(rig, rc, ceilings, plan, runs, declared) -> dict:
    slopes = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        pts = [(r["context"], r["ms_per_step"]) for r in runs if r["mode"] == mode]
        fpts = [(r["context"], r["floor_ms"]) for r in runs if r["mode"] == mode]
        m, f = slope(pts), slope(fpts)
        slopes[mode] = {"ms_per_1k": m, "floor_ms_per_1k": f, "x_floor": m / f if m and f else None}
    return {
        "meta": _meta(rig),
        "model": rig.source, "preset": rig.preset.name if rig.preset else None,
        "preset_notes": rig.preset.notes if rig.preset else None,
        "extrapolated": plan.total != floors.LayerPlan.of(rig.model).total,
        "layers_measured": floors.LayerPlan.of(rig.model).total, "layers_reported": plan.total,
        "expert_format": expert_format(rig.model), "weights_bytes": _weight_bytes(rig),
        "drafter_block_size": getattr(rig.drafter, "block_size", None),
        "fill": rc.fill, "fill_note": FILL_NOTES[rc.fill],
        "acceptance": declared or "the real drafter's own proposals",
        "max_tokens": rc.max_tokens, "tree_budget": rc.budgets if rc.budgets else rig.tree_budget,
        "page_size": rig.page_size, "kv_cache_dtype": rig.kv_format.label, "scattered": rig.scattered,
        "cuda_graphs": rig.cuda_graphs,
        "tp": getattr(getattr(rig.model, "parallel", None), "tp_size", 1),
        "ep": getattr(getattr(rig.model, "parallel", None), "ep_size", 1),
        "dcp": rig.dcp, "dcp_modelled": rig.dist is None and rig.dcp > 1,
        "ceilings": ceilings.to_dict(), "floor_model": floors.FLOOR_MODEL,
        "runs": runs, "slopes": slopes,
    }


def _weight_bytes(rig: Rig) -> int:
    """Bytes of the built target and drafter (parameters and buffers, shared ones once)."""
    mods = [m for m in (rig.model, getattr(rig.drafter, "inner", rig.drafter)) if isinstance(m, torch.nn.Module)]
    tensors = {id(t): t for m in mods for t in (*m.parameters(), *m.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


FILL_NOTES = {
    "random": "context filled with unit-scale random latents written into the KV pages "
              "(no prefill); drafter context from random features",
    "prefill": "context reached by a real chunked prefill of random token ids",
}


def _meta(rig: Rig) -> dict:
    dev = rig.device
    return {
        "device": floors.device_name(dev), "device_type": dev.type,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "torch": torch.__version__, "python": platform.python_version(),
        "dtype": str(rig.dtype).replace("torch.", ""),
        "switches": {**knobs.switched(), **rig.model.options.changed()},  # env switches, --runtime-option
    }


def git_commit() -> str:
    """HEAD of this checkout; TREEFLASH_COMMIT wins (a device copy may carry a stale .git)."""
    if knobs.get("TREEFLASH_COMMIT"):
        return knobs.get("TREEFLASH_COMMIT")
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL, cwd=Path(__file__).parent).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
