"""`treeflash bench sweep`: decode speed against context, every part of a step beside its floor.

For each context: bring one request to that context (a real chunked prefill, or for presets
random latents written straight into its KV pages), decode `max_tokens` tokens per spec
mode, and time the steps: median ms/step untouched, then a breakdown of further steps
(drafter, tree build, verify attention in situ, MLA projections, MoE/MLP, the rest of the
target and the LM head, walk/commit, drafter extend, host) with each part's floor from
`floors.py`. Preset runs extrapolate per-layer times to the real layer count and say so.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

import treeflash.kernels as kernels
from treeflash import knobs
from treeflash.bench import floors
from treeflash.bench.presets import DeclaredDrafter, Rig
from treeflash.dist.stats import moe_load
from treeflash.engine.request import Request, Status
from treeflash.engine.sampling import SamplingParams
from treeflash.spec.decoder import SpecState

DEFAULT_CONTEXTS = "1k,8k,32k,64k,128k,185k,256k"
WARMUP_STEPS = 2


def parse_sizes(text: str) -> list[int]:
    """'1k,8k,185k' -> [1024, 8192, 189440] (k = 1024)."""
    out = []
    for tok in text.split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        value = int(float(tok[:-1]) * 1024) if tok.endswith("k") else int(tok)
        if value < 1:
            raise ValueError(f"context {tok!r} must be >= 1")
        out.append(value)
    if not out:
        raise ValueError("no contexts given")
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- bringing a request to a context -----------------------------------------------------
def place_request(engine, rig: Rig, context: int, max_tokens: int, fill: str, seed: int,
                  progress: bool = True) -> Request:
    """A running request with `context` tokens of committed KV and its first output token."""
    g = torch.Generator().manual_seed(seed)
    vocab = rig.cfg.vocab_size
    prompt = torch.randint(2, max(3, vocab - 2), (context,), generator=g).tolist()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = Request(f"bench-{context}", prompt, params, generator=torch.Generator(device=engine.device))
    engine.pool.grow(req.pages, engine.pool.pages_for(engine.kv_tokens_needed(context, max_tokens))
                     * engine.pool.page_size)
    if fill == "random":
        first = _fill_random(engine, req, context, seed)
    elif fill == "prefill":
        first = _prefill(engine, req, progress)
    else:
        raise ValueError(f"fill must be 'random' or 'prefill', got {fill!r}")
    req.output_ids.append(first)
    req.status = Status.RUNNING
    engine.running.append(req)
    return req


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(n, start + size)


def _fill_random(engine, req: Request, context: int, seed: int) -> int:
    """Unit-scale random latents in the request's pages; random features in the drafter."""
    pool, dev = engine.pool, engine.device
    g = torch.Generator(device=dev).manual_seed(seed)
    kv = pool.kv  # [layers, pages, page_size, D]
    pages = torch.tensor(req.pages[: pool.pages_for(context)], device=dev)
    step = max(1, (1 << 22) // (kv.shape[0] * kv.shape[2] * kv.shape[3]))
    fmt = pool.format
    for a, b in _chunks(len(pages), step):
        shape = (kv.shape[0], b - a, kv.shape[2], fmt.dim)
        kv[:, pages[a:b]] = fmt.encode(torch.randn(shape, generator=g, device=dev, dtype=torch.float32))
    req.num_cached = context
    first = int(torch.randint(2, max(3, engine.cfg.vocab_size - 2), (1,), generator=g, device=dev))
    if engine.spec is not None:
        drafter = engine.spec.drafter
        inner = getattr(drafter, "inner", drafter)
        cache = drafter.new_cache(req.prompt_ids)
        width = len(drafter.target_layer_ids) * engine.cfg.hidden_size
        dtype = getattr(getattr(inner, "fc", None), "weight", kv).dtype
        for a, b in _chunks(context, 4096):
            feats = torch.randn(b - a, width, generator=g, device=dev, dtype=torch.float32).to(dtype)
            drafter.extend(cache, feats, torch.arange(a, b, device=dev))
        req.spec_state = SpecState(cache, first, engine.spec.new_metrics())
    return first


def _prefill(engine, req: Request, progress: bool) -> int:
    """The real thing: chunked target prefill, drafter extended chunk by chunk, with a bar."""
    from tqdm import tqdm

    spec = engine.spec
    taps = spec.tap_layers if spec is not None else ()
    cache = spec.drafter.new_cache(req.prompt_ids) if spec is not None else None
    bar = tqdm(total=len(req.prompt_ids), unit="tok", desc=f"prefill {len(req.prompt_ids)}",
               disable=not progress, leave=False)
    last, done = None, 0
    for chunk_logits, tapped in engine.prefill_rows(req, req.prompt_ids, taps=taps):
        last = chunk_logits
        if cache is not None:
            n = tapped.shape[0]
            spec.drafter.extend(cache, tapped, torch.arange(req.num_cached - n, req.num_cached,
                                                            device=tapped.device))
        bar.update(req.num_cached - done)
        done = req.num_cached
    bar.close()
    first = int(last[-1].argmax())
    if spec is not None:
        req.spec_state = SpecState(cache, first, spec.new_metrics())
    return first


# ---- instruments -----------------------------------------------------------------------------
class _Clock:
    """Interval timer: CUDA events on the GPU (no sync inside the step), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.open: dict[object, object] = {}
        self.pairs: dict[str, list] = defaultdict(list)

    def start(self, key) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.open[key] = ev
        else:
            self.open[key] = time.perf_counter()

    def stop(self, key, name: str) -> None:
        t0 = self.open.pop(key, None)
        if t0 is None:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.pairs[name].append((t0, ev))
        else:
            self.pairs[name].append((t0, time.perf_counter()))

    def collect(self) -> dict[str, list[float]]:
        """Seconds per interval, by name (call after a device sync); clears."""
        out = {}
        for name, pairs in self.pairs.items():
            if self.cuda:
                out[name] = [a.elapsed_time(b) / 1e3 for a, b in pairs]
            else:
                out[name] = [b - a for a, b in pairs]
        self.pairs = defaultdict(list)
        return out


@contextlib.contextmanager
def instrument(model, device: torch.device):
    """Time the target's parts in situ: per layer MLA block / MLP, the attention kernel
    call (wrapped for the duration), the whole forward and the LM head."""
    clock = _Clock(device)
    handles = []

    def hook(mod, name):
        handles.append(mod.register_forward_pre_hook(lambda m, a: clock.start(m)))
        handles.append(mod.register_forward_hook(lambda m, a, o: clock.stop(m, name)))

    hook(model, "target_forward")
    hook(model.lm_head, "lm_head")
    for layer in model.model.layers:
        hook(layer.self_attn, "mla_block")
        hook(layer.mlp, "moe" if hasattr(layer.mlp, "routed_weights") else "dense_mlp")
    original = kernels.mla_verify_attention

    def timed_attention(*args, **kw):
        key = object()
        clock.start(key)
        out = original(*args, **kw)
        clock.stop(key, "attention_kernel")
        return out

    kernels.mla_verify_attention = timed_attention
    # Tensor parallel: rank 0's all-reduces (two a layer), waiting for the slowest rank
    # included: that wait is what a rank's imbalance costs the step.
    par = getattr(model, "parallel", None)
    reduce = par.all_reduce if par is not None and getattr(par, "group", None) is not None else None
    if reduce is not None:
        def timed_reduce(x):
            key = object()
            clock.start(key)
            out = reduce(x)
            clock.stop(key, "all_reduce")
            return out

        object.__setattr__(par, "all_reduce", timed_reduce)
    try:
        yield clock
    finally:
        kernels.mla_verify_attention = original
        if reduce is not None:
            object.__delattr__(par, "all_reduce")
        for h in handles:
            h.remove()


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
    graphs = _cuda_graphs(engine)
    if graphs is not None:
        graphs.time_replays = True
    # Under CUDA graphs module hooks see nothing inside a replay (and must not sync inside a
    # capture): instrumented steps then time only the spec phases, the replay is timed apart.
    hooks = instrumented and graphs is None
    ctx = instrument(engine.model, dev) if hooks else contextlib.nullcontext()
    with ctx as clock:
        sync(dev)
        t0 = time.perf_counter()
        engine.step()
        sync(dev)
        wall = time.perf_counter() - t0
    touched, counts = _touched(engine.model)
    sample = StepSample(wall, len(req.output_ids) - before, 0, 0, touched, counts, finishing=req.finished)
    if counts:
        load = moe_load(engine.model)
        sample.expert_max_over_mean = max(lay["expert_max_over_mean"] for lay in load["layers"])
        sample.rank_max_over_mean = load["worst_rank_max_over_mean"]
    if graphs is not None:
        sample.graph_s = graphs.last_replay_s()
    if metrics is not None:
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


@dataclass
class DecodeRun:
    samples: list[StepSample]
    token_ids: list[int]  # the request's output (first token from the prefill included)
    metrics: object | None  # its SpecMetrics (kept past the finish), None without speculation
    pages: list[int]  # its KV pages while it ran
    kv_page_rows: int = 0  # rows a page of the KV its steps read (64 at page 1 read coarse)


def decode_run(rig: Rig, context: int, mode: str, rc: RunConfig, drafter=None,
               tokens: int | None = None) -> DecodeRun:
    """Decode one request at `context` for `tokens` tokens (default rc.max_tokens)."""
    tokens = tokens or rc.max_tokens
    kv_tokens = context + tokens + 2 * (rig.drafter.block_size if rig.drafter is not None else 1)
    engine = rig.engine(mode, kv_tokens, drafter=drafter)
    req = place_request(engine, rig, context, tokens, rc.fill, rc.seed, rc.progress)
    metrics = req.spec_state.metrics if req.spec_state is not None else None
    pages = list(req.pages)
    page_rows = engine.executor.paged([req.pages]).kv.shape[2]
    split = WARMUP_STEPS + max(1, _planned_steps(rig, mode, tokens, rc) // 2)
    if _cuda_graphs(engine) is not None and mode == "off":
        split = 1 << 30  # no spec phases to time, and module timers see nothing in a replay
    samples = []
    while not req.finished:
        # plain steps first (the headline timing), then instrumented ones (the breakdown)
        s = run_steps(engine, req, instrumented=len(samples) >= split)
        if s is None:
            break
        samples.append(s)
    return DecodeRun(samples, list(req.output_ids), metrics, pages, page_rows)


def _planned_steps(rig: Rig, mode: str, tokens: int, rc: RunConfig) -> int:
    if mode == "off" or rig.drafter is None:
        return tokens - 1
    per = rig.drafter.block_size if rc.acceptance in ("oracle",) else (
        int(rc.acceptance) + 1 if rc.acceptance.isdigit() else 2)
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
    ms_full = ms_step + extra_ms
    attn_floor_ms = 1e3 * floor_full["attention"]["s"]
    kv_bytes = floor_full["attention"]["bytes"]
    attn_ms = parts.get("attention_kernel", {}).get("ms")
    out = {
        "context": context, "mode": mode, "steps": len(timed),
        "ms_per_step_measured": ms_step, "ms_per_step": ms_full,
        "tokens_per_step": tok_per_step, "tok_s": tok_per_step / (ms_full / 1e3),
        "tok_s_measured": tok_per_step / (ms_step / 1e3),
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
    }
    return out


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
def sweep(rig: Rig, rc: RunConfig, ceilings, log=print) -> dict:
    plan = layer_plan(rig)
    declared = _declared(rig, rc)
    runs = []
    for context in rc.contexts:
        reference = None
        if declared and any(m != "off" for m in rc.modes):
            depth = rig.drafter.block_size
            run = decode_run(rig, context, "off", rc, tokens=rc.max_tokens + depth + 1)
            samples, reference = run.samples, run.token_ids
            if "off" in rc.modes:
                runs.append(summarise(rig, context, "off", samples, ceilings, plan, None))
                runs[-1]["kv_page_rows"] = run.kv_page_rows
        for mode in rc.modes:
            if mode == "off" and reference is not None:
                continue
            drafter = None
            if mode != "off" and declared:
                accept = None if rc.acceptance == "oracle" else int(rc.acceptance)
                drafter = DeclaredDrafter(rig.drafter, reference, context, accept)
            run = decode_run(rig, context, mode, rc, drafter=drafter)
            runs.append(summarise(rig, context, mode, run.samples, ceilings, plan,
                                  declared if mode != "off" else None))
            runs[-1]["kv_page_rows"] = run.kv_page_rows
        for r in runs:
            if r["context"] == context:
                attach_part_floors(r)
                log(_one_line(r))
    return _result(rig, rc, ceilings, plan, runs, declared)


def layer_plan(rig: Rig):
    """The layers figures are reported for: a preset's real model (extrapolated), else the built one."""
    if rig.preset is None:
        return floors.LayerPlan.of(rig.model)
    return floors.LayerPlan(rig.preset.full_layers, rig.preset.full_dense_layers)


def _declared(rig: Rig, rc: RunConfig) -> str | None:
    """The acceptance source of spec runs: None = the real drafter's own proposals."""
    if rc.acceptance == "drafter":
        if rig.preset is not None:
            raise ValueError("a preset's random drafter accepts nothing: use --acceptance oracle or K")
        return None
    if rc.acceptance == "oracle":
        return "oracle: the target's own greedy continuation at every depth (full acceptance)"
    if not rc.acceptance.isdigit():
        raise ValueError(f"--acceptance must be oracle, drafter or an integer, got {rc.acceptance!r}")
    return f"fixed: the target's own tokens for {int(rc.acceptance)} depths, then a wrong one"


def _result(rig, rc, ceilings, plan, runs, declared) -> dict:
    slopes = {}
    for mode in rc.modes:
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
        "fill": rc.fill, "fill_note": FILL_NOTES[rc.fill],
        "acceptance": declared or "the real drafter's own proposals",
        "max_tokens": rc.max_tokens, "tree_budget": rig.tree_budget,
        "page_size": rig.page_size, "scattered": rig.scattered, "cuda_graphs": rig.cuda_graphs,
        "tp": getattr(getattr(rig.model, "parallel", None), "tp_size", 1),
        "ep": getattr(getattr(rig.model, "parallel", None), "ep_size", 1),
        "ceilings": ceilings.to_dict(), "floor_model": floors.FLOOR_MODEL,
        "runs": runs, "slopes": slopes,
    }


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
        "dtype": str(rig.dtype).replace("torch.", ""), "switches": knobs.switched(),
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


