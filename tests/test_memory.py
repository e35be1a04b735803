"""Memory estimated from a config before anything is allocated equals what building it allocates;
--mem-fraction-static / --gpu-memory-utilization sizes the KV pool from it (issue 43, items 6, 7)."""

from __future__ import annotations

import pytest
import torch

from helpers.drafter import write_drafter
from helpers.hf_checkpoints import add_tokenizer, write_checkpoint
from treeflash import memory
from treeflash.bench.presets import PRESETS, build_preset, preset_memory
from treeflash.config import DrafterConfig, ModelConfig

GB = 10**9


def allocated(*modules) -> int:
    """Parameter elements of the built modules, shared tensors once."""
    return sum({id(p): p.numel() for m in modules for p in m.parameters()}.values())


def built_bytes(*modules) -> int:
    """Bytes of the built modules' parameters and buffers (INT4 experts are buffers), shared once."""
    tensors = {id(t): t for m in modules for t in (*m.parameters(), *m.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_parameter_count_of_a_preset_is_what_building_it_allocates():
    model, drafter, preset = build_preset("tiny", torch.device("cpu"), torch.float32)
    cfg, dcfg = ModelConfig.from_hf(preset.target), DrafterConfig.from_hf(preset.drafter)
    assert memory.parameter_count(cfg, dcfg) == allocated(model, drafter)
    plan = preset_memory("tiny", torch.device("cpu"), torch.float32, 1000)
    assert plan.weights == built_bytes(model, drafter)


def test_kv_bytes_per_token_is_the_pools():
    from treeflash.kvcache import KVPool

    cfg = ModelConfig.from_hf(PRESETS["tiny"].target)
    pool = KVPool(cfg.num_hidden_layers, 4, 16, cfg.latent_dim, torch.bfloat16, torch.device("cpu"))
    assert memory.kv_bytes_per_token(cfg, torch.bfloat16) * 64 == pool.kv.numel() * pool.kv.element_size()


def test_the_kimi_slice_needs_what_the_issue_saw_on_a_cpu():
    """The README's GPU sweep: ~25 GB of float32 allocations on a CPU before it died (issue 43)."""
    plan = preset_memory("kimi-k2-tp8", torch.device("cpu"), torch.float32, 262144)
    dcfg = DrafterConfig.from_hf(PRESETS["kimi-k2-tp8"].drafter)
    assert 25 * GB < plan.weights < 32 * GB and plan.kv == 262272 * memory.kv_bytes_per_token(
        ModelConfig.from_hf(PRESETS["kimi-k2-tp8"].target), torch.float32, dcfg
    ) + memory.drafter_window_bytes(dcfg, torch.float32)  # + its sliding layers' rings, once a request
    half = preset_memory("kimi-k2-tp8", torch.device("cpu"), torch.bfloat16, 262144)
    cfg = ModelConfig.from_hf(PRESETS["kimi-k2-tp8"].target)
    buffers = sum(t.numel() * 4 for _, t, param in memory.meta_tensors(cfg, dcfg) if not param)
    assert 2 * half.weights - plan.weights == buffers > 0  # float32 router biases stay float32
    assert "7.36G parameters in float32" in plan.describe()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("mem")
    path = write_checkpoint(root / "m", max_position_embeddings=512)
    add_tokenizer(path)
    drafter = write_drafter(root / "d", hidden_size=64, vocab_size=96, num_target_layers=3,
                            target_layer_ids=(0, 2), block_size=4, mask_token_id=95)
    return path, drafter


@pytest.mark.slow
def test_memory_fraction_sizes_the_kv_pool(ckpt, monkeypatch):
    from treeflash import LLM

    total = 3 * memory.GIB
    monkeypatch.setattr(memory, "device_memory", lambda device: (total, total, "available CPU RAM"))
    llm = LLM(ckpt[0], ckpt[1], device="cpu", dtype="float32", page_size=16, kv_memory_fraction=0.5)
    cfg = llm.config
    tensors = {id(t): t for m in (llm.model, llm.engine.spec.drafter) for t in (*m.parameters(), *m.buffers())}
    weights = sum(t.numel() * t.element_size() for t in tensors.values())  # (the drafter shares the head)
    work = memory.workspace_bytes(cfg, 512, 512, torch.device("cpu"))
    per_token = memory.kv_bytes_per_token(cfg, torch.float32, llm.engine.spec.drafter.cfg)
    left = total // 2 - weights - work - llm.pool.num_pages * 16 * per_token  # what the fraction leaves unused
    assert abs(left) < 16 * per_token  # the pool fills it, to a page (pages are rounded up)
    assert llm.pool.num_pages * 16 > 1_000_000  # not the default pool (min(4 x 512, 65536) tokens)
    assert llm.generate("def f", None)[0].finish_reason in ("length", "stop")


def test_a_fraction_too_small_for_one_request_is_refused(ckpt, monkeypatch, capsys):
    from treeflash.cli import main

    monkeypatch.setattr(memory, "device_memory", lambda device: (memory.GIB, memory.GIB, "available CPU RAM"))
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(ckpt[0]), "--device", "cpu", "--gpu-memory-utilization", "0.26", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "a memory fraction of 0.26 leaves room for" in err and "fewer than one request of max_model_len=512" in err


def test_verify_rows_follow_the_budget_auto_can_reach():
    from treeflash.bench.presets import verify_rows
    from treeflash.speculative.budget import BUCKETS
    from treeflash.speculative.decoder import DEFAULT_TREE_BUDGET

    assert verify_rows("auto") == max(BUCKETS) + 1 == 64
    assert verify_rows(15) == 16 and verify_rows(None) == DEFAULT_TREE_BUDGET + 1
    assert verify_rows([3, "auto", None]) == 64 and verify_rows([3, 7]) == 8
    assert verify_rows([None]) == verify_rows(None)
