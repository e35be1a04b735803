"""The overlapped speculative step (speculative/overlap.py's OverlapDriver, which
speculative/decoder.py's step calls; the default on CUDA, the runtime option
overlap=0 / =1 forces it): the drafter's append masked to a count only the device knows, and the next
step's tree queued before the host has processed the step. Same tokens as the sequential
step and as spec off; a queued tree of a batch that changes is dropped without a trace; the
masked append leaves the cache the plain append leaves."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from treeflash import LLM, SamplingParams
from treeflash.engine.llm import EMBEDDED
from treeflash.models.drafter_cache import LayerKV
from treeflash.runtime import RuntimeOptions
from treeflash.speculative import overlap as overlap_driver
from treeflash.speculative.testing_drafters import OracleDrafter

pytestmark = pytest.mark.slow

BATCH_MAX_TOKENS = (40, 27, 13)  # three requests finishing at different steps, mostly mid-step


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The shipped pair, whose drafter accepts 1-4 drafts a step (so a misplaced cache row
    would show in the acceptance), and a copy of that drafter with its sliding window cut to
    4: a ring of 3 slots, smaller than the block of 16, which a step accepting 2+ drafts
    overwrites whole."""
    small = tmp_path_factory.mktemp("d") / "window4"
    shutil.copytree(EMBEDDED / "drafter", small)
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "sliding_window": 4}))
    texts = [p["text"] for p in json.loads((EMBEDDED / "heldout_prompts.json").read_text())["prompts"]]
    return {"shipped": EMBEDDED / "drafter", "window4": small}, texts[:3]


def make_llm(monkeypatch, overlap: bool, drafter=None, spec="ddtree", budget=16, **kw) -> LLM:
    monkeypatch.setattr(overlap_driver, "OVERLAP", overlap)  # read once, when the decoder is built
    kw = {"device": "cpu", "dtype": "float32", "max_running": 3, **kw}
    if spec == "off":
        return LLM(EMBEDDED / "target", spec="off", **kw)
    return LLM(EMBEDDED / "target", drafter, spec=spec, tree_budget=budget, **kw)


def run_batch(llm: LLM, texts, params: list[SamplingParams]):
    """Admit every request at once and step until all finish: the requests themselves."""
    engine = llm.engine
    reqs = [engine.add_request(llm.encode(t), p) for t, p in zip(texts, params, strict=True)]
    while engine.has_unfinished():
        engine.step()
    return reqs


def accepted(reqs) -> list[list[int]]:
    return [r.metrics["speculative_decoding"]["per_step_accepted"] for r in reqs]


class PendingLog:
    """How many next-step trees the decoder's OverlapDriver queued, and how many a step then used."""

    def __init__(self, spec):
        self.queued = self.used = 0
        driver = spec.driver
        take, queue = driver.take, driver.queue_next

        def take_pending(*args):
            pending = take(*args)
            self.used += pending is not None
            return pending

        def queue_next(*args):
            queue(*args)
            self.queued += driver.pending is not None

        driver.take, driver.queue_next = take_pending, queue_next


# ---- the masked append --------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 1, 4, 9], ids=["full", "w1-empty-ring", "w4-ring3", "w9-ring8"])
def test_masked_write_is_the_plain_append(window):
    """write_at(count=t) of a fixed block of 6 rows, then advance(t), against append() of the
    first t rows: the same valid slots, bit for bit, and the same n / head, through ring wraps,
    appends of a whole ring or more (t >= capacity) and a full layer's growth."""
    rows, g = 6, torch.Generator().manual_seed(0)
    plain = LayerKV(2, 4, window, torch.device("cpu"), torch.float32)
    masked = LayerKV(2, 4, window, torch.device("cpu"), torch.float32)
    n = 0
    for t in (1, 6, 2, 3, 5, 1, 4, 6, 6, 2, 3, 1, 5):
        k, v = torch.randn(2, 2, rows, 4, generator=g).unbind(0)
        pos = torch.arange(n, n + rows)
        plain.append(k[:, :t], v[:, :t], pos[:t])
        first = masked.reserve(rows)
        masked.write_at(torch.tensor(first), k, v, pos, count=torch.tensor(t))
        masked.advance(t)
        n += t
        assert (masked.n, masked.head) == (plain.n, plain.head)
        for x, y in zip(masked.view(), plain.view(), strict=True):
            assert torch.equal(x, y)
        assert bool((masked.full_view()[2][masked.n:] == -1).all()), "slots past n stay unused"


