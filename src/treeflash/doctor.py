"""`treeflash doctor`'s checks: each suspect of the incident report (DESIGN.md; `doctor_cli.py`
tells it in its --help) checked on a model pair, the one at fault named.

Every check prints PASS / WARN / FAIL (or N/A) with one line of evidence and the next
command to run; any FAIL makes the exit code 1. The suspects, in the report's order: a
step far above its floor (and a slope per +1k context far above the floor's), the verify
attention's effective bandwidth and the KV layout under it (the real cause: page_size 1,
shuffled), the drafter's sliding window and its incremental cache, acceptance (the oracle
must reach full acceptance; a real drafter at exactly 1.00 is a likely bug), the metrics'
own invariants, MoE load at batch 1 and the GPU's busy fraction. Then, informational, which
tree the auto budget's rule picks at this context and batch, and why (tree_sizing).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from treeflash import costs as floors  # the floor model, costs/
from treeflash import knobs
from treeflash.bench.presets import DeclaredDrafter, Rig
from treeflash.bench.sweep import RunConfig, decode_run, layer_plan, place_request, summarise, sync
from treeflash.bench.sweep_steps import device_seconds
from treeflash.kvcache.defrag import num_runs
from treeflash.kvcache.format import capacity_line, kv_format, kv_tokens
from treeflash.speculative.budget import MARGIN, SWITCH_MARGIN
from treeflash.speculative.metrics import MetricsContradiction

MIN_TOKENS_PER_RUN = 64  # a contiguous run shorter than this starves the verify kernel
# A verify attention call's fixed cost on the H200 (split kernel + combine under a CUDA graph):
# 7-10 us for the shipped pair at 256-8k keys, whatever the split count (2026-12-03,
# benchmarks/tune_small_splits.py). A call whose byte floor is below it is latency-bound: its
# ratio to the floor says nothing about bandwidth (the shipped pair at 4k read "53.6x its floor:
# bandwidth-starved" for a 12 us call).
CALL_LATENCY_S = 10e-6


@dataclass
class Check:
    name: str
    status: str  # PASS | WARN | FAIL | N/A
    evidence: str
    next: str = ""

    def lines(self) -> str:
        out = f"{self.status:<4}  {self.name:<24} {self.evidence}"
        return out + (f"\n      {'':<24} next: {self.next}" if self.next else "")


@dataclass
class Doctor:
    """Runs the checks on one rig at one context, sharing decode runs between checks."""

    rig: Rig
    context: int
    ceilings: floors.Ceilings
    tokens: int = 24
    fill: str = "prefill"
    spec: str | None = None  # "ddtree" / "dflash"; None: ddtree
    batch: int = 1  # the batch tree_sizing explains the rule at
    progress: bool = False  # prefill bars of the probe runs
    _runs: dict = field(default_factory=dict)

    @property
    def gpu(self) -> bool:
        return self.rig.device.type == "cuda"

    @property
    def spec_mode(self) -> str | None:
        """The speculative mode diagnosed: --spec (ddtree or dflash), ddtree by default, None
        without a drafter (--spec off unloads it: plain decode alone is diagnosed)."""
        return (self.spec or "ddtree") if self.rig.drafter is not None else None

    def run(self, mode: str, context: int | None = None, drafter=None, key: str | None = None, budget=None):
        key = key or f"{mode}@{context or self.context}"
        if key not in self._runs:
            rc = RunConfig([], [mode], self.tokens, self.fill, "drafter", progress=self.progress)
            self._runs[key] = decode_run(self.rig, context or self.context, mode, rc, drafter=drafter,
                                         budget=budget)
        return self._runs[key]

    def checks(self, on_check=None) -> list[Check]:
        """Every check in order; on_check(name, done, total), if given, before each (progress)."""
        out = []
        fns = (check_environment, check_kv_capacity, check_kv_fragmentation, check_attention_bandwidth,
               check_step_vs_floor, check_drafter_window, check_drafter_cache, check_tap_layers,
               check_oracle_acceptance, check_real_acceptance, check_metric_invariants, check_moe_balance,
               check_gpu_busy, check_tree_sizing)
        for i, fn in enumerate(fns):
            if on_check is not None:
                on_check(fn.__name__.removeprefix("check_"), i, len(fns))
            try:
                out.append(fn(self))
            except Exception as e:  # noqa: BLE001 - a crashing check is itself a finding
                out.append(Check(fn.__name__.removeprefix("check_"), "FAIL",
                                 f"the check crashed: {type(e).__name__}: {e}",
                                 "rerun with python -X dev and report the traceback"))
        return out


def _steady(samples) -> list:
    """Steps after the warm-up, without the last one (it may be cut by max_tokens)."""
    body = samples[2:-1] or samples[:-1] or samples
    return body


# ---- the process environment ------------------------------------------------------------------
def check_environment(d: Doctor | None = None) -> Check:
    """Every TREEFLASH_* variable and runtime option set away from its default (A/B switches that
    restore slower launches are the first suspect of a run slower than the record), every misspelt one, and
    CUDA_LAUNCH_BLOCKING / TRITON_INTERPRET / PYTORCH_NO_CUDA_MEMORY_CACHING left set."""
    notes, errors = knobs.check_environment()
    if d is not None:  # --runtime-option: fused steps run another way
        notes += d.rig.model.options.notes()
    if errors:
        return Check("environment", "FAIL", "; ".join(errors), "unset them or give an accepted value")
    if notes:
        return Check("environment", "WARN", "; ".join(notes),
                     "unset them and drop the --runtime-option flags to measure the defaults (treeflash/knobs.py "
                     "and --runtime-option help list each one)")
    return Check("environment", "PASS", "every TREEFLASH_* switch and runtime option at its default")


# ---- the KV cache: its capacity, its layout, the verify attention over it -----------------------
def free_memory(device: torch.device) -> tuple[int, str]:
    """(bytes free now, where): the GPU's free memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {torch.cuda.get_device_name(device)}"
    import psutil

    return psutil.virtual_memory().available, "available CPU RAM"


