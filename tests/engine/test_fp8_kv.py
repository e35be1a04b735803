"""The engine over an fp8_e4m3 KV cache (`LLM(kv_cache_dtype="fp8_e4m3")`): speculation stays
lossless relative to plain decode under the same cache (greedy tokens equal, every drafter,
page 8 and page 1 read coarse, the static-buffer path, the Triton kernels under the
interpreter), and the cache's logits stay close to the model dtype's."""

from __future__ import annotations

import pytest
import torch

from helpers.spec import VOCAB, prompts
from treeflash import LLM, SamplingParams
from treeflash.speculative.testing_drafters import AdversarialDrafter, OracleDrafter, RandomDrafter

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def fp8_llm(target, drafter=None, spec=None, budget=None, page_size=8, **kw):
    return LLM(target, drafter, spec=spec, tree_budget=budget, device="cpu", dtype="float32",
               page_size=page_size, kv_cache_dtype="fp8_e4m3", **kw)


@pytest.fixture(scope="module")
def fp8_reference(target):
    """Greedy outputs of plain decode over the fp8 cache (what every speculative run must give)."""
    llm = fp8_llm(target)
    assert llm.pool.kv.dtype == torch.uint8 and llm.pool.kv.shape[-1] == 64  # D 40, v 32: 32 + 16 + 16
    ps = prompts()
    return ps, [o.token_ids for o in llm.generate(ps, GREEDY)]


@pytest.mark.slow
@pytest.mark.parametrize("spec, budget", [("ddtree", 4), ("ddtree", 16), ("ddtree", 64), ("dflash", None)])
@pytest.mark.parametrize("kind", ["random", "adversarial", "oracle", "real"])
def test_speculation_is_lossless_under_the_fp8_cache(target, drafter_path, fp8_reference, spec, budget, kind):
    ps, expected = fp8_reference
    seqs = [p + e for p, e in zip(ps, expected)]
    drafter = {
        "random": lambda: RandomDrafter(VOCAB, 6, seed=1, target_layer_ids=(0, 2)),
        "adversarial": lambda: AdversarialDrafter(VOCAB, 6, seed=2, sequences=seqs, target_layer_ids=(0,)),
        "oracle": lambda: OracleDrafter(VOCAB, 6, sequences=seqs, target_layer_ids=(1,)),
        "real": lambda: drafter_path,
    }[kind]()
    llm = fp8_llm(target, drafter, spec, budget, page_size=1 if budget == 4 else 8)
    free = llm.pool.num_free_pages
    outs = llm.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.pool.num_free_pages == free
    if kind == "oracle":  # the commit moved the accepted rows: full acceptance all along
        m = outs[0].metrics["speculative_decoding"]
        assert all(a == 5 for a in m["per_step_accepted"][:-1]) or budget == 4


@pytest.mark.slow
def test_static_buffer_path_is_token_identical(target, drafter_path, fp8_reference):
    """The CUDA-graph code path (static buffers, scratch pages), run eagerly on the CPU."""
    ps, expected = fp8_reference
    llm = fp8_llm(target, drafter_path, "ddtree", 16, cuda_graphs=True)
    assert llm.engine.executor.graphs is not None
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == expected


