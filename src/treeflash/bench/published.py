"""Published models' config.json, as data: Kimi K2 / K2.6 and the Kimi K2.6 DFlash drafter.

The presets (`bench/presets.py`) slice these to one GPU's share, and `doctor --memory-plan`
plans the whole model from them. Facts and their sources: `../shared/reference/kimi-k26-format.md`
(the K2.5 / K2.6 config dump, the compressed-tensors scheme and its `ignore` list, the drafter's
geometry from tenstorrent/tt-metal's `dflash_drafter_config.py` and the K2.5 drafter's
metadata). The drafter's intermediate size (18432) is not in those notes: it is what the
published size gives (6.48 GiB of bf16 = 3.479G parameters = 6 layers x (attention 132.1M +
MLP 3 x 7168 x I) + fc 6 x 7168 x 7168, so I = 18432, the target's dense MLP width).
"""

from __future__ import annotations

K2_LAYERS, K2_DENSE_LAYERS = 61, 1
K2_VOCAB = 163840


def kimi_k2_text(layers: int = K2_LAYERS, heads: int = 64, experts: int = 384, moe_inter: int = 2048,
                 dense_inter: int = 18432, vocab: int = K2_VOCAB) -> dict:
    """The language model's fields of a Kimi K2 config.json (DeepSeek-V3 architecture), sizes
    overridable (the presets keep fewer layers / experts, or one GPU's share of them)."""
    return dict(
        model_type="kimi_k2", vocab_size=vocab, hidden_size=7168, intermediate_size=dense_inter,
        moe_intermediate_size=moe_inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, n_routed_experts=experts, num_experts_per_tok=8,
        n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=1,
        max_position_embeddings=262144, routed_scaling_factor=2.827, norm_topk_prob=True,
        scoring_func="sigmoid", topk_method="noaux_tc", rope_theta=50000.0,
        rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=4096,
                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
        rms_norm_eps=1e-6, eos_token_id=vocab - 2, bos_token_id=0,
    )


# compressed-tensors pack-quantized INT4, group 32, symmetric, weights only; only routed experts
K26_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
              "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"]


def int4_quantization(group_size: int = 32) -> dict:
    """K2.6's `quantization_config` (compressed-tensors, pack-quantized, W4A16)."""
    weights = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size,
                   dynamic=False, actorder=None, observer="minmax")
    return dict(quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed",
                config_groups={"group_0": dict(targets=["Linear"], weights=weights, input_activations=None,
                                               output_activations=None, format="pack-quantized")},
                ignore=list(K26_IGNORE), kv_cache_scheme=None)


K26_SPECIAL = dict(bos_token_id=163584, eos_token_id=163585, pad_token_id=163839)
K26_TEXT = kimi_k2_text() | K26_SPECIAL | dict(rms_norm_eps=1e-5)
K26_CONFIG = dict(
    architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25", torch_dtype="bfloat16",
    text_config=K26_TEXT, vision_config=dict(model_type="moonvit", hidden_size=1152),
    quantization_config=int4_quantization(), **K26_SPECIAL,
)

K26_TAPS = (1, 12, 24, 35, 47, 58)
K26_MASK_TOKEN = 163838
K26_DRAFT_WINDOW = 4096
K26_YARN = dict(rope_type="yarn", factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0,
                beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def k26_dflash(hidden: int = 7168, heads: int = 64, kv_heads: int = 8, head_dim: int = 128,
               inter: int = 18432, vocab: int = K2_VOCAB, taps=K26_TAPS, mask: int = K26_MASK_TOKEN,
               window: int = K26_DRAFT_WINDOW, target_layers: int = K2_LAYERS,
               max_pos: int = 262144, rope: dict | None = None) -> dict:
    """The Kimi K2.6 DFlash drafter's config.json (z-lab format), sizes overridable: 6 Qwen3 layers
    with GQA, block 8, six taps, the mask token, YaRN over the full head dim.

    The published config has no `layer_types` (every layer full attention, the block attended
    both ways); serving recipes bound its context to a 4096-token draft window. Here every layer
    is a sliding layer of that window, with `is_causal` false so the block stays bidirectional:
    the drafter's cache is then bounded by its window, as those recipes run it."""
    return dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=hidden, num_hidden_layers=6,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
        vocab_size=vocab, rms_norm_eps=1e-5, max_position_embeddings=max_pos, rope_theta=50000.0,
        rope_scaling=dict(rope or K26_YARN), layer_types=["sliding_attention"] * 6, sliding_window=window,
        use_sliding_window=True, is_causal=False, block_size=8, num_target_layers=target_layers,
        dflash_config=dict(target_layer_ids=list(taps), mask_token_id=mask),
    )


K26_DFLASH = k26_dflash()