def check_kv_capacity(d: Doctor) -> Check:
    """KV tokens per GPU: the device's free memory (the model loaded) over a token's rows in
    every layer of the real model (a preset's full depth), in the cache's row format and in the
    other one. WARN when this context does not fit; fp8_e4m3 rows suggested where they would.
    Under decode context parallelism (--dcp N) a request's pages are dealt over N GPUs: the
    longest request is N x one GPU's tokens."""
    fmt, layers, dcp = d.rig.kv_format, layer_plan(d.rig).total, d.rig.dcp
    free, where = free_memory(d.rig.device)
    ev = "KV tokens per GPU: " + capacity_line(fmt, layers, free, where)
    if dcp > 1:
        ev += (f"; the longest request under DCP {dcp}: {dcp * kv_tokens(free, layers, fmt)} tokens ({dcp}x one "
               f"GPU's: its pages dealt over {dcp} ranks)")
    need = d.context + d.tokens
    if dcp * kv_tokens(free, layers, fmt) < need:
        fp8_fmt = kv_format("fp8_e4m3", fmt.dim, fmt.v_dim, fmt.dtype)
        fp8 = not fmt.fp8 and dcp * kv_tokens(free, layers, fp8_fmt) >= need
        return Check("kv_capacity", "WARN", ev + f": not one request of {need} tokens",
                     "an fp8_e4m3 KV cache holds it: --kv-cache-dtype fp8_e4m3" if fp8 else
                     "a shorter context, more GPUs (context parallel) or a GPU with more memory")
    return Check("kv_capacity", "PASS", ev)


