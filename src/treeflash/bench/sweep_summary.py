"""One `bench sweep` run's figures: the samples of its decode steps (`StepSample`) summarised
(median step, tokens per step, acceptance, MoE load, the host's share) beside the step's floor,
each part of an instrumented step scaled to the layer count reported (a preset's real model),
and the slope of a step against context."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from treeflash import costs as floors  # the floor model (costs/), under the name the sweep reports it by
from treeflash.bench import compare
from treeflash.bench.presets import Rig

WARMUP_STEPS = 2  # a run's first steps, which the figures leave out


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


def expert_format(model) -> str:
    """How the routed experts are stored: "int4" (W4A16, packed), "bf16" (the dtype's short name),
    "dense" for a model without routed experts; "+"-joined if its layers differ."""
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    fmts = dict.fromkeys(short.get(f, f) for layer in model.model.layers
                         if (f := getattr(layer.mlp, "expert_format", None)) is not None)
    return "+".join(fmts) or "dense"


def layer_plan_scale(rig: Rig, plan) -> float:
    """Layers reported / layers built (1.0 unless a preset is extrapolated)."""
    return plan.total / floors.LayerPlan.of(rig.model).total


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
