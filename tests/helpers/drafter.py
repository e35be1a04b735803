"""Tiny random drafters in the z-lab DFlash checkpoint format, and the z-lab reference model
built from the same files (the oracle for tests/models/test_drafter.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

DRAFTER_BASE = dict(
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=64,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    rope_theta=10000.0,
    attention_bias=False,
    hidden_act="silu",
    num_target_layers=4,
)


def drafter_config(
    layer_types=("full_attention",) * 3,
    sliding_window=None,
    target_layer_ids=(0, 2),
    block_size=4,
    mask_token_id=63,
    is_causal=None,
    **overrides,
) -> dict:
    cfg = {**DRAFTER_BASE, **overrides}
    cfg["num_hidden_layers"] = len(layer_types)
    cfg["layer_types"] = list(layer_types)
    cfg["sliding_window"] = sliding_window
    cfg["use_sliding_window"] = "sliding_attention" in layer_types
    cfg["block_size"] = block_size
    cfg["dflash_config"] = {
        "target_layer_ids": list(target_layer_ids),
        "mask_token_id": mask_token_id,
    }
    cfg["architectures"] = ["DFlashDraftModel"]
    if is_causal is not None:
        cfg["is_causal"] = is_causal
    return cfg


def random_state_dict(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """z-lab tensor names; weights scaled so every path really changes the output."""
    g = torch.Generator().manual_seed(seed)
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    taps = len(cfg["dflash_config"]["target_layer_ids"])

    def lin(out, inp):
        return torch.randn(out, inp, generator=g) / inp**0.5

    def norm(n):
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    sd = {"fc.weight": lin(h, taps * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        sd |= {
            p + "self_attn.q_proj.weight": lin(nq * d, h),
            p + "self_attn.k_proj.weight": lin(nkv * d, h),
            p + "self_attn.v_proj.weight": lin(nkv * d, h),
            p + "self_attn.o_proj.weight": lin(h, nq * d),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate_proj.weight": lin(inter, h),
            p + "mlp.up_proj.weight": lin(inter, h),
            p + "mlp.down_proj.weight": lin(h, inter),
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
        }
    return sd


def write_drafter(path: Path, seed: int = 0, **kwargs) -> Path:
    """Save config.json + model.safetensors of a random drafter under `path`."""
    from safetensors.torch import save_file

    cfg = drafter_config(**kwargs)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(random_state_dict(cfg, seed), str(path / "model.safetensors"))
    return path


def target_heads(vocab: int, hidden: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for the target's embedding and lm_head weights [V, hidden]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, hidden, generator=g), torch.randn(
        vocab, hidden, generator=g
    ) / hidden**0.5


def reference_drafter(path: Path):
    """The z-lab `dflash.model.DFlashDraftModel` on the same checkpoint, fp32, eval."""
    from dflash.model import DFlashDraftModel
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    raw = json.loads((path / "config.json").read_text())
    kwargs = {k: v for k, v in raw.items() if k not in ("architectures",)}
    if "rope_scaling" in kwargs:
        kwargs["rope_parameters"] = {
            "rope_theta": raw.get("rope_theta", 10000.0),
            **kwargs.pop("rope_scaling"),
        }
    kwargs["max_window_layers"] = 0
    model = DFlashDraftModel(Qwen3Config(**kwargs)).eval()
    missing, unexpected = model.load_state_dict(
        load_file(str(path / "model.safetensors")), strict=False
    )
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


@torch.no_grad()
def reference_block_logits(
    ref,
    features: torch.Tensor,
    bonus: int,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    block_size: int | None = None,
) -> torch.Tensor:
    """From-scratch reference logits [bs-1, V] for the block after context `features` [T, F]."""
    bs = block_size or ref.block_size
    t = features.shape[0]
    block = torch.full((1, bs), ref.mask_token_id, dtype=torch.long)
    block[0, 0] = bonus
    hidden = ref(
        position_ids=torch.arange(t + bs)[None],
        noise_embedding=embed[block],
        target_hidden=features[None],
    )
    return hidden[0, 1:] @ lm_head.T
