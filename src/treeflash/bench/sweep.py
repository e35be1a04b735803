"""`treeflash bench sweep`: decode speed against context, every part of a step beside its floor.

For each context: bring one request to that context (a real chunked prefill, or for presets
random latents written straight into its KV pages), decode `max_tokens` tokens per spec
mode, and time the steps: median ms/step untouched, then a breakdown of further steps
(drafter, tree build, verify attention in situ, MLA projections, MoE/MLP, the rest of the
target and the LM head, walk/commit, drafter extend, host) with each part's floor from
`treeflash/costs/`. Preset runs extrapolate per-layer times to the real layer count and say so.
A run's steps made into figures: `sweep_summary.py`; a request brought to a context and the
timers of a step's parts: `sweep_steps.py`; the printed table and JSON: `sweep_table.py`.
"""

from __future__ import annotations

import contextlib
import datetime
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from treeflash import costs as floors  # the floor model (costs/), under the name the sweep reports it by
from treeflash import knobs
from treeflash.bench.presets import DeclaredDrafter, Rig
from treeflash.bench.sweep_steps import instrument, place_request, sync
from treeflash.bench.sweep_summary import (
    WARMUP_STEPS,
    StepSample,
    attach_part_floors,
    expert_format,
    slope,
    summarise,
)
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


# ---- one (context, mode) run --------------------------------------------------------------------
def _touched(model) -> tuple[float | None, list[list[int]]]:
    counts = [c.tolist() for c in model.moe_expert_counts()]
    if not counts:
        return None, []
    return sum(sum(1 for x in c if x) for c in counts) / len(counts), counts


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
    spec.step_clock = ReplayClock(graphs, plan.total / built.total)


@dataclass
class ReplayClock:
    """A step's seconds with its forwards' replays scaled by `scale` (the layer count's ratio):
    wall + (scale - 1) x the device time of the replays since start(), which the step calls
    (`speculative.host.StepClock`)."""

    graphs: object  # the engine's CUDA-graph runner (engine/graphs.py), time_replays on
    scale: float

    def start(self) -> None:
        self.graphs.mark_replays()

    def seconds(self, wall: float) -> float:
        return wall + (self.scale - 1) * self.graphs.replays_s()


def _planned_steps(rig: Rig, mode: str, tokens: int, acceptance: str) -> int:
    if mode == "off" or rig.drafter is None:
        return tokens - 1
    per = rig.drafter.block_size if acceptance in ("oracle",) else (
        int(acceptance) + 1 if acceptance.isdigit() else 2)
    return max(1, (tokens - 1) // per)


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
    made = sizer.decisions if sizer is not None else 0
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
    if sizer is not None:  # what auto did and why, plan by plan, and how it priced the buckets at the end
        from treeflash.speculative.budget import plans_text

        r["auto_plans"] = plans_text(list(sizer.trace)[-(sizer.decisions - made):] if sizer.decisions > made else [])
        r["auto_explain"] = sizer.explain([context + rc.max_tokens])
    return r


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