def test_masked_extend_is_the_plain_extend_with_one_graph_per_buffers(target, drafter_path):
    """DraftGraphs.extend_masked (block of 6 rows, count on the device) + cache.advance against
    the plain extend of the count's rows, through a sliding ring of 4 and a full layer that
    grows: the same positions in the same slots, K/V equal to rounding (a GEMM over 6 rows may
    round a row differently from one over t rows), and one entry (a graph on CUDA) per cache
    buffers, whatever the count."""
    from treeflash.speculative.draft_graphs import DraftGraphs

    llm = LLM(target, drafter_path, device="cpu", dtype="float32", page_size=8)
    drafter = llm.engine.spec.drafter
    dg = DraftGraphs(drafter, "eager")
    rows = drafter.block_size
    width = len(drafter.target_layer_ids) * llm.model.cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    plain, masked = drafter.new_cache(), drafter.new_cache()
    n = 0
    for t in (4, 1, 3, 6, 2, 5, 6, 1, 6, 6, 6, 2):
        feats = torch.randn(rows, width, generator=g)
        drafter.extend(plain, feats[:t], torch.arange(n, n + t))
        first = torch.tensor(masked.reserve(rows))
        dg.extend_masked(masked, feats, torch.tensor([n]), first, torch.tensor([t]))
        masked.advance(t)
        n += t
    assert masked.seq_len == plain.seq_len == n
    for a, b in zip(plain.layers, masked.layers, strict=True):
        assert (a.n, a.head) == (b.n, b.head)
        (ka, va, pa), (kb, vb, pb) = a.view(), b.view()
        assert torch.equal(pa, pb)
        torch.testing.assert_close(kb, ka, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vb, va, rtol=1e-5, atol=1e-5)
    assert max(layer.capacity for layer in masked.layers) > 16  # the full layer grew
    buffer_sets = {key[2] for key in dg.extend_entries}
    assert {key[0] for key in dg.extend_entries} == {"extend_masked"}
    assert len(dg.extend_entries) == len(buffer_sets) < 12


# ---- through the engine -------------------------------------------------------------------
@pytest.mark.parametrize("drafter, spec, budget", [("shipped", "ddtree", 16), ("shipped", "dflash", None),
                                                   ("window4", "ddtree", 16), ("shipped", "ddtree", "auto")])
@pytest.mark.parametrize("graphs", [False, True], ids=["no-graphs", "static-path"])
@pytest.mark.parametrize("max_running", [1, 3])
def test_overlap_gives_the_sequential_tokens_and_steps(shipped, monkeypatch, drafter, spec, budget, graphs,
                                                       max_running):
    """Three requests (max_tokens 40, 27, 13: each finishes at its own step, mostly inside
    one), one at a time or batched: the overlapped step emits spec off's greedy tokens and
    the sequential step's acceptance step by step (the same trees: the drafter saw the same
    context), gives every KV page back, and used the trees it queued."""
    drafters, texts = shipped
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in BATCH_MAX_TOKENS]
    kw = dict(cuda_graphs=graphs, max_running=max_running)
    expected = [r.output_ids for r in run_batch(make_llm(monkeypatch, False, spec="off"), texts, params)]
    seq = run_batch(make_llm(monkeypatch, False, drafters[drafter], spec, budget, **kw), texts, params)
    llm = make_llm(monkeypatch, True, drafters[drafter], spec, budget, **kw)
    assert llm.engine.spec.overlap
    log, free = PendingLog(llm.engine.spec), llm.pool.num_free_pages
    reqs = run_batch(llm, texts, params)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in seq] == expected
    assert llm.pool.num_free_pages == free
    assert all("invariant_error" not in r.metrics["speculative_decoding"] for r in reqs)
    assert log.used > 0 and log.used <= log.queued
    if budget != "auto":  # auto's budgets follow measured step times
        assert accepted(reqs) == accepted(seq)
        steps = [a for per_request in accepted(reqs) for a in per_request]
        assert sum(steps) > len(steps) / 2, "the drafter accepts, so a misplaced cache row would show"


