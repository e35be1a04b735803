"""Tiny checkpoints in Kimi K2.5 / K2.6's published layout, and their transformers oracle.

The layout (`/work/shared/reference/kimi-k26-format.md`): a `KimiK25ForConditionalGeneration`
config.json with the DeepSeek-V3 fields under `text_config` and a `vision_config`; tensors
`language_model.model.*` / `language_model.lm_head.weight` plus a few vision-tower ones
(`vision_tower.*`, `mm_projector.*`) in sharded safetensors with an index; routed experts
quantized and packed by the `compressed-tensors` library itself (pack-quantized, symmetric
INT4, groups of 32 along the input dim, bf16 `weight_scale`, int32 `weight_shape`), the rest
bf16 as the `ignore` list says (attention, shared experts, the dense MLP, lm_head, vision).
The oracle is transformers' DeepseekV3ForCausalLM on the same weights, dequantized in fp32.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers.hf_checkpoints import make_hf_model

PREFIX = "language_model."
IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
          "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"]
# K2.6's choices at tiny size: q_lora, YaRN (beta_fast 32), sigmoid noaux_tc, rms_norm_eps 1e-5.
K26 = dict(
    q_lora_rank=24, rms_norm_eps=1e-5, routed_scaling_factor=2.827, n_routed_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=64, initializer_range=0.2,
    rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=4.0, original_max_position_embeddings=128,
                         beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
)
VISION = {  # a stand-in vision tower: skipped by name, never read
    "vision_tower.patch_embed.proj.weight": (8, 3, 2, 2),
    "vision_tower.encoder.blocks.0.wqkv.weight": (24, 8),
    "mm_projector.pre_norm.weight": (8,),
    "mm_projector.proj.0.weight": (64, 8),
}


def int4_scheme(group_size: int = 32):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


def quantization_config(group_size: int = 32) -> dict:
    """What compressed-tensors writes for the published scheme (its own serialisation)."""
    from compressed_tensors.quantization import QuantizationConfig

    cfg = QuantizationConfig(config_groups={"group_0": int4_scheme(group_size)}, format="pack-quantized",
                             ignore=IGNORE, quantization_status="compressed")
    return json.loads(json.dumps(cfg.model_dump()))


def compress_expert(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """One projection W [out, in] through compressed-tensors' pack-quantized compressor, with the
    QAT's scales (max |w| / 7 a group, bf16): weight_packed, weight_scale, weight_shape (int32)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    scale = (w.float().unflatten(-1, (-1, group_size)).abs().amax(-1) / 7.0).to(torch.bfloat16)
    out = PackedQuantizationCompressor.compress({"weight": w.float(), "weight_scale": scale},
                                                int4_scheme(group_size))
    return {"weight_packed": out["weight_packed"], "weight_scale": out["weight_scale"],
            "weight_shape": out["weight_shape"].to(torch.int32)}


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def write_k26_checkpoint(path: Path, *, quant_in: str = "top", group_size: int = 32, seed: int = 0,
                         **overrides) -> Path:
    """Write a random K2.6-layout checkpoint under `path`; quant_in: "top" or "text" (where
    config.json keeps quantization_config: copies of the published checkpoint differ)."""
    hf = make_hf_model(seed=seed, **{**K26, **overrides})
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        text = json.loads((Path(tmp) / "config.json").read_text())
        plain = load_file(str(Path(tmp) / "model.safetensors"))
    tensors = {}
    for name, t in plain.items():
        if _is_expert(name):
            base = name[: -len("weight")]
            tensors |= {PREFIX + base + k: v for k, v in compress_expert(t, group_size).items()}
        elif name.endswith("e_score_correction_bias"):
            tensors[PREFIX + name] = t.float()
        else:
            tensors[PREFIX + name] = t.to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed + 100)
    tensors |= {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in VISION.items()}
    text = {**text, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text, "vision_config": {"model_type": "moonvit", "hidden_size": 8},
              "bos_token_id": text.get("bos_token_id"), "eos_token_id": text.get("eos_token_id"),
              "torch_dtype": "bfloat16"}
    (config if quant_in == "top" else text)["quantization_config"] = quantization_config(group_size)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_shards(path, tensors)
    return path


