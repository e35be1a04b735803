"""The static-buffer (CUDA graph) path, run eagerly on the CPU: same tokens as the plain path,
padding rows confined to scratch pages, buffers rewritten in place, one entry per shape."""

from __future__ import annotations

import pytest
import torch

from helpers.spec import VOCAB
from treeflash import LLM, SamplingParams
from treeflash.engine.graphs import GraphKey, batch_buckets, bucket, page_bucket
from treeflash.speculative.testing_drafters import OracleDrafter


def test_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(64) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    assert batch_buckets(10)[-1] == 10 and bucket(5, batch_buckets(10)) == 6
    assert [page_bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    with pytest.raises(ValueError):
        bucket(11, batch_buckets(10))


@pytest.mark.slow
@pytest.mark.parametrize("spec, budget", [("off", None), ("ddtree", 8), ("dflash", None), ("ddtree", "auto")])
@pytest.mark.parametrize("page_size", [1, 8])
def test_static_path_is_token_identical(target, drafter_path, reference, spec, budget, page_size):
    ps, expected = reference
    kw = dict(device="cpu", dtype="float32", page_size=page_size, cuda_graphs=True, max_running=4)
    if spec == "off":
        llm = LLM(target, spec="off", **kw)
    else:
        llm = LLM(target, drafter_path, spec=spec, tree_budget=budget, **kw)
    graphs = llm.engine.executor.graphs
    assert graphs is not None and graphs.mode == "eager"  # CPU: the same buffers, no capture
    free = llm.pool.num_free_pages
    outs = llm.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert llm.pool.num_free_pages == free
    keys = set(graphs.steps)
    assert keys, "decode/verify went through the static buffers"
    assert all(k.batch in graphs.buckets and k.batch >= 1 for k in keys)
    # Three prompts, admitted together, finish together: batch 3 is a bucket of its own.
    assert any(k.batch == 3 for k in keys)


def test_padding_rows_stay_in_scratch_pages(target, reference):
    """Batch 3 served from a bucket of 4 (max_running 5): the padded row writes only scratch
    pages; NaN everywhere else unowned would otherwise leak into the tokens."""
    ps, expected = reference
    seqs = [p + e for p, e in zip(ps, expected)]
    llm = LLM(target, OracleDrafter(VOCAB, 6, sequences=seqs), spec="ddtree", tree_budget=4,
              device="cpu", dtype="float32", page_size=4, cuda_graphs=True, max_running=5)
    graphs = llm.engine.executor.graphs
    assert graphs.buckets == (1, 2, 3, 4, 5)
    graphs.buckets = (1, 2, 4, 5)  # force padding: 3 live requests in a bucket of 4
    scratch = list(graphs.scratch_pages)
    used: set[int] = set()
    release = llm.pool.release
    llm.pool.release = lambda pages: (used.update(pages), release(pages))[-1]
    llm.pool.kv.fill_(float("nan"))  # poison: every row a request reads, it wrote first
    outs = llm.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert any(k.batch == 4 for k in graphs.steps)
    written = set(torch.nonzero(~llm.pool.kv.isnan().flatten(2).all(-1).all(0)).flatten().tolist())
    assert written & set(scratch), "padding rows write their latents into the scratch pages"
    assert written <= used | set(scratch), "nothing outside requests' and scratch pages is written"


def test_buffers_are_rewritten_in_place(target, drafter_path, reference):
    ps, expected = reference
    llm = LLM(target, drafter_path, spec="ddtree", tree_budget=8, device="cpu", dtype="float32",
              page_size=8, cuda_graphs=True, max_running=4)
    graphs = llm.engine.executor.graphs
    llm.generate(ps[:1], SamplingParams(max_tokens=6, ignore_eos=True))
    first = next(iter(graphs.steps))
    assert first.factor == 8  # page 8, each request in aligned runs: read as 64-row pages
    key = GraphKey(1, 9, True, (0, 2), first.pages, first.factor)
    step = graphs.steps[key]
    ptrs = [t.data_ptr() for t in (step.ids, step.positions, step.page_table, step.prefix_lens, step.mask)]
    out = llm.generate(ps[:1], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == expected[0][:12]
    same = graphs.steps.get(key)
    if same is step:  # same page bucket: the very same buffers, rewritten
        assert ptrs == [t.data_ptr() for t in (step.ids, step.positions, step.page_table,
                                                step.prefix_lens, step.mask)]
    # Tree positions are start + depth, written each step (never the capture's).
    assert bool((step.positions[0] >= step.prefix_lens[0]).all())


def test_graphs_refused_under_tensor_parallelism():
    from treeflash.engine.executor import LocalExecutor

    class Sub(LocalExecutor):
        pass

    ex = Sub.__new__(Sub)
    with pytest.raises(ValueError, match="tensor parallelism"):
        ex.enable_graphs("eager", max_rows=2, max_batch=2)


@pytest.mark.slow
@pytest.mark.parametrize("spec, budget", [("ddtree", 8), ("dflash", None), ("ddtree", "auto")])
def test_batch1_draft_graph_path_is_token_identical(target, drafter_path, reference, spec, budget):
    """One request at a time: the drafter proposes over its cache at full capacity (unused
    slots masked) and the tree is built from static inputs (speculative/draft_graphs.py), through a
    sliding window of 5 that wraps and a full-attention cache that grows."""
    ps, expected = reference
    llm = LLM(target, drafter_path, spec=spec, tree_budget=budget, device="cpu", dtype="float32",
              page_size=8, cuda_graphs=True, max_running=1)
    dg = llm.engine.spec.draft_graphs
    assert dg is not None and dg.mode == "eager"
    runs = [llm.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))[0] for p in ps]
    assert [o.token_ids for o in runs] == expected
    assert dg.entries and all(e.replays > 0 for e in dg.entries.values())
    if budget == "auto":
        return  # its budgets follow measured step times, so the acceptance sequence may differ
    # Lossless either way, so also compare what was accepted step by step: same proposals.
    plain = LLM(target, drafter_path, spec=spec, tree_budget=budget, device="cpu", dtype="float32",
                page_size=8, max_running=1)
    for p, o in zip(ps, runs):
        ref = plain.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))[0]
        key = "per_step_accepted"
        assert o.metrics["speculative_decoding"][key] == ref.metrics["speculative_decoding"][key]


