"""Loader and config errors name what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.hf_checkpoints import patch_config, write_checkpoint
from treeflash import LLM
from treeflash.config import ModelConfig


@pytest.fixture()
def ckpt(tmp_path):
    return write_checkpoint(tmp_path / "m")


def _edit(path, fn):
    t = load_file(path / "model.safetensors")
    fn(t)
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor(ckpt):
    _edit(ckpt, lambda t: t.pop("model.layers.0.self_attn.kv_b_proj.weight"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.self_attn.kv_b_proj.weight'"):
        LLM(ckpt, device="cpu")


def test_missing_expert(ckpt):
    _edit(ckpt, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match="experts.3.up_proj"):
        LLM(ckpt, device="cpu")


def test_unexpected_tensor(ckpt):
    _edit(ckpt, lambda t: t.update({"model.layers.0.bogus.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.bogus.weight'"):
        LLM(ckpt, device="cpu")


def test_wrong_shape(ckpt):
    _edit(ckpt, lambda t: t.update({"model.norm.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match="'model.norm.weight' has shape"):
        LLM(ckpt, device="cpu")


def test_wrong_dtype(ckpt):
    _edit(ckpt, lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}))
    with pytest.raises(ValueError, match="model.norm.weight.*dtype"):
        LLM(ckpt, device="cpu")


def test_mtp_layers_are_ignored(ckpt):
    _edit(ckpt, lambda t: t.update({"model.layers.3.eh_proj.weight": torch.zeros(4, 4)}))
    LLM(ckpt, device="cpu")


def test_missing_files(tmp_path, ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(ckpt, device="cpu")
    with pytest.raises(ValueError, match="config.json not found"):
        ModelConfig.from_hf(tmp_path)


def test_missing_shard(tmp_path):
    path = write_checkpoint(tmp_path / "s", shard_size="40KB")
    sorted(path.glob("model-*.safetensors"))[0].unlink()
    with pytest.raises(ValueError, match="missing"):
        LLM(path, device="cpu")


def test_corrupt_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read as safetensors"):
        LLM(ckpt, device="cpu")


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"topk_method": "magic"}, "topk_method"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 9, "n_group": 4}, "topk_group"),
        ({"num_experts_per_tok": 99}, "num_experts_per_tok"),
        ({"hidden_size": "big"}, "hidden_size"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "factor"),
        ({"eos_token_id": 1000}, "eos_token_id"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ],
)
def test_bad_config_names_the_field(ckpt, fields, name):
    patch_config(ckpt, **fields)
    with pytest.raises(ValueError, match=name):
        ModelConfig.from_hf(ckpt)


def test_kimi_k2_config_and_rope_scaling_key(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["model_type"] = "kimi_k2"
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 50000.0
    raw["rope_scaling"] = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                           "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1, "beta_slow": 1}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.model_type == "kimi_k2" and cfg.rope.rope_type == "yarn"
    assert cfg.rope.theta == 50000.0 and cfg.rope.factor == 32.0
    assert cfg.softmax_scale > cfg.qk_head_dim**-0.5  # mscale_all_dim applied
    assert cfg.latent_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim


def test_16_bit_router_weight_is_kept_as_stored(tmp_path):
    """A bf16 router weight (as DeepSeek-V3 / Kimi-K2 ship it) loads as bf16, its values
    unchanged, and the model scores bit for bit as with the same values stored in float32
    (every use upcasts it exactly); a float32 one stays float32."""
    from treeflash.models.moe import Gate

    ids = list(range(2, 30))
    paths = {}
    for dt in (torch.bfloat16, torch.float32):
        p = write_checkpoint(tmp_path / str(dt))

        def rounded(t, dt=dt):
            for k in t:
                if k.endswith("mlp.gate.weight"):
                    t[k] = t[k].to(torch.bfloat16).to(dt)  # the same values either way

        _edit(p, rounded)
        paths[dt] = p
    llms = {dt: LLM(p, device="cpu", dtype="float32") for dt, p in paths.items()}
    gates = {dt: [m for m in llm.model.modules() if isinstance(m, Gate)] for dt, llm in llms.items()}
    assert gates[torch.bfloat16] and all(g.weight.dtype == torch.bfloat16 for g in gates[torch.bfloat16])
    assert all(g.weight.dtype == torch.float32 for g in gates[torch.float32])
    for a, b in zip(gates[torch.bfloat16], gates[torch.float32]):
        assert torch.equal(a.weight.float(), b.weight)
    assert torch.equal(llms[torch.bfloat16].score(ids), llms[torch.float32].score(ids))