@pytest.mark.slow
def test_triton_kernels_under_the_interpreter(target, drafter_path, monkeypatch):
    """attention_impl="triton": the fused prep's fp8 store, the fp8 verify kernels and the byte
    commit, speculative against plain decode over the same kernels."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ps = prompts(1)
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    plain = fp8_llm(target, attention_impl="triton").generate(ps, params)
    spec = fp8_llm(target, drafter_path, "ddtree", 4, attention_impl="triton").generate(ps, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_fp8_logits_are_the_model_dtype_cache_holding_the_decoded_rows(target, monkeypatch):
    """Teacher-forced logits over the fp8 cache equal, bit for bit, those of the float32 cache
    whose writes store each row quantised and decoded (`kvcache.format`): the fp8 cache changes
    nothing but the rows' values. (How far those values move the logits: the accuracy table,
    `benchmarks/fp8_kv_accuracy.py`.)"""
    from treeflash import kernels
    from treeflash.kvcache.format import dequantize_rows, quantize_rows

    ids = prompts(1, seed=3)[0] + list(range(2, 40))
    fp8 = fp8_llm(target).score(ids)
    write = kernels.kv_write

    def decoded_write(kv_cache, page_table, start_lens, latents, impl=None, v_dim=None):
        rows = dequantize_rows(quantize_rows(latents, v_dim), latents.shape[-1], v_dim, latents.dtype)
        return write(kv_cache, page_table, start_lens, rows, impl=impl, v_dim=v_dim)

    monkeypatch.setattr(kernels, "kv_write", decoded_write)
    decoded = LLM(target, device="cpu", dtype="float32", page_size=8).score(ids)
    assert torch.equal(fp8, decoded)
    monkeypatch.setattr(kernels, "kv_write", write)
    auto = LLM(target, device="cpu", dtype="float32", page_size=8).score(ids)
    assert not torch.equal(fp8, auto)  # lossy: the cache did hold fp8 rows


def test_refused_names_and_the_pool(target):
    with pytest.raises(ValueError, match="fp8_e5m2 is not implemented"):
        LLM(target, device="cpu", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="model's dtype is float32"):
        LLM(target, device="cpu", dtype="float32", kv_cache_dtype="bfloat16")
    llm = fp8_llm(target)
    assert llm.kv_cache_dtype == "fp8_e4m3" and llm.pool.format.label == "fp8_e4m3"
    assert llm.pool.bytes_per_token == 3 * 64 and llm.pool.dtype == torch.float32
    assert LLM(target, device="cpu", dtype="float32", kv_cache_dtype="float32").pool.format.name == "auto"


@pytest.mark.slow
@pytest.mark.parametrize("spec, budget", [("ddtree", 8), ("dflash", None)])
def test_scattered_fp8_pool_is_lossless(target, drafter_path, fp8_reference, spec, budget):
    """The scattered mode (page 1, pages shuffled over the pool: every batch read page by page)
    over fp8 rows: tree and chain speculation give plain decode's tokens of the page-8 fp8 pool."""
    ps, expected = fp8_reference
    llm = fp8_llm(target, drafter_path, spec, budget, page_size=1, scattered_kv=True)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == expected


@pytest.mark.slow
@pytest.mark.parametrize("spec, pages", [("off", 24), ("ddtree", 32)])
def test_a_request_moved_by_defragmentation_keeps_its_fp8_rows(target, drafter_path, spec, pages):
    """D is admitted in two pieces (the pool's end and A's freed pages); once B and C finish the
    engine moves it into one run (the pages' bytes, every layer) between steps, and its output
    (plain, or tree speculation whose commits then land in the moved pages) is that of D decoded
    alone. A request holds prompt + max_tokens + verify width (1, or budget 8 + root) tokens in
    pages of 4: 4 + 6 + 8 of 24 pages plain, 6 + 8 + 10 of 32 under the tree; D 8 or 10."""
    from treeflash.kvcache.defrag import is_contiguous

    tree = spec == "ddtree"
    llm = fp8_llm(target, drafter_path if tree else None, spec, 8 if tree else None,
                  page_size=4, kv_cache_tokens=4 * pages, max_model_len=64)
    engine, pool = llm.engine, llm.pool
    greedy = {n: SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 8, 11, 23)}
    a, b, c = (engine.add_request([5 + i] * n, greedy[m]) for i, (n, m) in enumerate([(10, 2), (12, 8), (20, 11)]))
    while not a.finished:
        engine.step()
    d_prompt = [9, 3, 7, 7, 2, 8, 4, 6]
    d = engine.add_request(d_prompt, greedy[23])
    engine.step()
    assert not is_contiguous(d.pages)
    while not (b.finished and c.finished):
        engine.step()
    assert not d.finished and is_contiguous(d.pages)
    while engine.has_unfinished():
        engine.step()
    assert pool.num_free_pages == pool.num_pages
    assert d.output_ids == llm.generate(d_prompt, greedy[23])[0].token_ids