@pytest.mark.slow
def test_pooled_cache_buffers_replay_the_same_graphs(target, drafter_path, reference):
    """A finished request's drafter buffers serve the next one (KVBufferPool): the next
    request meets the same buffers at each capacity, so no draft graph is captured again,
    and the stale K/V a pooled buffer still holds changes nothing (masked by pos -1)."""
    ps, expected = reference
    llm = LLM(target, drafter_path, spec="ddtree", tree_budget=8, device="cpu", dtype="float32",
              page_size=8, cuda_graphs=True, max_running=1)
    dg = llm.engine.spec.draft_graphs
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    first = llm.generate(ps[0], params)[0]
    llm.generate(ps[1], params)  # leaves its own K/V in the pooled buffers
    keys, extend_keys = set(dg.entries), set(dg.extend_entries)
    again = llm.generate(ps[0], params)[0]
    assert again.token_ids == first.token_ids == expected[0]
    key = "per_step_accepted"
    assert again.metrics["speculative_decoding"][key] == first.metrics["speculative_decoding"][key]
    assert set(dg.entries) == keys and set(dg.extend_entries) == extend_keys


@pytest.mark.slow
def test_warmup_captures_every_plan_at_every_batch_and_teaches_no_walk(target, drafter_path, reference):
    """LLM.warmup(max_batch=4) runs throw-away batches of 1..4 requests through every plan auto
    may run (each bucket built as itself and wide, plain steps with the drafter's taps): every
    verify graph of those batch sizes, every draft graph (a scoring build too) and every tail
    graph exist before the first real request; each plan's step is priced, no walk is learnt;
    the real requests' tokens are unchanged and capture nothing new."""
    ps, expected = reference
    llm = LLM(target, drafter_path, spec="ddtree", tree_budget="auto", device="cpu", dtype="float32",
              page_size=8, cuda_graphs=True, max_running=4)
    spec = llm.engine.spec
    assert llm.warmup(max_tokens=24, max_batch=4) > 0  # (3 steps a plan of at most 6 tokens each)
    assert llm.last_warmup["rounds"] == len(spec.warmup_plans)  # (the long prompt's round: batch 1)
    assert spec.forced_budget is None and spec.forced_build is None
    sizer = spec.sizer
    assert sizer.decisions == 0 and sizer.calibration.observations == 0 and not sizer.learner.pending
    assert all(sizer.cost.priced(k) for k in (0, *spec.candidates))  # every plan's step has a price
    top = spec.candidates[-1]
    dg = spec.draft_graphs.entries
    assert {k[1] for k in dg} == set(spec.candidates)
    assert any(k[1] == top and k[3] == () for k in dg)  # the scoring build, into its own buffers
    graphs = llm.engine.executor.graphs
    rows = {1, *(b + 1 for b in spec.candidates)}
    assert {(k.batch, k.rows) for k in graphs.steps} >= {(b, r) for b in (1, 2, 3, 4) for r in rows}
    assert any(k.rows == 1 and k.taps == spec.tap_layers for k in graphs.steps)  # the plain step, tapped
    tails = spec.tail_graphs.entries
    assert {k[1] for k in tails} == set(spec.candidates)
    assert all(e.uses >= 2 for e in tails.values()), [(k[:6], e.uses) for k, e in tails.items() if e.uses < 2]
    verify_keys = set(graphs.steps)
    outs = [llm.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))[0] for p in ps]
    assert [o.token_ids for o in outs] == expected
    assert sizer.decisions > 0
    assert set(graphs.steps) == verify_keys  # (the real requests' page tables: the short round's bucket)


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["auto", 8])
def test_no_graph_is_captured_after_the_warmup(target, drafter_path, reference, monkeypatch, budget):
    """Overlapped (the CUDA default), after LLM.warmup at the served max tokens, requests of
    similar lengths capture nothing: every verify, draft, append and tail graph their steps use
    (any plan auto picks, plain steps included) exists already, and the drafter caches, sized
    for prompt + max tokens, never grow mid-stream (a new capacity: new draft graphs). Counted
    where CUDA would capture (`graph_captures`); on the CPU graphs run eagerly."""
    from treeflash.graph_capture import graph_captures
    from treeflash.speculative import overlap as overlap_driver

    monkeypatch.setattr(overlap_driver, "OVERLAP", True)
    ps, expected = reference
    llm = LLM(target, drafter_path, spec="ddtree", tree_budget=budget, device="cpu", dtype="float32",
              page_size=8, cuda_graphs=True, max_running=4)
    assert llm.engine.spec.overlap
    llm.warmup(max_tokens=24, max_batch=1)
    before = graph_captures()
    assert before > 0
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = [llm.generate(p, params)[0] for p in ps if len(p) <= 24]  # (the warm-up's short prompt: 24)
    assert outs and [o.token_ids for o in outs] == [e for p, e in zip(ps, expected) if len(p) <= 24]
    assert graph_captures() == before
    if budget == "auto":
        sd = [o.metrics["speculative_decoding"] for o in outs]
        assert sum(s["num_spec_steps"] for s in sd) > 0