def test_a_request_stopping_mid_batch_drops_the_queued_tree(shipped, monkeypatch):
    """A stop string ends a request at a step whose next tree is already queued (the host
    learns of the stop only after queuing it): that tree is dropped, the other requests and a
    later request on the same engine go on exactly as with the sequential step."""
    drafters, texts = shipped
    off = make_llm(monkeypatch, False, spec="off")
    text = off.generate(texts[0], SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    stop = text[len(text) // 2:][:3]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]),
              SamplingParams(max_tokens=33, ignore_eos=True), SamplingParams(max_tokens=25, ignore_eos=True)]
    runs = {}
    for overlap in (False, True):
        llm = make_llm(monkeypatch, overlap, drafters["shipped"])
        log = PendingLog(llm.engine.spec) if overlap else None  # the sequential step has no driver
        reqs = run_batch(llm, texts, params)
        later = llm.generate(texts[2], SamplingParams(max_tokens=30, ignore_eos=True))[0]
        runs[overlap] = ([(r.output_ids, r.text, r.finish_reason) for r in reqs], accepted(reqs),
                         later.token_ids, log)
    assert runs[True][0][0][2] == "stop" and stop in text
    assert runs[True][:3] == runs[False][:3]
    log = runs[True][3]
    assert log.queued > log.used > 0, "a queued tree was dropped"
    assert runs[True][2] == off.generate(texts[2], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids


def test_sampling_draws_what_the_sequential_step_draws(shipped, monkeypatch):
    """Seeded sampling requests in a batch: the overlapped step builds the same trees, so each
    request's generator makes the same draws (the target's own distribution either way)."""
    drafters, texts = shipped
    params = [SamplingParams(max_tokens=m, temperature=0.8, top_p=0.9, seed=s)
              for m, s in zip(BATCH_MAX_TOKENS, (3, 5, 7), strict=True)]
    seq = run_batch(make_llm(monkeypatch, False, drafters["shipped"]), texts, params)
    ovl = run_batch(make_llm(monkeypatch, True, drafters["shipped"]), texts, params)
    assert [r.output_ids for r in ovl] == [r.output_ids for r in seq]
    assert accepted(ovl) == accepted(seq)


def test_the_flag_and_drafters_that_count_on_the_host(target, monkeypatch):
    """On CUDA by default, off on the CPU; the runtime option overlap=0 / =1 forces it off / on anywhere;
    a drafter that keeps its counts on the host (the test drafters) keeps the sequential step
    whatever the flag says."""
    monkeypatch.setattr(overlap_driver, "OVERLAP", None)
    assert overlap_driver.overlap_enabled("cuda") and not overlap_driver.overlap_enabled("cpu")
    assert not overlap_driver.overlap_enabled("cuda", RuntimeOptions.parse(["overlap=0"]))
    assert overlap_driver.overlap_enabled("cpu", RuntimeOptions.parse(["overlap=1"]))
    assert overlap_driver.overlap_enabled("cuda", RuntimeOptions.parse(["overlap=auto"]))
    shipped = LLM(EMBEDDED / "target", EMBEDDED / "drafter", spec="ddtree", tree_budget=4, device="cpu",
                  dtype="float32", runtime_options=RuntimeOptions(overlap=True))
    assert shipped.engine.spec.overlap  # handed to the decoder by LLM
    monkeypatch.setattr(overlap_driver, "OVERLAP", False)
    assert not overlap_driver.overlap_enabled()
    monkeypatch.setattr(overlap_driver, "OVERLAP", True)
    oracle = OracleDrafter(96, 6, sequences=[[3, 4, 5]])
    llm = LLM(target, oracle, spec="ddtree", tree_budget=4, device="cpu", dtype="float32")
    assert not llm.engine.spec.overlap
