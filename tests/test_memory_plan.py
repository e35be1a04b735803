"""`doctor --memory-plan`: the whole model's memory per GPU under TP, from its config alone (issue 41,
item 6). Kimi K2.6 as published, at TP 8, must fit on an H200 (and does not on an H100); the
weights by kind equal what the loader allocates for a checkpoint in K2.6's layout (one rank's
shard included); a checkpoint's safetensors headers are read, never its tensors."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.k26_checkpoints import VISION, quantization_config, read_tensors, write_k26_checkpoint
from treeflash import memory, memory_plan
from treeflash.cli import main
from treeflash.config import DrafterConfig, ModelConfig
from treeflash.sharding import Parallel

pytest.importorskip("compressed_tensors")

GB = 10**9
K26_TEXT = dict(  # Kimi K2.6's text_config as published (reference/kimi-k26-format.md)
    model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], vocab_size=163840, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
    num_key_value_heads=64, n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1, n_group=1,
    topk_group=1, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    first_k_dense_replace=1, moe_layer_freq=1, num_nextn_predict_layers=0, max_position_embeddings=262144,
    routed_scaling_factor=2.827, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
    rope_theta=50000.0, rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=4096,
                                          beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    rms_norm_eps=1e-5, bos_token_id=163584, eos_token_id=163585, pad_token_id=163839, tie_word_embeddings=False,
)
K26_DRAFTER = dict(  # Kimi-K2.6-DFlash (z-lab format), its 4096-token window on every layer
    architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=7168, num_hidden_layers=6,
    num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=18432, vocab_size=163840,
    num_target_layers=61, max_position_embeddings=262144, rms_norm_eps=1e-5, rope_theta=50000.0,
    rope_scaling=dict(rope_type="yarn", factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0,
                      beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    layer_types=["sliding_attention"] * 6, sliding_window=4096, block_size=8,
    dflash_config=dict(target_layer_ids=[1, 12, 24, 35, 47, 58], mask_token_id=163838),
)
H200 = 143771 * 2**20


@pytest.fixture(scope="module")
def k26_dirs(tmp_path_factory):
    """config.json of Kimi K2.6 in its published layout (no weights) and its drafter's."""
    root = tmp_path_factory.mktemp("k26plan")
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": K26_TEXT, "vision_config": {"model_type": "moonvit", "hidden_size": 1152},
              "quantization_config": quantization_config(32), "torch_dtype": "bfloat16"}
    for name, cfg in (("Kimi-K2.6", config), ("Kimi-K2.6-DFlash", K26_DRAFTER)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
    return root / "Kimi-K2.6", root / "Kimi-K2.6-DFlash"


def k26_plan(k26_dirs, **kw) -> memory_plan.GpuPlan:
    target, drafter = k26_dirs
    return memory_plan.plan_model(ModelConfig.from_hf(target), DrafterConfig.from_hf(drafter), tp=8, **kw)


def test_k26_at_tp8_weights_by_kind_are_the_published_sizes(k26_dirs):
    """Rank 0's share, each kind from the published geometry by hand: 8 of 64 heads, 2048/8 of each
    expert (INT4 with bf16 scales: 0.5625 B a parameter), replicated embedding and head and the
    latent projections, the drafter whole."""
    w = k26_plan(k26_dirs).weights
    h, moe_layers = 7168, 60
    assert w["routed experts (int4)"] == moe_layers * 384 * 3 * h * 256 * 9 // 16
    assert w["embeddings / lm_head"] == 2 * 163840 * h * 2
    attn = h * 1536 + 1536 * 8 * 192 + h * 576 + 512 * 8 * 256 + 8 * 128 * h  # q_a, q_b, kv_a, kv_b, o
    assert w["attention (MLA projections)"] == 61 * attn * 2
    assert w["dense MLP"] == 3 * h * 18432 // 8 * 2
    assert w["shared experts"] == moe_layers * 3 * h * 256 * 2
    assert w["router"] == moe_layers * (384 * h * 2 + 384 * 4)  # the correction bias in float32
    layer = h * 8192 + 2 * h * 1024 + 8192 * h + 3 * h * 18432 + 2 * 128 + 2 * h
    drafter_params = 6 * h * h + h + 6 * layer + h  # fc, hidden norm, layers, final norm
    assert w["drafter"] == drafter_params * 2 + 64 * 4  # + its rotary table (float32)
    assert drafter_params == pytest.approx(6.48 * 2**30 / 2, rel=1e-3)  # the published 6.48 GiB


@pytest.mark.slow
def test_k26_at_tp8_fits_on_an_h200_with_its_whole_context(k26_dirs, capsys):
    plan = k26_plan(k26_dirs)
    assert plan.kv_per_token == 61 * 576 * 2  # the latent cache, every layer, whole on every rank
    assert plan.drafter_window == 6 * 4095 * (2 * 8 * 128 * 2 + 8)
    assert plan.fits(H200, 262144) and plan.longest_context(H200) == 262144
    assert 800_000 < plan.kv_tokens(H200) < 900_000  # 871,815: 61 GB of latent rows left
    target, drafter = k26_dirs
    argv = ["doctor", "--model", str(target), "--drafter", str(drafter), "--tp", "8", "--memory-plan",
            "--context", "256k"]
    assert main([*argv, "--gpu-memory", "h200"]) == 0
    out = capsys.readouterr().out
    assert "routed experts (int4)" in out and "72.0 MB per 1k tokens" in out
    assert f"{plan.kv_tokens(H200):,} tokens" in out and "longest context at batch 1: 262,144" in out
    assert "a 262,144-token request: FITS" in out
    assert main([*argv, "--gpu-memory", "h100"]) == 1  # 89 GB of weights and reserves on 85.5 GB
    assert "DOES NOT FIT: the fixed part alone needs 89.4 GB" in capsys.readouterr().out
    assert main([*argv, "--gpu-memory", "h100,h200"]) == 1  # a verdict line each; misses one: exit 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  on ")]
    assert len(lines) == 2 and "on H100" in lines[0] and "DOES NOT FIT" in lines[0] and "FITS" in lines[1]


@pytest.mark.slow
def test_batch_shares_the_room_and_pays_each_drafter_window(k26_dirs):
    one, many = k26_plan(k26_dirs), k26_plan(k26_dirs, batch=32)
    assert many.graphs > one.graphs  # 32 x 64 rows captured
    assert many.kv_tokens(H200) == (H200 - many.fixed - 32 * many.drafter_window) // many.kv_per_token
    assert many.longest_context(H200) == many.kv_tokens(H200) // 32 - 64 < 32768


@pytest.mark.slow
def test_a_drafter_without_a_window_pays_its_kv_per_token(k26_dirs):
    cfg = ModelConfig.from_hf(k26_dirs[0])
    full = DrafterConfig.from_hf({k: v for k, v in K26_DRAFTER.items() if k not in ("layer_types", "sliding_window")})
    plan = memory_plan.plan_model(cfg, full, tp=8)
    assert plan.drafter_window == 0 and plan.kv_per_token == 61 * 576 * 2 + 6 * 2 * 8 * 128 * 2


@pytest.mark.slow
def test_the_preset_plans_the_model_it_slices(k26_dirs, monkeypatch, capsys):
    """`doctor --preset kimi-k2.6-tp8 --tp 8` plans Kimi K2.6 itself (the same as its config.json),
    and stops there: a preset is one GPU's slice and cannot run under --tp."""
    import treeflash.bench.presets as presets

    monkeypatch.setattr(presets, "build_preset", lambda *a, **k: pytest.fail("the preset was built"))
    assert main(["doctor", "--preset", "kimi-k2.6-tp8", "--tp", "8", "--gpu-memory", "h200"]) == 0
    out = capsys.readouterr().out
    ours = memory_plan.report(k26_plan(k26_dirs), [memory_plan.parse_gpu("h200")], 1024)
    assert out.strip().split("\n")[1:] == ours.split("\n")[1:]  # every figure the same, the title apart


@pytest.fixture(scope="module")
def tiny_k26(tmp_path_factory):
    return write_k26_checkpoint(tmp_path_factory.mktemp("tiny") / "k26", num_hidden_layers=3)


@pytest.mark.parametrize("tp", [1, 2])
def test_weights_by_kind_are_what_the_loader_allocates(tiny_k26, tp):
    """A K2.6-layout checkpoint loaded for rank 0 of `tp` holds, kind by kind, what the plan says."""
    from treeflash.models.loader import load_target

    cfg = ModelConfig.from_hf(tiny_k26)
    model = load_target(tiny_k26, torch.device("cpu"), torch.bfloat16, Parallel(tp_size=tp, tp_rank=0))
    loaded: dict[str, int] = {}
    tensors = {id(t): (n, t) for n, t in (*model.named_parameters(), *model.named_buffers())}
    for name, t in tensors.values():
        kind = memory_plan.tensor_kind(name)
        kind = "routed experts (int4)" if kind == "routed experts" else kind
        loaded[kind] = loaded.get(kind, 0) + t.numel() * t.element_size()
    assert memory_plan.plan_model(cfg, None, tp=tp).weights == loaded


def test_the_checkpoint_is_read_by_its_headers_alone(tiny_k26, tmp_path):
    """Stored bytes by kind from the headers; the same from files cut right after their headers."""
    ck = memory_plan.read_checkpoint(tiny_k26)
    tensors = read_tensors(tiny_k26)
    assert ck.files == 2 and ck.total == sum(t.numel() * t.element_size() for t in tensors.values())
    assert ck.by_kind["vision tower (not loaded)"] == sum(tensors[k].numel() * 2 for k in VISION)
    experts = sum(t.numel() * t.element_size() for k, t in tensors.items() if ".mlp.experts." in k)
    assert ck.by_kind["routed experts"] == experts
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in tiny_k26.glob("*.safetensors"):
        raw = f.read_bytes()
        (cut / f.name).write_bytes(raw[:8 + int.from_bytes(raw[:8], "little")])
    assert memory_plan.read_checkpoint(cut) == ck
    (cut / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="bad.safetensors: not a safetensors file"):
        memory_plan.read_checkpoint(cut)


def test_plan_of_a_checkpoint_dir_shows_what_it_stores(tiny_k26, capsys):
    argv = ["doctor", "--model", str(tiny_k26), "--memory-plan", "--gpu-memory", "80GB"]
    assert main([*argv, "--context", "256"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint (safetensors headers, the whole model as stored): 2 file(s)" in out
    assert "vision tower (not loaded)" in out and "on a 80GB GPU (80.0 GB)" in out
    assert main([*argv, "--context", "1k"]) == 1
    assert "a 1,024-token request: DOES NOT FIT (beyond the model's 512 positions)" in capsys.readouterr().out


def test_a_plan_that_does_not_fit_stops_doctor_before_loading(tiny_k26, monkeypatch, capsys):
    import treeflash.bench.presets as presets

    monkeypatch.setattr(presets, "load_rig", lambda *a, **k: pytest.fail("loaded a model that cannot fit"))
    assert main(["doctor", "--model", str(tiny_k26), "--tp", "2", "--gpu-memory", "1GB", "--device", "cpu"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_without_a_gpu_the_plan_is_shown_on_the_known_ones(tiny_k26, capsys):
    assert main(["doctor", "--model", str(tiny_k26), "--memory-plan"]) == 0
    out = capsys.readouterr().out
    assert "on H100 80GB HBM3 (85.5 GB)" in out and "on H200 141GB HBM3e (150.8 GB)" in out


def test_gpu_memory_names_and_sizes():
    assert memory_plan.parse_gpu("H200").memory == H200
    assert memory_plan.parse_gpu("141GB").memory == 141 * GB
    assert memory_plan.parse_gpu("139.8GiB").memory == int(139.8 * 2**30)
    assert memory_plan.parse_gpu("150e9").memory == 150 * GB
    for bad in ("lots", "12 parsecs", "0GB"):
        with pytest.raises(ValueError, match="GPU memory"):
            memory_plan.parse_gpu(bad)


def test_a_bad_gpu_memory_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--memory-plan", "--gpu-memory", "lots"])
    assert e.value.code == 2 and "expected h100, h200 or a size" in capsys.readouterr().err


def test_a_tp_that_does_not_split_the_model_is_named(k26_dirs, capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--model", str(k26_dirs[0]), "--tp", "3", "--memory-plan"])
    assert e.value.code == 2 and "num_attention_heads=64 does not split evenly over tp=3" in capsys.readouterr().err


def test_kv_rows_come_from_one_table():
    cfg = ModelConfig.from_hf(K26_TEXT)
    assert memory.kv_row_bytes(cfg, torch.bfloat16) == memory.kv_row_bytes(cfg, torch.bfloat16, "bfloat16") == 1152
    fp8 = memory.kv_row_bytes(cfg, torch.bfloat16, "fp8_e4m3")
    assert fp8 == memory.kv_row_bytes(cfg, torch.bfloat16, "fp8") == 656
    with pytest.raises(ValueError, match="kv_cache_dtype 'int2': unknown"):
        memory.kv_row_bytes(cfg, torch.bfloat16, "int2")