def test_static_proposal_equals_the_plain_one(target, drafter_path):
    """propose(static=True) reads every slot (pos -1 masked) and must give the same logits as
    propose() over the valid slots, before and after the full layer's buffer grows and the
    sliding ring wraps."""
    llm = LLM(target, drafter_path, device="cpu", dtype="float32", page_size=8)
    drafter = llm.engine.spec.drafter
    cache = drafter.new_cache()
    width = len(drafter.target_layer_ids) * llm.model.cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    n = 0
    for t in (3, 1, 7, 2, 20, 1):
        drafter.extend(cache, torch.randn(t, width, generator=g), torch.arange(n, n + t))
        n += t
        bonus, start = torch.tensor([5]), torch.tensor([n])
        plain = drafter.propose([cache], bonus, start)
        static = drafter.propose([cache], bonus, start, static=True)
        torch.testing.assert_close(static, plain, rtol=1e-5, atol=1e-5)
    assert max(layer.capacity for layer in cache.layers) > 16  # the full layer grew
    with pytest.raises(ValueError, match="one request"):
        drafter.propose([cache, cache], torch.tensor([5, 5]), torch.tensor([n, n]), static=True)


@pytest.mark.slow
def test_a_failed_draft_capture_falls_back_to_eager_proposals(target, drafter_path, reference, monkeypatch):
    """If capture raises (an op that syncs, say), the step still completes from the static
    path, later steps propose eagerly, and the reason is kept."""
    from treeflash.speculative.draft_graphs import DraftGraphs

    ps, expected = reference
    llm = LLM(target, drafter_path, spec="ddtree", tree_budget=8, device="cpu", dtype="float32",
              page_size=8, cuda_graphs=True, max_running=1)
    dg = llm.engine.spec.draft_graphs
    dg.mode = "cuda"  # pretend, and make the capture fail

    def boom(self, *a):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DraftGraphs, "_capture", boom)
    out = llm.generate(ps[0], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert out.token_ids == expected[0]
    assert "not permitted" in dg.failure and not dg.handles([object()])


def test_graphs_default_on_for_one_cuda_device_only(target):
    llm = LLM(target, device="cpu", dtype="float32")
    assert llm.cuda_graphs is False and llm.engine.executor.graphs is None
    with pytest.raises(ValueError, match="tp=1"):
        LLM(target, device="cpu", dtype="float32", cuda_graphs=True, tp=2)


def test_static_extend_leaves_the_cache_as_the_plain_append_does(target, drafter_path):
    """DraftGraphs.extend writes slots from device indices (capturable) and keeps n / head /
    seq_len on the host; through ring wraps and a full layer's growth the cache must equal
    one built by the plain extend, buffer for buffer."""
    from treeflash.speculative.draft_graphs import DraftGraphs

    llm = LLM(target, drafter_path, device="cpu", dtype="float32", page_size=8)
    drafter = llm.engine.spec.drafter
    dg = DraftGraphs(drafter, "eager")
    width = len(drafter.target_layer_ids) * llm.model.cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    plain, static = drafter.new_cache(), drafter.new_cache()
    n = 0
    for t in (4, 1, 3, 6, 2, 5, 6, 1, 6, 6, 6):
        feats = torch.randn(t, width, generator=g)
        drafter.extend(plain, feats, torch.arange(n, n + t))
        dg.extend(static, feats, n)
        n += t
    assert static.seq_len == plain.seq_len == n
    for a, b in zip(plain.layers, static.layers):
        assert (a.n, a.head, a.capacity) == (b.n, b.head, b.capacity)
        for x, y in zip(a.full_view(), b.full_view()):
            assert torch.equal(x, y)
    assert max(layer.capacity for layer in static.layers) > 16  # grew on the host
    assert sum(e.uses for e in dg.extend_entries.values()) >= 1


def _recorded_rows(llm) -> list[list[int]]:
    """Every packed row the decoder copies to the host (SpecDecoder._to_host), in order."""
    spec, rows = llm.engine.spec, []
    to_host = spec._to_host
    spec._to_host = lambda packed, *a: (rows.append(packed.tolist()), to_host(packed, *a))[-1]
    return rows


def _run_tail(target, drafter_path, ps, spec, budget, page_size, graphs):
    llm = LLM(target, drafter_path, spec=spec, tree_budget=budget, device="cpu", dtype="float32",
              page_size=page_size, cuda_graphs=graphs, max_running=1)
    rows = _recorded_rows(llm)
    outs = [llm.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))[0] for p in ps]
    return llm, outs, rows


