"""Tiny random DeepSeek-V3 checkpoints written by Hugging Face transformers (the oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

BASE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
    kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    first_k_dense_replace=1, max_position_embeddings=512, routed_scaling_factor=2.5,
    norm_topk_prob=True, rope_interleave=True, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, initializer_range=0.1,
)

VARIANTS = {
    "base": {},
    "q_lora": dict(q_lora_rank=24),
    "yarn": dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      original_max_position_embeddings=128, beta_fast=32,
                                      beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    "groups": dict(n_group=4, topk_group=2, n_routed_experts=8, num_experts_per_tok=3),
    "dense_first2": dict(first_k_dense_replace=2, num_hidden_layers=4),
    "tied": dict(tie_word_embeddings=True),
    "no_interleave": dict(rope_interleave=False),
}


def make_hf_model(**overrides):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kwargs = {**BASE, **overrides}
    torch.manual_seed(kwargs.pop("seed", 0))
    cfg = DeepseekV3Config(**kwargs)
    model = DeepseekV3ForCausalLM(cfg).eval()
    # Random router biases and norm weights, so routing and norms are really exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model


def write_checkpoint(path: Path, shard_size: str | None = None, **overrides) -> Path:
    model = make_hf_model(**overrides)
    kw = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **kw)
    return path


def patch_config(path: Path, **fields) -> None:
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(fields)
    cfg_path.write_text(json.dumps(cfg))


def add_tokenizer(path: Path) -> None:
    """A tiny byte-level BPE whose vocabulary fits the 96-token test model ; "</s>" is id 1, the model's eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = ["def f(x): return x + 1", "hello world"]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # The corpus' own symbols first, then a fixed (sorted) fill: deterministic, <= 80 symbols.
    used = sorted(
        {c for text in corpus for piece, _ in byte_level.pre_tokenize_str(text) for c in piece}
    )
    alphabet = (used + [c for c in sorted(pre_tokenizers.ByteLevel.alphabet()) if c not in used])[
        :80
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=96, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(corpus * 10, trainer)
    assert tok.get_vocab_size() <= 96
    tok.save(str(path / "tokenizer.json"))