# ---- printing --------------------------------------------------------------------------------------
def _k(n: int) -> str:
    return f"{n / 1024:.4g}k" if n >= 1024 else str(n)


def _f(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _one_line(r: dict) -> str:
    return (f"  {_k(r['context']):>6} {r['mode']:>6}: {r['tok_s']:.1f} tok/s, {r['ms_per_step']:.2f} ms/step "
            f"(floor {r['floor_ms']:.3f} ms, {r['x_floor']:.1f}x), acceptance {r['mean_acceptance_length']:.2f}")


def table(result: dict) -> str:
    runs = result["runs"]
    lines = []
    if result["extrapolated"]:
        lines.append(f"(times extrapolated from {result['layers_measured']} measured layers to "
                     f"{result['layers_reported']}; measured figures in the JSON)")
    head = (f"| {'Context':>7} | {'Spec':>6} | {'Decode (tok/s)':>14} | {'ms/step':>8} | {'floor ms':>8} | "
            f"{'x floor':>7} | {'accept len':>10} | {'nodes':>5} | {'attn ms':>8} | {'attn x fl':>9} | "
            f"{'KV GB/s':>8} | {'MoE+proj ms':>11} | {'drafter ms':>10} | {'host ms':>7} |")
    lines += [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in runs:
        p = r["parts"]
        pf = r.get("part_floors", {})
        moe_keys, drafter_keys = ("mla_projections", "dense_mlp", "moe"), ("drafter", "drafter_extend")
        moe = sum(p[k]["ms"] for k in moe_keys if k in p) if any(k in p for k in moe_keys) else None
        drafter = sum(p[k]["ms"] for k in drafter_keys if k in p) if any(k in p for k in drafter_keys) else None
        lines.append(
            f"| {_k(r['context']):>7} | {r['mode']:>6} | {r['tok_s']:>14.1f} | {r['ms_per_step']:>8.2f} | "
            f"{r['floor_ms']:>8.3f} | {r['x_floor']:>7.1f} | {r['mean_acceptance_length']:>10.2f} | "
            f"{r['nodes_verified']:>5.1f} | {_f(r['attention_ms'], '.3f'):>8} | "
            f"{_f(pf.get('attention', {}).get('x_floor')):>9} | {_f(r['kv_gbps'], '.1f'):>8} | "
            f"{_f(moe, '.2f'):>11} | {_f(drafter, '.2f'):>10} | "
            f"{_f(p.get('host_other', {}).get('ms') if p else None, '.2f'):>7} |")
    ar = [(r["context"], r["mode"], r["parts"]["all_reduce"]["ms"]) for r in runs
          if r["parts"].get("all_reduce", {}).get("ms")]
    if ar:
        lines.append("all-reduce per step (rank 0, waiting for the slowest rank included): " + ", ".join(
            f"{_k(c)} {m} {ms:.2f} ms" for c, m, ms in ar))
    spread = [line for r in runs if (line := _host_spread(r))]
    if spread:
        lines.append("host ms is the median of few instrumented steps; these steps are not like the "
                     "others (a one-time capture or rebuild?): " + "; ".join(spread))
    if result.get("cuda_graphs"):
        lines.append("(CUDA graphs: the target forward is one replay, timed on the device and scaled by "
                     "the layer count; no attention / MoE split: run with graphs off for that)")
    lines.append("")
    lines.append(side_by_side(result))
    lines.append("")
    for mode, s in result["slopes"].items():
        lines.append(f"slope {mode:>6}: {_f(s['ms_per_1k'], '.4f')} ms per +1k context "
                     f"(floor {_f(s['floor_ms_per_1k'], '.4f')}, {_f(s['x_floor'])}x)")
    lines.append(f"acceptance: {result['acceptance']}")
    lines.append(f"context: {result['fill_note']}")
    lines.append(f"ceilings: {result['ceilings']['bandwidth'] / 1e9:.1f} GB/s, "
                 f"{result['ceilings']['matmul'] / 1e12:.2f} TFLOP/s ({result['ceilings']['source']})")
    switches = result.get("meta", {}).get("switches")
    if switches:  # an A/B run: not the defaults' figures
        lines.append("switches away from their defaults: " + ", ".join(f"{k}={v}" for k, v in switches.items()))
    return "\n".join(lines)


def _host_spread(r: dict) -> str | None:
    """A note when one instrumented step's untimed host time dwarfs the others' (its median is
    the table's host ms: with two or three samples, one such step sets it)."""
    host = sorted(r.get("instrumented_host_ms") or [])
    if len(host) < 2 or host[-1] < 1.0 or host[-1] < 5 * host[0]:
        return None
    return f"{_k(r['context'])} {r['mode']}: {', '.join(f'{x:.2f}' for x in r['instrumented_host_ms'])} ms"


def side_by_side(result: dict) -> str:
    modes = list(result["slopes"])
    contexts = sorted({r["context"] for r in result["runs"]})
    by = {(r["context"], r["mode"]): r for r in result["runs"]}
    head = "| Context | " + " | ".join(f"{m + ' tok/s':>13} | {m + ' ms':>10}" for m in modes) + " |"
    lines = [head]
    for c in contexts:
        cells = []
        for m in modes:
            r = by.get((c, m))
            cells.append(f"{_f(r and r['tok_s']):>13} | {_f(r and r['ms_per_step'], '.2f'):>10}")
        lines.append(f"| {_k(c):>7} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(result: dict, path: str | Path | None) -> Path:
    if path is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = result["preset"] or "model"
        path = Path("benchmarks/results") / f"sweep-{name}-{stamp}.json"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return path