def _accepted(outs) -> list[list[int]]:
    return [o.metrics["speculative_decoding"]["per_step_accepted"] for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("spec, budget", [("ddtree", 8), ("dflash", None)])
@pytest.mark.parametrize("page_size", [1, 8])
def test_batch1_greedy_tail_is_token_and_row_identical(target, drafter_path, reference, spec, budget, page_size,
                                                       monkeypatch):
    """The greedy tail of a batch-1 step (speculative/tail_graphs.py) over the static buffers: its
    keys repeat step after step (else a graph would never replay), and the tokens, the
    per-step acceptance and every packed host row equal the plain path's, through a sliding
    window of 5 that wraps, a full-attention cache that grows (not sized for the request up
    front here, as a cache made outside the engine's prefill is not) and prompts over several pages."""
    from treeflash.models.drafter import LayerKV

    monkeypatch.setattr(LayerKV, "presize", lambda self, rows: None)
    ps, expected = reference
    llm, outs, rows = _run_tail(target, drafter_path, ps, spec, budget, page_size, True)
    plain, ref_outs, ref_rows = _run_tail(target, drafter_path, ps, spec, budget, page_size, False)
    tg = llm.engine.spec.tail_graphs
    assert plain.engine.spec.tail_graphs is None  # off unless graphs are on
    assert tg is not None and tg.mode == "eager" and tg.failure is None
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs] == expected
    assert _accepted(outs) == _accepted(ref_outs)
    assert rows == ref_rows
    assert sum(e.uses for e in tg.entries.values()) == len(rows), "every step took the tail"
    assert max(e.uses for e in tg.entries.values()) > 4, "keys repeat: a graph would replay"
    caps = {tuple(layer[3] for layer in key[2]) for key in llm.engine.spec.draft_graphs.entries}
    assert len(caps) > 1 and len(tg.entries) >= len(caps), "the full layer grew: new buffers, new keys"