def write_shards(path: Path, tensors: dict[str, torch.Tensor], parts: int = 2) -> None:
    """model-0000i-of-0000n.safetensors + model.safetensors.index.json, as the hub publishes."""
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = names[i::parts]
        save_file({n: tensors[n].contiguous() for n in chunk}, str(path / file), metadata={"format": "pt"})
        weight_map |= {n: file for n in chunk}
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("model-*.safetensors")):
        out |= load_file(str(f))
    return out


def edit_k26(path: Path, fn) -> None:
    """Rewrite the checkpoint's tensors through fn(dict) (in place)."""
    tensors = read_tensors(path)
    fn(tensors)
    write_shards(path, tensors)


def dequantized_state(path: Path) -> dict[str, torch.Tensor]:
    """The language model's tensors in plain DeepSeek-V3 names, fp32, experts dequantized by
    compressed-tensors (in fp32: the product of an INT4 value and a bf16 scale is exact there)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    raw = json.loads((path / "config.json").read_text())
    q = raw.get("quantization_config") or raw["text_config"]["quantization_config"]
    group = q["config_groups"]["group_0"]["weights"]["group_size"]
    tensors = {k[len(PREFIX):]: v for k, v in read_tensors(path).items() if k.startswith(PREFIX)}
    out = {}
    for name, t in tensors.items():
        if name.endswith("weight_packed"):
            base = name[: -len("_packed")]
            parts = {"weight_packed": t, "weight_scale": tensors[base + "_scale"].float(),
                     "weight_shape": tensors[base + "_shape"]}
            out[base] = PackedQuantizationCompressor.decompress(parts, int4_scheme(group))["weight"].float()
        elif not name.endswith(("weight_scale", "weight_shape")):
            out[name] = t.float()
    return out


def oracle_model(path: Path):
    """transformers' DeepseekV3ForCausalLM (fp32, eval) on the dequantized weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    text = dict(json.loads((path / "config.json").read_text())["text_config"])
    text.pop("quantization_config", None)
    text["model_type"] = "deepseek_v3"
    with tempfile.TemporaryDirectory() as tmp:
        DeepseekV3Config(**text).save_pretrained(tmp)
        save_file(dequantized_state(path), str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        return DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


# ---- Kimi's tokenizer files: tiktoken.model + tokenizer_config.json (+ chat template) --------
CORPUS = ("def f(x): return x + 1\nhello world, hello there! I'm here; you're not.\n"
          "你好世界，数字 12345 678。\nThe assistant answers the user.\n") * 20
# ids after the ranks, as Kimi K2 places them (offsets from len(ranks)); the rest are reserved
SPECIAL_OFFSETS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                   6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                   17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}
NOT_SPECIAL = {"<think>": 20, "</think>": 21}  # added tokens with "special": false
KIMI_TEMPLATE = (  # the shape of Kimi K2's template (role marker, name, <|im_middle|>, content, <|im_end|>)
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def kimi_ranks(vocab: int = 300) -> dict[bytes, int]:
    """BPE ranks trained on CORPUS by tiktoken's own (educational) trainer: the 256 bytes first."""
    from tiktoken import _educational

    pat = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return _educational.bpe_train(CORPUS, vocab, pat, visualise=None)


def add_kimi_tokenizer(path: Path, vocab: int = 300, template: str | None = KIMI_TEMPLATE) -> dict[str, int]:
    """Write tiktoken.model (tiktoken's base64 format) and tokenizer_config.json (with the chat
    template) into `path`; returns the special tokens' ids."""
    import base64

    ranks = kimi_ranks(vocab)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda x: x[1])]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    named = {base + o: (text, True) for o, text in SPECIAL_OFFSETS.items()}
    named |= {base + o: (text, False) for text, o in NOT_SPECIAL.items()}
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": s} for i, (t, s) in sorted(named.items())}
    config = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]",
              "pad_token": "[PAD]", "unk_token": "[UNK]", "tokenizer_class": "TikTokenTokenizer",
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
              "model_max_length": 1048576}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return {t: i for i, (t, _) in named.items()}