def check_kv_fragmentation(d: Doctor) -> Check:
    run = d.run("off")
    pool_pages = d.rig.page_size
    pages = run.pages[: -(-d.context // (pool_pages * d.rig.dcp))]  # (a page id holds dcp x page_size under DCP)
    runs = num_runs(pages)
    per_run = d.context / runs
    ev = (f"{d.context} tokens in {len(pages)} pages of {pool_pages} in {runs} contiguous run(s) "
          f"({per_run:.1f} tokens per run)")
    if runs > 1 and per_run < MIN_TOKENS_PER_RUN:
        return Check("kv_fragmentation", "FAIL",
                     f"scattered KV: {ev}; the verify kernel hops pages every {per_run:.0f} tokens "
                     "(the incident: page_size 1 shuffled, ~14 GB/s)",
                     "allocate KV contiguously (drop --scattered, --page-size 64) or compact with "
                     "kvcache.defrag; compare: treeflash bench sweep --contexts 8k,32k --page-size 1 --scattered")
    if runs > 8:
        return Check("kv_fragmentation", "WARN", ev, "treeflash bench kernel --defrag")
    return Check("kv_fragmentation", "PASS", ev)


def check_attention_bandwidth(d: Doctor) -> Check:
    """The verify attention kernel alone, on a request's real page table, at this context."""
    from treeflash import kernels

    rig = d.rig
    engine = rig.engine("off", d.context + 64)
    req = place_request(engine, rig, d.context, 8, "random", seed=1, progress=False)
    cfg = rig.cfg
    heads = getattr(rig.model.model.layers[0].self_attn, "num_heads", cfg.num_attention_heads)
    budget = rig.tree_budget if isinstance(rig.tree_budget, int) else 32  # "auto" starts near 32
    rows = budget + 1 if rig.drafter is not None else 1
    n = rows
    paged = engine.executor.paged([req.pages])  # the layout the engine's steps read
    cache, table = paged.kv[0], paged.table
    prefix = torch.tensor([d.context - n], dtype=torch.int32, device=rig.device)
    q = torch.randn(1, n, heads, cfg.latent_dim, device=rig.device, dtype=rig.dtype)
    call = lambda: kernels.mla_verify_attention(q, cache, table, prefix, None, cfg.softmax_scale,
                                                v_dim=cfg.kv_lora_rank)
    call()
    t, how = device_seconds(call, rig.device)
    engine.pool.release(req.pages)
    part = floors.attention_part(rig.model, d.context, n, engine.pool.format.row_bytes)
    floor_s = d.ceilings.floor_s(part.bytes, part.flops)
    gbps = part.bytes / t / 1e9
    frac = part.bytes / t / d.ceilings.bandwidth
    runs = num_runs(req.pages or [0])
    view = f" (pages of {engine.pool.page_size} read as {cache.shape[1]}-row pages)" if paged.factor > 1 else ""
    ev = (f"L={d.context}{view}, N={n}, H={heads}: {1e3 * t:.3f} ms per layer ({how}) = {gbps:.1f} GB/s "
          f"effective ({100 * frac:.1f}% of {d.ceilings.bandwidth / 1e9:.0f} GB/s), {t / floor_s:.1f}x its floor")
    nxt = "treeflash bench kernel --contexts 8k,32k,128k --nodes 1,32" if d.gpu else \
        "on a GPU: treeflash bench kernel --contexts 8k,32k,128k"
    if d.gpu and floor_s < CALL_LATENCY_S:
        return Check("verify_attention_bw", "PASS", ev + f": its floor ({1e6 * floor_s:.1f} us) is below a "
                     f"call's fixed cost (~{1e6 * CALL_LATENCY_S:.0f} us): latency-bound, bandwidth not judged here")
    if d.gpu and d.context >= 4096 and t / floor_s > 20:
        cause = " over fragmented KV" if runs > 8 else ""
        return Check("verify_attention_bw", "FAIL", ev + f": bandwidth-starved{cause}", nxt)
    if t / floor_s > 5:
        note = "" if d.gpu else " (CPU: torch reference, not the kernel)"
        return Check("verify_attention_bw", "WARN", ev + note, nxt)
    return Check("verify_attention_bw", "PASS", ev)


def check_step_vs_floor(d: Doctor) -> Check:
    """The incident's '1.43 s is implausible': a step and its slope per +1k vs the floors.
    Figured as `treeflash bench sweep` figures them (`sweep.summarise`): a preset that keeps
    4 of 61 layers is extrapolated to 61, so the drafter and the host, which do not scale with
    the layer count, weigh as much as they do in the real model (an H200 doctor run, 2026-12-03, read
    "3x the floor" on 4 layers where the sweep's 61-layer step was 1.3x)."""
    rig = d.rig
    mode = d.spec_mode or "off"
    small = max(16, d.context // 8)
    plan = layer_plan(rig)
    big, low = (summarise(rig, c, mode, d.run(mode, c).samples, d.ceilings, plan, None)
                for c in (d.context, small))
    ms_big, ms_small = big["ms_per_step"], low["ms_per_step"]
    floor_big, floor_small = big["floor_ms"], low["floor_ms"]
    slope = (ms_big - ms_small) / ((d.context - small) / 1024)
    floor_slope = (floor_big - floor_small) / ((d.context - small) / 1024)
    ratio, slope_ratio = ms_big / floor_big, slope / floor_slope if floor_slope > 0 else float("nan")
    layers = (f" ({big['layers_measured']} of {big['layers_reported']} layers measured, extrapolated "
              "as the sweep does)" if big["layers_measured"] != big["layers_reported"] else "")
    ev = (f"{mode} step at {d.context}: {ms_big:.2f} ms vs floor {floor_big:.3f} ms ({ratio:.1f}x); "
          f"{slope:+.4f} ms per +1k context vs floor's +{floor_slope:.4f} ({slope_ratio:.1f}x){layers}")
    nxt = f"treeflash bench sweep --contexts {small},{d.context} --spec {mode}"
    if not d.gpu:
        note = "; CPU: host overhead and the torch reference dominate, thresholds apply on GPU"
        return Check("step_vs_floor", "WARN" if slope_ratio > 1000 else "PASS", ev + note, nxt)
    # Only a step that grows with context is the incident's signature; a host-bound step
    # (measured on the H200: the eager embedded pair, ~60 ms at 128 and at 1024 tokens)
    # has a noisy, meaningless slope ratio and a different cause.
    grows = ms_big - ms_small > 0.25 * ms_big
    if ratio > 20 and slope_ratio > 10 and grows:
        return Check("step_vs_floor", "FAIL", ev + ": implausible, the context-dependent part is "
                     "far above the floor (look at verify_attention_bw and kv_fragmentation)", nxt)
    if ratio > 3:
        note = "" if grows else (f"; the step barely grows from {small} to {d.context} tokens "
                                 f"({ms_small:.2f} -> {ms_big:.2f} ms): a fixed per-step cost dominates "
                                 "(host and launches: look at gpu_busy; CUDA graphs)")
        return Check("step_vs_floor", "WARN", ev + note, nxt)
    return Check("step_vs_floor", "PASS", ev)


# ---- the drafter --------------------------------------------------------------------------------
def _real_drafter(d: Doctor):
    dr = getattr(d.rig.drafter, "inner", d.rig.drafter)
    return dr if dr is not None and hasattr(dr, "cfg") and hasattr(dr, "layers") else None


def _features(dr, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=dr.fc.weight.device).manual_seed(seed)
    return torch.randn(n, dr.fc.weight.shape[1], generator=g, device=dr.fc.weight.device).to(dr.fc.weight.dtype)


def check_drafter_window(d: Doctor) -> Check:
    dr = _real_drafter(d)
    if dr is None:
        return Check("drafter_sliding_window", "N/A", "no DFlash drafter loaded")
    windows = {i: dr.cfg.window(i) for i in range(dr.cfg.num_hidden_layers) if dr.cfg.window(i)}
    if not windows:
        return Check("drafter_sliding_window", "N/A", "the drafter has no sliding-window layers")
    n = max(d.context, 2 * max(windows.values()) + dr.block_size)
    cache = dr.new_cache()
    for a in range(0, n, 1024):
        b = min(n, a + 1024)
        dr.extend(cache, _features(dr, b - a, a), torch.arange(a, b, device=dr.fc.weight.device))
    dev = dr.fc.weight.device
    q_pos = n + torch.arange(dr.block_size, device=dev)[None]
    for i, w in windows.items():
        held = cache.layers[i].n
        _, _, pos = cache.layers[i].view()
        mask = dr._block_mask(i, q_pos, pos[None])  # [1, Q, ctx+Q]
        keys = torch.cat([pos[None], q_pos], dim=1)[:, None, :]
        reach = int(((q_pos[:, :, None] - keys) * mask).max())
        if held > w - 1 or reach >= w:
            return Check("drafter_sliding_window", "FAIL",
                         f"layer {i} is sliding (W={w}) but after {n} positions its cache holds {held} rows "
                         f"(max {w - 1}) and a block query sees keys {reach} positions back (max {w - 1})",
                         "pytest tests/models -k window; check LayerKV(window=...) and _block_mask")
    desc = ", ".join(f"layer {i}: W={w}" for i, w in windows.items())
    return Check("drafter_sliding_window", "PASS",
                 f"{desc}; after {n} positions each cache holds <= W-1 rows and the mask reaches < W back")


def check_drafter_cache(d: Doctor) -> Check:
    """Drafter KV cache built step by step == recomputed from all committed features at once."""
    dr = _real_drafter(d)
    if dr is None:
        return Check("drafter_cache_incremental", "N/A", "no DFlash drafter loaded")
    dev = dr.fc.weight.device
    n = min(max(d.context, 3 * dr.block_size), 4096)
    feats = _features(dr, n, 7)
    head = n - 4 * dr.block_size
    inc = dr.new_cache()
    dr.extend(inc, feats[:head], torch.arange(head, device=dev))
    pos, k = head, 1
    while pos < n:  # as decode does: accepted + 1 rows per step
        b = min(n, pos + k)
        dr.extend(inc, feats[pos:b], torch.arange(pos, b, device=dev))
        pos, k = b, k % dr.block_size + 1
    full = dr.new_cache()
    dr.extend(full, feats, torch.arange(n, device=dev))
    bonus = torch.tensor([3], device=dev)
    start = torch.tensor([n], device=dev)
    a = dr.propose([inc], bonus, start).float()
    b = dr.propose([full], bonus, start).float()
    diff = float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))
    held_inc, held_full = inc.num_cached(), full.num_cached()
    tol = 1e-4 if feats.dtype == torch.float32 else 3e-2
    ev = (f"after {n} positions (last {n - head} in decode-sized steps): incremental cache rows per layer "
          f"{held_inc} vs recomputed {held_full}; propose logits differ by {diff:.2e} (relative)")
    if held_inc != held_full or diff > tol or inc.seq_len != full.seq_len:
        return Check("drafter_cache_incremental", "FAIL",
                     ev + f"; seq_len {inc.seq_len} vs {full.seq_len}: the drafter cache is not appended correctly",
                     "pytest tests/models/test_drafter.py -k cache; check DFlashDrafter.extend")
    return Check("drafter_cache_incremental", "PASS", ev)


def check_tap_layers(d: Doctor) -> Check:
    """The features the engine feeds the drafter are the outputs of the layers it declares."""
    if d.rig.drafter is None:
        return Check("tap_layers", "N/A", "no drafter loaded")
    rig = d.rig
    spec = rig.decoder(d.spec_mode)
    declared = tuple(rig.drafter.target_layer_ids)
    engine_taps = tuple(spec.tap_layers)
    nlayers = rig.cfg.num_hidden_layers
    info = (f"drafter declares target_layer_ids {list(declared)} (outputs of decoder layers = HF "
            f"hidden_states[L+1]), mask token {rig.drafter.mask_token_id}")
    bad = [t for t in declared if not 0 <= t < nlayers]
    if bad:
        return Check("tap_layers", "FAIL", f"{info}; {bad} are outside the target's {nlayers} layers",
                     "check the drafter's dflash_config.target_layer_ids against the target")
    engine = rig.engine("off", 64)
    req = place_request(engine, rig, 16, 16, "random", seed=2, progress=False)
    captured = {}  # a layer returns (residual, MLP output): its output is their sum
    hooks = [rig.model.model.layers[i].register_forward_hook(
        lambda m, a, o, i=i: captured.__setitem__(i, o[0] if o[1] is None else o[0] + o[1])) for i in set(declared)]
    try:
        ids = torch.randint(2, rig.cfg.vocab_size - 2, (1, 8), generator=torch.Generator().manual_seed(3))
        pos = torch.arange(16, 24)[None]
        with torch.inference_mode():
            _, tapped = engine.forward([req], ids, pos, [16], taps=engine_taps)
    finally:
        for h in hooks:
            h.remove()
        engine.pool.release(req.pages)
    with torch.inference_mode():  # HF's hidden_states[L + 1]: the last layer's after the final norm
        feats = [rig.model.model.norm(captured[i]) if i == nlayers - 1 else captured[i] for i in declared]
    want = torch.cat(feats, dim=-1).float()
    got = tapped.float() if tapped is not None else None
    width = getattr(getattr(_real_drafter(d), "fc", None), "weight", None)
    if got is None or got.shape != want.shape or not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
        diff = "shapes differ" if got is None or got.shape != want.shape else \
            f"max |diff| {float((got - want).abs().max()):.3g}"
        return Check("tap_layers", "FAIL",
                     f"the engine taps layers {list(engine_taps)} but {info}; features differ ({diff})",
                     "fix SpecDecoder.tap_layers / the tap index (layer L output = HF hidden_states[L+1])")
    if width is not None and width.shape[1] != want.shape[-1]:
        return Check("tap_layers", "FAIL", f"{info}; drafter fc takes {width.shape[1]} features, taps give "
                     f"{want.shape[-1]}", "check the drafter checkpoint's fc.weight and target_layer_ids")
    return Check("tap_layers", "PASS", f"engine feeds exactly the declared layers; {info}")


# ---- acceptance and metrics ----------------------------------------------------------------------
def _tokens_per_step(samples) -> float:
    body = samples[:-1] or samples  # the last step may be cut by max_tokens
    return statistics.mean(s.tokens for s in body)


def check_oracle_acceptance(d: Doctor) -> Check:
    if d.rig.drafter is None:
        return Check("acceptance_oracle", "N/A", "no drafter loaded (the oracle wraps its block size)")
    bs = d.rig.drafter.block_size
    ref = d.run("off")
    if len(ref.token_ids) < d.tokens:
        return Check("acceptance_oracle", "N/A", "the reference decode stopped early")
    oracle = DeclaredDrafter(d.rig.drafter, ref.token_ids, d.context)
    run = d.run(d.spec_mode, drafter=oracle, key="oracle")
    # A perfect drafter commits a whole block each step but the last (max_tokens cuts it), so
    # these tokens need ceil(emitted / block) steps; a short run (--max-tokens 8 with blocks of 16)
    # is judged against that, not against full blocks.
    steps = len(run.samples)
    emitted = sum(s.tokens for s in run.samples)
    fewest = max(1, math.ceil(emitted / bs))
    got, possible = emitted / max(steps, 1), emitted / fewest
    ev = (f"oracle drafter (proposes the target's own greedy tokens): {emitted} tokens in {steps} step(s), "
          f"{got:.2f} a step of {possible:.2f} possible (block {bs})")
    nxt = "pytest tests/speculative tests/engine/test_spec_engine.py -q"
    if got < 0.5 * possible:
        return Check("acceptance_oracle", "FAIL", ev + ": verify/walk/commit rejects correct drafts", nxt)
    if steps > fewest:
        return Check("acceptance_oracle", "WARN", ev + " (numerics may flip near-ties in low precision)", nxt)
    return Check("acceptance_oracle", "PASS", ev)


def check_real_acceptance(d: Doctor) -> Check:
    rig = d.rig
    if rig.drafter is None:
        return Check("acceptance_real", "N/A", "no drafter loaded")
    if rig.preset is not None:
        return Check("acceptance_real", "N/A", "preset with random weights: no real acceptance to judge")
    run = d.run(d.spec_mode)
    got = _tokens_per_step(run.samples)
    steps = len(run.samples)
    dr = rig.drafter
    ev = (f"real drafter: mean acceptance length {got:.2f} over {steps} steps "
          f"(taps {list(dr.target_layer_ids)}, mask token {dr.mask_token_id}, block {dr.block_size})")
    if steps >= 4 and abs(got - 1.0) < 1e-9:
        return Check("acceptance_real", "WARN",
                     ev + ": exactly 1.00 is likely a bug (taps, mask token, cache), not an undertrained drafter",
                     "compare acceptance_oracle and tap_layers above; treeflash generate with --spec ddtree")
    return Check("acceptance_real", "PASS", ev)


def check_metric_invariants(d: Doctor) -> Check:
    if d.rig.drafter is None:
        return Check("metric_invariants", "N/A", "no speculation")
    run = d.run(d.spec_mode)
    m = run.metrics
    nxt = "pytest tests/speculative -k metrics; check SpecMetrics.record and record_batch"
    try:
        m.check_invariants(num_generated=len(run.token_ids))
    except MetricsContradiction as e:
        return Check("metric_invariants", "FAIL", f"metrics contradict themselves: {e}", nxt)
    emitted = [s.tokens for s in run.samples[:-1]]
    claimed = [a + 1 for a in m.per_step_accepted[: len(emitted)]]
    if emitted != claimed:
        return Check("metric_invariants", "FAIL",
                     f"metrics count commit lengths {claimed[:6]}... but the engine emitted {emitted[:6]}...",
                     nxt)
    return Check("metric_invariants", "PASS",
                 f"{m.num_spec_steps} steps: commit length = accepted drafts + 1 = accepted depth + 1, "
                 f"histogram and per-position counts agree, {len(run.token_ids)} tokens emitted")


# ---- MoE and the GPU ----------------------------------------------------------------------------------
def check_moe_balance(d: Doctor) -> Check:
    run = d.run(d.spec_mode or "off")
    counts = [c for s in _steady(run.samples) for c in s.expert_counts]
    if not counts:
        return Check("moe_balance_batch1", "N/A", "no MoE layers")
    ranks = _expert_ranks(d.rig)
    worst_e, worst_r = 0.0, 0.0
    for c in counts:
        t = torch.tensor(c, dtype=torch.float64)
        if t.sum() == 0:
            continue
        worst_e = max(worst_e, float(t.max() / t.mean()))
        per_rank = t[: len(t) // ranks * ranks].view(ranks, -1).sum(1) if len(t) >= ranks else t
        worst_r = max(worst_r, float(per_rank.max() / per_rank.mean()))
    touched = statistics.mean(sum(1 for x in c if x) for c in counts)
    ev = (f"batch 1, {len(counts[0])} experts: touched {touched:.1f} per layer per step; tokens per expert "
          f"max/mean {worst_e:.1f}" + (f", per rank (of {ranks}) max/mean {worst_r:.2f}" if ranks > 1 else ""))
    if ranks > 1 and worst_r > 2.0:
        return Check("moe_balance_batch1", "WARN", ev + ": the busiest rank sets the step",
                     "treeflash bench sweep --preset kimi-k2.6-tp8 --contexts 8k (see the moe column)")
    return Check("moe_balance_batch1", "PASS", ev)


def _expert_ranks(rig: Rig) -> int:
    """Ranks the routed experts are split over: a preset's TP slice models its real deployment's
    ranks; a checkpoint's are its expert-parallel groups (TP alone splits every expert, so no
    rank waits on a popular one); 1 on one process."""
    if rig.preset is not None:
        return rig.preset.tp
    return getattr(getattr(rig.model, "parallel", None), "ep_size", 1) or 1


def check_gpu_busy(d: Doctor) -> Check:
    if not d.gpu:
        return Check("gpu_busy", "N/A", "CPU run: no GPU to be idle")
    from torch.profiler import ProfilerActivity, profile

    rig = d.rig
    mode = d.spec_mode or "off"
    # 1 + 3 + 3 steps of at most a block each, and a tree's rows past the end: sized as
    # decode_run sizes its runs (a fixed +64 ran out of pages at 32k on the H200, 2026-12-03)
    block = rig.drafter.block_size if mode != "off" and rig.drafter is not None else 1
    tokens = 14 * (block + 1)  # 1 + 3 warm + 4 timed + 3 profiled steps, a block each at most
    tree = rig.tree_budget if isinstance(rig.tree_budget, int) else 128  # "auto" grows to 127
    engine = rig.engine(mode, d.context + tokens + 2 * block + tree)
    req = place_request(engine, rig, d.context, tokens, d.fill, seed=4, progress=False)
    engine.step()
    sync(rig.device)

    def steps(n: int) -> int:
        done = 0
        for _ in range(n):
            if req.finished:
                break
            engine.step()
            done += 1
        sync(rig.device)
        return done

    # Warm steps first: a key's first steps capture its CUDA graphs (the drafter's on the
    # second sight), and an H200 doctor run (2026-12-03), timing the 3 steps right after the first,
    # read 13% busy for the shipped pair's ~1 ms steps (4.85 ms "a step"). Then the median
    # wall time of single steps as served, then the kernels' time of 3 steps under the
    # profiler (whose own overhead stretched the wall 7x when both came from the profiled
    # window: "14% busy" for steps that were ~97% kernels).
    steps(3)
    walls = []
    for _ in range(4):
        t0 = time.perf_counter()
        if steps(1):
            walls.append(time.perf_counter() - t0)
    if not walls:
        return Check("gpu_busy", "N/A", f"{mode}: the request finished during the warm-up steps")
    wall = statistics.median(walls)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        n_prof = steps(3)
    kernel_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                    for e in prof.key_averages()
                    if getattr(e, "device_type", None) is not None and "cuda" in str(e.device_type).lower())
    kernel_s = kernel_us / 1e6 / max(n_prof, 1)
    busy = kernel_s / wall
    ev = (f"{mode}: kernels {1e3 * kernel_s:.2f} ms a step (profiled) of {1e3 * wall:.2f} ms a step "
          f"wall (unprofiled, median of {len(walls)} after 4 warm) = {100 * busy:.0f}% busy")
    if busy < 0.5:
        return Check("gpu_busy", "WARN", ev + ": launch/host bound (CUDA graphs, fewer syncs: issue 7)",
                     "nsys profile treeflash bench sweep --contexts 8k --max-tokens 32")
    return Check("gpu_busy", "PASS", ev)


# ---- the tree sizing ----------------------------------------------------------------------------------
def check_tree_sizing(d: Doctor) -> Check:
    """The auto budget's rule at this context and batch (speculative/budget.py): one request decoded
    under auto here (the real drafter; a preset's random one accepts nothing, so there the
    oracle's full acceptance), then per bucket the expected accepted drafts, the step's
    seconds, and per node the expected tokens gained and the marginal seconds over the bucket
    below; the pick is the most committed tokens per second, off included. A batch above 1 is
    extrapolated: its requests accept as this one did, the cost model prices the step."""
    if d.spec_mode != "ddtree":
        return Check("tree_sizing", "N/A", "needs --spec ddtree and a drafter")
    drafter, source = None, "the real drafter"
    if d.rig.preset is not None:
        ref = d.run("off")
        drafter, source = DeclaredDrafter(d.rig.drafter, ref.token_ids, d.context), "the oracle (preset)"
    run = d.run("ddtree", drafter=drafter, key="auto", budget="auto")
    sizer = run.spec.sizer if run.spec is not None else None
    if sizer is None or run.sizing is None:
        return Check("tree_sizing", "N/A", "the auto run made no step")
    ex = sizer.explain([d.context] * d.batch, run.sizing)
    m = run.metrics
    ran = f"ran {m.steps_by_budget or {}} + {m.num_plain_steps} plain over {len(run.samples)} steps"
    head = (f"at {d.context} tokens x batch {d.batch}, {source}: picks "
            + ("no tree (plain decode)" if not ex["choice"] else f"budget {ex['choice']}")
            + f" ({ran}); off {ex['off']['tok_s']:.1f} tok/s, {1e3 * ex['off']['step_s']:.3f} ms a step")
    rows = [f"{'budget':>6} {'accepted':>8} {'gain/node':>9} {'step ms':>8} {'cost/node us':>12} {'tok/s':>9}"]
    for r in ex["buckets"]:
        mark = " <" if r["budget"] == ex["choice"] else ""
        rows.append(f"{r['budget']:>6} {r['accepted']:>8.2f} {r['gain_per_node']:>9.3f} {1e3 * r['step_s']:>8.3f} "
                    f"{1e6 * r['cost_per_node_s']:>12.2f} {r['tok_s']:>9.1f}{mark}")
    note = ("a node pays while its gain per node x the current tok/s exceeds 1 / its cost per node: "
            "expected tokens gained per node against marginal seconds per node; a dearer bucket must pay "
            f"{MARGIN:.0%} more, and a bucket already held stays unless another pays {SWITCH_MARGIN:.0%} more")
    ev = head + "\n" + "\n".join(f"      {'':<24} {line}" for line in rows)
    return Check("tree_sizing", "PASS", ev, note)


# ---- the command -----------------------------------------------------------------------------------------
def run_doctor(rig: Rig, context: int, ceilings: floors.Ceilings, fill: str = "prefill",
               tokens: int = 24, spec: str | None = None, batch: int = 1) -> list[Check]:
    return Doctor(rig, context, ceilings, tokens=tokens, fill=fill, spec=spec, batch=batch).checks()


def report(checks: list[Check]) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in ("PASS", "WARN", "FAIL", "N/A")}
    tail = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    return "\n".join(c.lines() for c in checks) + f"\n{tail}"