def _fake_capture(pool):
    """A stand-in for a CUDA graph on the CPU: capture leaves no trace (the KV pool is put
    back; a real capture runs nothing), replay re-runs the captured function over whatever
    its input tensors hold now and writes into the captured outputs, as a replay does."""

    def capture(self, entry, fn, device):
        kv = pool.kv.clone()
        entry.out = fn()
        pool.kv.copy_(kv)

        class Replay:
            def replay(self):
                for dst, src in zip(entry.out, fn(), strict=True):
                    dst.copy_(src)

        entry.graph = Replay()
        self.captures += 1

    return capture


@pytest.mark.slow
@pytest.mark.parametrize("spec, budget", [("ddtree", 8), ("dflash", None), ("ddtree", "auto")])
def test_replayed_tail_reads_the_live_buffers(target, drafter_path, reference, monkeypatch, spec, budget):
    """Capture at a key's second use, then replays that re-run the captured step's function:
    right only if every input it closed over is a static buffer rewritten in place (verify
    outputs, tree, page table) and the decoder reads the replay's outputs."""
    from treeflash.speculative.tail_graphs import TailGraphs

    ps, expected = reference
    llm = LLM(target, drafter_path, spec=spec, tree_budget=budget, device="cpu", dtype="float32",
              page_size=4, cuda_graphs=True, max_running=1)
    tg = llm.engine.spec.tail_graphs
    tg.mode = "cuda"  # only the tail pretends; verify and draft stay on their eager static path
    monkeypatch.setattr(TailGraphs, "_capture", _fake_capture(llm.pool))
    rows = _recorded_rows(llm)
    outs = [llm.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))[0] for p in ps]
    assert [o.token_ids for o in outs] == expected
    assert tg.failure is None and tg.captures >= 1
    replays = sum(e.replays for e in tg.entries.values())
    if budget == "auto":  # its plans follow measured step times: several keys, some plain steps
        assert replays >= 1
        return
    assert replays > len(rows) // 2
    _, ref_outs, ref_rows = _run_tail(target, drafter_path, ps, spec, budget, 4, False)
    assert _accepted(outs) == _accepted(ref_outs) and rows == ref_rows


