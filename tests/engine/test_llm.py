"""LLM API: paged path equals dense, pages come back, sampling is seeded, bad input is refused."""

from __future__ import annotations

import pytest
import torch

from helpers.hf_checkpoints import add_tokenizer, write_checkpoint
from treeflash import LLM, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", q_lora_rank=24)
    add_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, device="cpu", dtype="float32", page_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(2, 90, (70,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.slow
def test_paged_equals_dense_for_any_chunk_and_page_size(ckpt, ids):
    dense = LLM(ckpt, device="cpu", dtype="float32", page_size=256).score(ids, chunk_size=len(ids))
    for page_size in (1, 16, 64):
        llm = LLM(ckpt, device="cpu", dtype="float32", page_size=page_size)
        for chunk in (1, 7, 64):
            torch.testing.assert_close(llm.score(ids, chunk_size=chunk), dense, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_scattered_pages_give_the_same_logits(ckpt, ids):
    ref = LLM(ckpt, device="cpu", dtype="float32", page_size=4).score(ids)
    scattered = LLM(ckpt, device="cpu", dtype="float32", page_size=1, scattered_kv=True)
    torch.testing.assert_close(scattered.score(ids, chunk_size=5), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_no_page_leak_after_100_requests(llm, ids):
    free0 = llm.pool.num_free_pages
    prompts = [ids[: 3 + i % 40] for i in range(100)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(len(o.token_ids) == 3 for o in outs)
    assert llm.pool.num_free_pages == free0


@pytest.mark.slow
def test_batched_greedy_equals_one_at_a_time(llm, ids):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [ids[:5], ids[10:31], ids[40:41]]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    assert together == alone


@pytest.mark.slow
def test_sampling_same_seed_same_output(llm, ids):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=20, seed=7, ignore_eos=True)
    a = llm.generate(ids[:8], p)[0].token_ids
    b = llm.generate(ids[:8], p)[0].token_ids
    c = llm.generate(ids[:8], SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True))
    assert a == b
    assert a != c[0].token_ids


def test_text_prompt_and_stop_string(llm):
    out = llm.generate("def f(x):", SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert isinstance(out.text, str) and len(out.token_ids) == 20
    assert out.finish_reason == "length"
    if len(out.text) > 3:
        stop = out.text[2:4]
        cut = llm.generate("def f(x):", SamplingParams(max_tokens=20, stop=[stop], ignore_eos=True))[0]
        assert cut.finish_reason == "stop"
        assert stop not in cut.text and out.text.startswith(cut.text)


@pytest.mark.slow
def test_eos_finishes(llm, ids):
    out = llm.generate(ids[:5], SamplingParams(max_tokens=64))[0]
    assert out.finish_reason in ("stop", "length")
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == 1


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(stop=["x"] * 100), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(seed=2**70), "seed"),  # was torch's "Overflow when unpacking long long" at the first step
    ],
)
def test_invalid_sampling_params(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([5, 96, 3])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(list(range(2, 90)) * 3)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.generate([5, 6], SamplingParams(max_tokens=255))
    free = llm.pool.num_free_pages
    assert llm.generate([5, 6], SamplingParams(max_tokens=2))[0].token_ids  # still serving
    assert llm.pool.num_free_pages == free


def test_bad_constructor_arguments(ckpt, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(tmp_path / "nope", device="cpu")
    with pytest.raises(ValueError, match="device"):
        LLM(ckpt, device="tpu")
    with pytest.raises(ValueError, match="dtype"):
        LLM(ckpt, device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="page_size"):
        LLM(ckpt, device="cpu", page_size=0)
    with pytest.raises(ValueError, match="max_running"):
        LLM(ckpt, device="cpu", max_running=0)  # was accepted: nothing was admitted, generate hung
    with pytest.raises(ValueError, match="spec"):
        LLM(ckpt, device="cpu", spec="medusa")
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=512"):
        LLM(ckpt, device="cpu", max_model_len=10**7)  # was accepted, and a 1e7-token KV pool sized from it
