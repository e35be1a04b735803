"""`treeflash doctor` passes a healthy pair and names the cause on each broken one built here."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from treeflash.bench import floors
from treeflash.bench.presets import load_rig
from treeflash.cli import main
from treeflash.doctor import run_doctor
from treeflash.models.drafter import DFlashDrafter
from treeflash.models.drafter_cache import DrafterCache, LayerKV
from treeflash.runtime import DEFAULT
from treeflash.speculative.decoder import SpecDecoder
from treeflash.speculative.metrics import SpecMetrics

pytestmark = pytest.mark.slow

VOCAB = 96
CONTEXT = 160
CEILINGS = floors.Ceilings(10e9, 50e9, "test")


def rig(pair, **kw):
    target, drafter = pair
    r = load_rig(str(target), str(drafter), None, torch.device("cpu"), torch.float32,
                 kw.pop("page_size", 16), kw.pop("scattered", False), 8)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def statuses(checks):
    return {c.name: c for c in checks}


def doctor(r):
    return statuses(run_doctor(r, CONTEXT, CEILINGS, fill="prefill", tokens=24))


def only_failure(checks, name):
    failed = [c.name for c in checks.values() if c.status == "FAIL"]
    assert failed == [name], {c.name: (c.status, c.evidence) for c in checks.values()}
    return checks[name]


def test_healthy_pair_passes(pair):
    checks = doctor(rig(pair))
    assert not [c for c in checks.values() if c.status == "FAIL"], [c.lines() for c in checks.values()]
    for name in ("kv_fragmentation", "drafter_sliding_window", "drafter_cache_incremental", "tap_layers",
                 "acceptance_oracle", "metric_invariants"):
        assert checks[name].status == "PASS", checks[name].lines()
    assert checks["gpu_busy"].status == "N/A"
    assert "mask token 95" in checks["tap_layers"].evidence


def test_cli_exit_codes(pair, capsys):
    target, drafter = pair
    base = ["doctor", "--model", str(target), "--drafter", str(drafter), "--device", "cpu",
            "--context", str(CONTEXT), "--page-size", "16"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "PASS  kv_fragmentation" in out and "FAIL" not in out
    assert main([*base[:-1], "1", "--scattered"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  kv_fragmentation" in out and "scattered KV" in out and "next:" in out


def test_cli_diagnoses_the_spec_mode_asked_for(pair, capsys):
    """--spec off diagnoses plain decode alone (the drafter's checks N/A, though the pair has one),
    --spec dflash the chain; --spec ddtree without a drafter is refused (it ran plain decode)."""
    target, drafter = pair
    base = ["doctor", "--model", str(target), "--device", "cpu", "--context", str(CONTEXT), "--page-size", "16",
            "--max-tokens", "8"]
    assert main([*base, "--drafter", str(drafter), "--spec", "off"]) == 0
    out = capsys.readouterr().out
    assert "spec off" in out and "off step at" in out
    assert "N/A   acceptance_oracle" in out and "N/A   tap_layers" in out
    assert main([*base, "--drafter", str(drafter), "--spec", "dflash"]) == 0
    out = capsys.readouterr().out
    assert "spec dflash" in out and "dflash step at" in out and "PASS  acceptance_oracle" in out
    with pytest.raises(SystemExit) as e:
        main([*base, "--spec", "ddtree"])
    assert e.value.code == 2
    assert "--speculative-algorithm ddtree needs a drafter" in capsys.readouterr().err


def test_scattered_kv_fails_naming_fragmentation(pair):
    c = only_failure(doctor(rig(pair, page_size=1, scattered=True)), "kv_fragmentation")
    assert "scattered KV" in c.evidence and "page" in c.next


class IgnoresWindow(DFlashDrafter):
    """Declares sliding layers but caches every position and masks nothing out."""

    def new_cache(self, prompt_ids=None):
        p, c = self.fc.weight, self.cfg
        return DrafterCache([LayerKV(c.num_key_value_heads, c.head_dim, None, p.device, p.dtype)
                             for _ in range(c.num_hidden_layers)])

    def _block_mask(self, layer, q_pos, ctx_pos):
        k_pos = torch.cat([ctx_pos, q_pos], dim=1)
        return (k_pos[:, None, :] >= 0).expand(-1, q_pos.shape[1], -1).clone()


class NeverAppends(DFlashDrafter):
    """Takes the prompt's features, then silently drops every committed step."""

    def extend(self, cache, features, positions=None):
        if cache.seq_len == 0:
            super().extend(cache, features, positions)


def broken_drafter(r, cls):
    d = copy.copy(r.drafter)
    d.__class__ = cls
    r.drafter = d
    return r


def test_ignored_sliding_window_fails(pair):
    c = only_failure(doctor(broken_drafter(rig(pair), IgnoresWindow)), "drafter_sliding_window")
    assert "W=5" in c.evidence and "cache holds" in c.evidence


def test_drafter_cache_not_appended_fails(pair):
    checks = doctor(broken_drafter(rig(pair), NeverAppends))
    c = checks["drafter_cache_incremental"]
    assert c.status == "FAIL" and "not appended" in c.evidence, c.lines()
    assert checks["kv_fragmentation"].status == "PASS"


class MiscountingMetrics(SpecMetrics):
    """The incident's accounting: the accepted depth counted past the drafts really committed."""

    def record(self, drafted, accepted, accepted_depth=None, budget=None):
        super().record(drafted, accepted, min(accepted + 2, self.max_depth), budget)


class MiscountingDecoder(SpecDecoder):
    def new_metrics(self):
        return MiscountingMetrics(tree_budget=self.budget, spec_mode=self.mode,
                                  max_depth=self.drafter.block_size - 1)


class OffByOneTaps(SpecDecoder):
    """Taps the input of each declared layer (HF hidden_states[L]) instead of its output."""

    @property
    def tap_layers(self):
        return tuple(max(0, i - 1) for i in self.drafter.target_layer_ids)


def test_a_verify_that_rejects_correct_drafts_fails_the_oracle(pair, monkeypatch):
    """A verify whose target tokens are wrong past the root (as a broken tree mask would make
    them) accepts only depth 1: the oracle's 16-token blocks commit 2 a step, and only
    acceptance_oracle may say so with a FAIL (the real drafter's 1.x proves nothing)."""
    from treeflash.speculative import decoder

    real = decoder.walk_tree

    def wrong_past_root(tree, post, candidates=None, options=DEFAULT):
        post = post.clone()
        post[:, 1:] = (post[:, 1:] + 1) % VOCAB
        return real(tree, post, candidates, options)

    monkeypatch.setattr(decoder, "walk_tree", wrong_past_root)
    c = doctor(rig(pair))["acceptance_oracle"]
    assert c.status == "FAIL" and "rejects correct drafts" in c.evidence, c.lines()


@pytest.mark.parametrize("tokens", [6, 24])
def test_oracle_is_judged_on_what_max_tokens_leaves(pair, tokens):
    """A run shorter than a block (6 tokens, blocks of 16) commits all it may in one step: a PASS,
    not a FAIL for "5 tokens a step of 16" (as it read before 2026-12-06)."""
    c = statuses(run_doctor(rig(pair), CONTEXT, CEILINGS, fill="prefill", tokens=tokens))["acceptance_oracle"]
    assert c.status == "PASS" and f"{tokens - 1} tokens in" in c.evidence, c.lines()


def test_metric_miscount_fails(pair):
    c = only_failure(doctor(rig(pair, decoder_factory=MiscountingDecoder)), "metric_invariants")
    assert "accepted depth" in c.evidence or "emitted" in c.evidence


def test_wrong_tap_layers_fail(pair):
    c = only_failure(doctor(rig(pair, decoder_factory=OffByOneTaps)), "tap_layers")
    assert "[0, 1]" in c.evidence and "[0, 2]" in c.evidence and "mask token" in c.evidence


def test_step_vs_floor_tells_a_growing_step_from_a_host_bound_one(pair, monkeypatch):
    """On a GPU, a step far above its floor FAILs only if it grows with context (the incident);
    a flat, host-bound step (the eager embedded pair on the H200: ~60 ms at 128 and 1024
    tokens) WARNs and points at gpu_busy instead of at the KV layout."""
    from treeflash import doctor as doc
    from treeflash.bench.sweep import DecodeRun, StepSample

    def fake_runs(ms_small, ms_big):
        def run(self, mode, context=None, drafter=None, key=None):
            ms = ms_big if (context or self.context) == self.context else ms_small
            return DecodeRun([StepSample(ms / 1e3, 1, 0, 0, None) for _ in range(6)], [], None, [])
        return run

    monkeypatch.setattr(doc.Doctor, "gpu", property(lambda self: True))
    r = rig(pair, drafter=None)
    for (small, big), status, words in [((60.0, 61.0), "WARN", "gpu_busy"),
                                         ((5.0, 400.0), "FAIL", "kv_fragmentation")]:
        monkeypatch.setattr(doc.Doctor, "run", fake_runs(small, big))
        c = doc.check_step_vs_floor(doc.Doctor(r, 4096, floors.Ceilings(4e12, 7e14, "test")))
        assert c.status == status and words in c.evidence, c



def test_step_vs_floor_extrapolates_a_preset_as_the_sweep_does(pair, monkeypatch):
    """A preset keeps a few of the real model's layers: the doctor's step and floor are the
    sweep's (`summarise`, extrapolated to the full layer count), so the fixed per-step cost
    (drafter, host) weighs as in the real model. An H200 doctor run (2026-12-03) compared the 4 kept
    layers' step with their floor and read 3x where the 61-layer sweep said 1.3x."""
    from treeflash import doctor as doc
    from treeflash.bench.sweep import DecodeRun, StepSample, summarise

    def run(self, mode, context=None, drafter=None, key=None):
        wall = 2.5e-3 if (context or self.context) == self.context else 2.4e-3
        return DecodeRun([StepSample(wall, 1, 0, 0, None, graph_s=1.3e-3) for _ in range(6)], [], None, [])

    r = rig(pair, drafter=None)
    built = floors.LayerPlan.of(r.model)
    full = floors.LayerPlan(built.total * 15, built.dense)
    monkeypatch.setattr(doc, "layer_plan", lambda rig: full)
    monkeypatch.setattr(doc.Doctor, "run", run)
    monkeypatch.setattr(doc.Doctor, "gpu", property(lambda self: True))
    d = doc.Doctor(r, 4096, floors.Ceilings(4e12, 7e14, "test"))
    c = doc.check_step_vs_floor(d)
    want = summarise(r, 4096, "off", run(d, "off").samples, d.ceilings, full, None)
    assert abs(want["ms_per_step"] - (2.5 + 1.3 * 14)) < 1e-6  # the replay scales, the rest does not
    assert f"{want['ms_per_step']:.2f} ms vs floor {want['floor_ms']:.3f} ms" in c.evidence, c
    assert f"{built.total} of {full.total} layers measured" in c.evidence, c


def test_attention_check_does_not_judge_a_latency_bound_call(pair, monkeypatch):
    """A call whose byte floor is below a call's fixed cost (the shipped pair's 12 us call against a
    0.2 us floor read "53.6x its floor: bandwidth-starved" on the H200) PASSes as latency-bound;
    the same call measured against a zero fixed cost is judged by its ratio as before."""
    from treeflash import doctor as doc

    monkeypatch.setattr(doc.Doctor, "gpu", property(lambda self: True))
    monkeypatch.setattr(doc, "device_seconds", lambda call, device: (12e-6, "CUDA graph"))
    d = doc.Doctor(rig(pair), CONTEXT, floors.Ceilings(4e12, 7e14, "H200-like"))  # floor: nanoseconds
    c = doc.check_attention_bandwidth(d)
    assert c.status == "PASS" and "latency-bound" in c.evidence, c
    monkeypatch.setattr(doc, "CALL_LATENCY_S", 0.0)
    c = doc.check_attention_bandwidth(d)
    assert c.status == "WARN" and "latency-bound" not in c.evidence, c


def test_device_seconds_on_cpu_is_the_median_wall_time():
    """`device_seconds` (the verify-attention check's timer): on CPU the median of 5 synced calls;
    on CUDA it replays a graph of the calls between events (not testable here)."""
    from treeflash.doctor import device_seconds

    calls = []
    t, how = device_seconds(lambda: calls.append(time.sleep(0.002)), torch.device("cpu"))
    assert how == "wall" and len(calls) == 5 and 0.002 <= t < 0.5


@pytest.mark.parametrize("argv, words", [
    (["--max-tokens", "0"], "--max-tokens: must be >= 1"),  # was: six checks "crashed" (FAIL)
    (["--bandwidth", "-1"], "--bandwidth: must be a finite number > 0"),  # was: "-49181816872.4% of -0 GB/s"
    (["--matmul", "nan"], "--matmul: must be a finite number > 0"),
    (["--context", "abc"], "expected token counts like 1k"),  # was: "invalid literal for int()"
    (["--context", "1k,8k"], "expected one token count"),  # was: 8k silently dropped
    (["--context", "0"], "must be >= 1"),
])
def test_bad_flags_exit_2_before_loading(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--model", "/nonexistent", *argv])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("page_size, scattered, rows", [(1, False, 64), (1, True, 1), (64, False, 64)])
def test_attention_check_times_the_layout_the_engine_reads(pair, monkeypatch, page_size, scattered, rows):
    """At page 1 the engine reads an aligned contiguous request as 64-row pages (kvcache.coarse):
    the check times the kernel on that view, and says so; scattered, on the pages as they are."""
    from treeflash import doctor as doc
    from treeflash import kernels

    seen = []
    real = kernels.mla_verify_attention
    monkeypatch.setattr(kernels, "mla_verify_attention",
                        lambda q, kv, *a, **kw: (seen.append(kv.shape[1]), real(q, kv, *a, **kw))[1])
    d = doc.Doctor(rig(pair, page_size=page_size, scattered=scattered), CONTEXT, CEILINGS)
    c = doc.check_attention_bandwidth(d)
    assert seen and set(seen) == {rows}
    assert ("read as 64-row pages" in c.evidence) == (page_size == 1 and not scattered), c.evidence


def test_kv_capacity_reports_tokens_per_gpu_in_both_formats(pair, monkeypatch):
    """kv_capacity: the device's free memory over a token's rows in every layer, in the cache's
    format and the other: fp8_e4m3 rows hold more. Too little memory for the context: WARN,
    suggesting fp8 where it would fit."""
    import treeflash.doctor as doc

    r = rig(pair)
    free = 10 << 30
    monkeypatch.setattr(doc, "free_memory", lambda device: (free, "test memory"))
    c = doc.check_kv_capacity(doc.Doctor(r, CONTEXT, CEILINGS))
    layers = r.cfg.num_hidden_layers
    auto_tokens = free // (layers * r.cfg.latent_dim * 4)  # float32 rows
    fp8_tokens = free // (layers * 64)  # D 40, v 32: 32 codes + 16 scale bytes + 16 k_pe bytes
    assert c.status == "PASS" and f"hold {auto_tokens:,} tokens (fp8_e4m3: {fp8_tokens:,}" in c.evidence
    r.kv_cache_dtype = "fp8_e4m3"
    c = doc.check_kv_capacity(doc.Doctor(r, CONTEXT, CEILINGS))
    assert c.evidence.startswith(f"KV tokens per GPU: fp8_e4m3 rows: 64 B a token a layer x {layers} layers")
    free = layers * 64 * (CONTEXT + 30)  # fp8 holds the request, float32 rows would not
    r.kv_cache_dtype = "auto"
    c = doc.check_kv_capacity(doc.Doctor(r, CONTEXT, CEILINGS))
    assert c.status == "WARN" and "--kv-cache-dtype fp8_e4m3" in c.next


@pytest.mark.parametrize("batch", [1, 16])
def test_tree_sizing_explains_the_pick_at_this_context_and_batch(pair, batch):
    """One row a bucket with the expected accepted drafts, the gain and the cost per node, the
    pick marked, off's tok/s beside: what the auto budget's rule weighs, at the batch asked."""
    from treeflash.speculative.budget import BUCKETS

    c = statuses(run_doctor(rig(pair), CONTEXT, CEILINGS, fill="prefill", tokens=24, batch=batch))["tree_sizing"]
    assert c.status == "PASS", c.lines()
    assert f"at {CONTEXT} tokens x batch {batch}, the real drafter: picks " in c.evidence
    assert "gain/node" in c.evidence and "cost/node us" in c.evidence and "off " in c.evidence
    rows = [line.split() for line in c.evidence.splitlines()[2:]]
    assert [int(r[0]) for r in rows] == list(BUCKETS)
    picked = [r for r in rows if r[-1] == "<"]
    assert len(picked) <= 1 and ("no tree" in c.evidence) == (not picked)


def test_tree_sizing_needs_ddtree(pair):
    c = statuses(run_doctor(rig(pair), CONTEXT, CEILINGS, fill="prefill", tokens=24, spec="dflash"))["tree_sizing"]
    assert c.status == "N/A"