@pytest.mark.slow
def test_a_failed_tail_capture_falls_back_to_the_eager_tail(target, drafter_path, reference, monkeypatch):
    """A capture that raises: that step still walks and commits once (eagerly), later steps
    take the eager tail, the reason is kept, and the rows equal the plain path's."""
    from treeflash.speculative.tail_graphs import TailGraphs

    ps, expected = reference
    llm = LLM(target, drafter_path, spec="ddtree", tree_budget=8, device="cpu", dtype="float32",
              page_size=8, cuda_graphs=True, max_running=1)
    tg = llm.engine.spec.tail_graphs
    tg.mode = "cuda"

    def boom(self, *a):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(TailGraphs, "_capture", boom)
    rows = _recorded_rows(llm)
    outs = [llm.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))[0] for p in ps]
    assert [o.token_ids for o in outs] == expected
    assert "not permitted" in tg.failure and not tg.entries and tg.captures == 0
    _, ref_outs, ref_rows = _run_tail(target, drafter_path, ps, "ddtree", 8, 8, False)
    assert _accepted(outs) == _accepted(ref_outs) and rows == ref_rows


@pytest.mark.slow
def test_sampling_steps_keep_the_eager_tail(target, drafter_path, reference):
    """A sampling request never enters the tail graphs (its draws come from its own
    generator) and draws what the same seed draws without graphs; a greedy request on the
    same engine afterwards does enter them."""
    ps, expected = reference
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, seed=3, ignore_eos=True)
    kw = dict(spec="ddtree", tree_budget=8, device="cpu", dtype="float32", page_size=8, max_running=1)
    llm = LLM(target, drafter_path, cuda_graphs=True, **kw)
    tg = llm.engine.spec.tail_graphs
    sampled = llm.generate(ps[0], sp)[0]
    assert not tg.entries
    ref = LLM(target, drafter_path, **kw).generate(ps[0], sp)[0]
    assert sampled.token_ids == ref.token_ids
    assert llm.generate(ps[0], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids == expected[0]
    assert tg.entries


@pytest.mark.slow
@pytest.mark.parametrize("spec, budget", [("ddtree", 8), ("dflash", None)])
def test_the_draft_tree_lands_in_the_verify_inputs(target, drafter_path, reference, monkeypatch, spec, budget):
    """The draft graph's build writes the tree's tokens, positions, mask and the int32 prefix
    lengths straight into the verify forward's static inputs (StepInputs): the verify step
    copies none of them, and the tokens are still the target's greedy text."""
    from treeflash.engine import graphs as graphs_mod

    seen = []
    real = graphs_mod.same_buffers
    monkeypatch.setattr(graphs_mod, "same_buffers", lambda dst, src: seen.append(real(dst, src)) or seen[-1])
    ps, expected = reference
    llm = LLM(target, drafter_path, spec=spec, tree_budget=budget, device="cpu", dtype="float32",
              page_size=8, cuda_graphs=True, max_running=1)
    outs = [llm.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))[0] for p in ps[:2]]
    assert [o.token_ids for o in outs] == expected[:2]
    assert seen and all(seen), f"{seen.count(False)} of {len(seen)} verify inputs were copied"
    inputs = llm.engine.executor.graphs.inputs
    trees = [e.tree for e in llm.engine.spec.draft_graphs.entries.values()]
    assert trees and all(any(t.tokens.data_ptr() == i.ids.data_ptr() for i in inputs.values()) for t in trees)
