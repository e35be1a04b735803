"""Frozen model configurations, converted once from Hugging Face `config.json`.

`ModelConfig.from_hf` is the only place in treeflash that reads a target's config.json;
everything downstream sees these dataclasses, never a transformers object.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treeflash.quantization import Int4Scheme, Scheme, int4_expert_layers, parse_quantization

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# Multimodal wrappers whose language model is DeepSeek-V3 under `text_config`, its weights under
# `language_model.`; the vision tower's tensors (these prefixes) are skipped at load.
WRAPPER_ARCHITECTURES = ("KimiK25ForConditionalGeneration",)
WRAPPER_MODEL_TYPES = ("kimi_k25",)
WRAPPER_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def _fail(field_name: str, msg: str) -> ValueError:
    return ValueError(f"config.json: field '{field_name}': {msg}")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings. `rope_type` is "default" or "yarn"."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @staticmethod
    def from_hf(raw: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise _fail("rope_scaling", f"expected an object, got {type(params).__name__}")
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise _fail("rope_scaling.rope_type", f"'{rope_type}' is not supported (default, yarn)")
        if rope_type == "default":
            return RopeConfig(theta=float(theta))
        if "factor" not in params:
            raise _fail("rope_scaling.factor", "YaRN needs a scaling factor")
        factor = float(params["factor"])
        if factor < 1.0:
            raise _fail("rope_scaling.factor", f"must be >= 1, got {factor}")
        orig = params.get("original_max_position_embeddings", max_position_embeddings)
        return RopeConfig(
            theta=float(theta),
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=int(orig),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )

    def to_hf(self) -> dict[str, Any]:
        if self.rope_type == "default":
            return {"rope_type": "default", "rope_theta": self.theta}
        out = {
            "rope_type": "yarn",
            "rope_theta": self.theta,
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
        }
        for k in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V3 / Kimi-K2 architecture (MLA attention + MoE)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    topk_method: str  # "noaux_tc" | "greedy" | "group_limited_greedy"
    scoring_func: str  # "sigmoid" | "softmax"
    norm_topk_prob: bool
    routed_scaling_factor: float
    # the rest
    rope: RopeConfig
    rope_interleave: bool
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # Checkpoint layout: tensor names start with weight_prefix ("language_model." in a wrapped
    # checkpoint); names under skipped_prefixes (a vision tower) are not read.
    weight_prefix: str = ""
    skipped_prefixes: tuple[str, ...] = ()
    quantization: Scheme | None = None
    int4_expert_layers: tuple[int, ...] = ()  # layers whose routed experts are stored INT4
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    # ---- derived -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the latent KV cache (c_kv then k_pe)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.rope_type == "yarn" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale = scale * m * m
        return scale

    def experts_int4(self, layer: int) -> bool:
        """Whether `layer`'s routed experts are INT4 (`quantization` an `Int4Scheme`)."""
        return layer in self.int4_expert_layers

    @property
    def int4_group_size(self) -> int | None:
        q = self.quantization
        return q.group_size if isinstance(q, Int4Scheme) and self.int4_expert_layers else None

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    # ---- construction --------------------------------------------------------------
    @staticmethod
    def from_hf(source: str | Path | dict[str, Any]) -> ModelConfig:
        """Build from a config.json path, a model directory or an already-parsed dict.

        A model directory's generation_config.json adds its eos_token_id(s) (a chat model's
        end-of-turn token is often only there). A `KimiK25ForConditionalGeneration` wrapper is
        read through its `text_config`."""
        raw = _read_json(source)
        cfg = _model_config_from_dict(raw)
        gen_eos = _generation_eos(source)
        if gen_eos:
            eos = tuple(dict.fromkeys(cfg.eos_token_ids + gen_eos))
            cfg = dataclasses.replace(cfg, eos_token_ids=eos)
            _validate(cfg)
        return cfg


def _read_json(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(source, dict):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"config.json not found at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _generation_eos(source: str | Path | dict[str, Any]) -> tuple[int, ...]:
    if isinstance(source, dict):
        return ()
    path = Path(source)
    gen = (path if path.is_dir() else path.parent) / "generation_config.json"
    if not gen.is_file():
        return ()
    try:
        raw = json.loads(gen.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{gen}: not valid JSON ({e})") from None
    return _eos_ids(raw if isinstance(raw, dict) else {})


def _get(raw: dict[str, Any], name: str, kind: type, default: Any = ..., *, minimum=None):
    if name not in raw or raw[name] is None:
        if default is ...:
            raise _fail(name, "is required")
        return default
    value = raw[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _fail(name, f"expected {kind.__name__}, got {value!r}")
    if minimum is not None and value < minimum:
        raise _fail(name, f"must be >= {minimum}, got {value}")
    return value


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, list) and all(isinstance(x, int) for x in eos):
        return tuple(eos)
    raise _fail("eos_token_id", f"expected an int or a list of ints, got {eos!r}")


def _unwrap(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the language model's fields, the layout fields) of a config.json, wrapped or not."""
    archs = raw.get("architectures") or []
    wrapper = raw.get("model_type") in WRAPPER_MODEL_TYPES or any(a in WRAPPER_ARCHITECTURES for a in archs)
    if not wrapper:
        return raw, {}
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise _fail("text_config", f"{raw.get('model_type')} ({', '.join(archs)}) keeps the language "
                    f"model's fields here; got {text!r}")
    inner = {"model_type": "kimi_k2", **text}
    top_q, text_q = raw.get("quantization_config"), text.get("quantization_config")
    if top_q is not None and text_q is not None and top_q != text_q:
        raise _fail("quantization_config", "the top-level one and text_config's differ")
    for key in ("quantization_config", "torch_dtype", "dtype", "bos_token_id", "eos_token_id"):
        if inner.get(key) is None and raw.get(key) is not None:
            inner[key] = raw[key]
    return inner, {"weight_prefix": WRAPPER_PREFIX, "skipped_prefixes": VISION_PREFIXES}


def _model_config_from_dict(outer: dict[str, Any]) -> ModelConfig:
    raw, layout = _unwrap(outer)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _fail("model_type", f"'{model_type}' is not supported ({', '.join(SUPPORTED_MODEL_TYPES)})")
    heads = _get(raw, "num_attention_heads", int, minimum=1)
    kv_heads = raw.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise _fail("num_key_value_heads", f"MLA needs it equal to num_attention_heads ({heads}), got {kv_heads}")
    max_pos = _get(raw, "max_position_embeddings", int, 4096, minimum=1)
    n_routed = _get(raw, "n_routed_experts", int, 0, minimum=0)
    top_k = _get(raw, "num_experts_per_tok", int, 0 if n_routed == 0 else ..., minimum=0)
    n_group = _get(raw, "n_group", int, 1, minimum=1)
    topk_group = _get(raw, "topk_group", int, 1, minimum=1)
    scoring = raw.get("scoring_func", "sigmoid")
    topk_method = raw.get("topk_method", "noaux_tc")
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=_get(raw, "vocab_size", int, minimum=1),
        hidden_size=_get(raw, "hidden_size", int, minimum=1),
        intermediate_size=_get(raw, "intermediate_size", int, minimum=1),
        num_hidden_layers=_get(raw, "num_hidden_layers", int, minimum=1),
        num_attention_heads=heads,
        kv_lora_rank=_get(raw, "kv_lora_rank", int, minimum=1),
        qk_nope_head_dim=_get(raw, "qk_nope_head_dim", int, minimum=1),
        qk_rope_head_dim=_get(raw, "qk_rope_head_dim", int, minimum=2),
        v_head_dim=_get(raw, "v_head_dim", int, minimum=1),
        q_lora_rank=_get(raw, "q_lora_rank", int, None, minimum=1),
        n_routed_experts=n_routed,
        num_experts_per_tok=top_k,
        n_shared_experts=_get(raw, "n_shared_experts", int, 0, minimum=0),
        moe_intermediate_size=_get(raw, "moe_intermediate_size", int, 0 if n_routed == 0 else ...),
        first_k_dense_replace=_get(raw, "first_k_dense_replace", int, 0, minimum=0),
        moe_layer_freq=_get(raw, "moe_layer_freq", int, 1, minimum=1),
        n_group=n_group,
        topk_group=topk_group,
        topk_method=topk_method,
        scoring_func=scoring,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=_get(raw, "routed_scaling_factor", float, 1.0),
        rope=RopeConfig.from_hf(raw, max_pos),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        max_position_embeddings=max_pos,
        rms_norm_eps=_get(raw, "rms_norm_eps", float, 1e-6),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        hidden_act=raw.get("hidden_act", "silu"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        quantization=parse_quantization(raw.get("quantization_config")),
        extra={k: raw[k] for k in ("quantization_config",) if k in raw},
        **layout,
    )
    if isinstance(cfg.quantization, Int4Scheme):
        cfg = dataclasses.replace(cfg, int4_expert_layers=int4_expert_layers(cfg, cfg.quantization))
    _validate(cfg)
    return cfg


def _validate(cfg: ModelConfig) -> None:
    if cfg.scoring_func not in ("sigmoid", "softmax"):
        raise _fail("scoring_func", f"'{cfg.scoring_func}' is not supported (sigmoid, softmax)")
    if cfg.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise _fail("topk_method", f"'{cfg.topk_method}' is not supported")
    if cfg.hidden_act != "silu":
        raise _fail("hidden_act", f"'{cfg.hidden_act}' is not supported (silu)")
    if cfg.qk_rope_head_dim % 2:
        raise _fail("qk_rope_head_dim", f"must be even, got {cfg.qk_rope_head_dim}")
    if cfg.n_routed_experts:
        if cfg.num_experts_per_tok < 1 or cfg.num_experts_per_tok > cfg.n_routed_experts:
            raise _fail(
                "num_experts_per_tok",
                f"must be in [1, n_routed_experts={cfg.n_routed_experts}], got {cfg.num_experts_per_tok}",
            )
        if cfg.n_routed_experts % cfg.n_group:
            raise _fail("n_group", f"n_routed_experts={cfg.n_routed_experts} is not divisible by {cfg.n_group}")
        if cfg.topk_group > cfg.n_group:
            raise _fail("topk_group", f"{cfg.topk_group} exceeds n_group={cfg.n_group}")
        per_group = cfg.n_routed_experts // cfg.n_group
        if cfg.topk_method == "noaux_tc" and cfg.n_group > 1 and per_group < 2:
            raise _fail("n_group", "noaux_tc group scores need at least 2 experts per group")
        if cfg.topk_group * per_group < cfg.num_experts_per_tok:
            raise _fail("topk_group", "the chosen groups hold fewer experts than num_experts_per_tok")
        if cfg.moe_intermediate_size < 1:
            raise _fail("moe_intermediate_size", "must be >= 1 for a MoE model")
    group = cfg.int4_group_size
    for name in ("hidden_size", "moe_intermediate_size"):
        if group and getattr(cfg, name) % group:
            raise _fail(name, f"{getattr(cfg, name)} is not a multiple of the INT4 group size {group}")
    if cfg.first_k_dense_replace > cfg.num_hidden_layers:
        raise _fail("first_k_dense_replace", f"exceeds num_hidden_layers={cfg.num_hidden_layers}")
    if cfg.bos_token_id is not None and not (0 <= cfg.bos_token_id < cfg.vocab_size):
        raise _fail("bos_token_id", f"{cfg.bos_token_id} is outside the vocabulary")
    for e in cfg.eos_token_ids:
        if not 0 <= e < cfg.vocab_size:
            raise _fail("eos_token_id", f"{e} is outside the vocabulary ({cfg.vocab_size})")


# ---- DFlash drafter -----------------------------------------------------------------
DRAFTER_LAYER_TYPES = ("full_attention", "sliding_attention")
# DFlash2 checkpoints add convolutions and a candidate selector that treeflash does not run.
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class DrafterConfig:
    """A z-lab DFlash drafter: Qwen3-style decoder layers fed by the target's tapped hiddens.

    `target_layer_ids` are target decoder layers whose OUTPUT is tapped (HF
    `hidden_states[L+1]`); they come from the checkpoint and are never guessed.
    `is_causal` None means the reference default: causal inside the block for sliding
    layers, bidirectional for full layers; a bool overrides it for every layer.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    vocab_size: int | None = None
    is_causal: bool | None = None
    attention_bias: bool = False
    hidden_act: str = "silu"
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    torch_dtype: str = "float32"

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def is_causal_layer(self, layer: int) -> bool:
        """Whether block queries of `layer` see only earlier block slots."""
        return self.is_sliding(layer) if self.is_causal is None else self.is_causal

    def window(self, layer: int) -> int | None:
        """Sliding window W of `layer` (key j visible to query p iff p - j < W), else None."""
        return self.sliding_window if self.is_sliding(layer) else None

    @staticmethod
    def from_hf(source: str | Path | dict[str, Any]) -> DrafterConfig:
        """Build from a drafter's config.json path, its directory or a parsed dict."""
        return _drafter_config_from_dict(_read_json(source))

    def check_fits(self, target: ModelConfig) -> None:
        """Raise ValueError if this drafter cannot serve `target`."""
        if self.hidden_size != target.hidden_size:
            raise ValueError(
                f"drafter hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}"
            )
        if self.vocab_size is not None and self.vocab_size != target.vocab_size:
            raise ValueError(
                f"drafter vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}"
            )
        bad = [i for i in self.target_layer_ids if i >= target.num_hidden_layers]
        if bad:
            raise ValueError(
                f"drafter target_layer_ids {list(bad)} are beyond the target's "
                f"{target.num_hidden_layers} layers (valid: 0..{target.num_hidden_layers - 1})"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ValueError(
                f"drafter mask_token_id {self.mask_token_id} is outside the target vocabulary "
                f"(0..{target.vocab_size - 1})"
            )


def _dflash_value(raw: dict[str, Any], dflash: dict[str, Any], name: str, default: Any = ...):
    # The reference reads dflash_config first and falls back to a top-level key.
    if name in dflash and dflash[name] is not None:
        return dflash[name]
    if name in raw and raw[name] is not None:
        return raw[name]
    if default is ...:
        raise _fail(f"dflash_config.{name}", "is required")
    return default


def _drafter_layer_types(raw: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None:
        # Qwen3Config's own default: sliding from max_window_layers on, if enabled at all.
        first = _get(raw, "max_window_layers", int, n_layers, minimum=0)
        sliding = bool(raw.get("use_sliding_window")) and raw.get("sliding_window") is not None
        return tuple(
            "sliding_attention" if sliding and i >= first else "full_attention"
            for i in range(n_layers)
        )
    if not isinstance(types, list) or len(types) != n_layers:
        raise _fail("layer_types", f"expected a list of {n_layers} entries, got {types!r}")
    for t in types:
        if t not in DRAFTER_LAYER_TYPES:
            raise _fail("layer_types", f"'{t}' is not supported ({', '.join(DRAFTER_LAYER_TYPES)})")
    return tuple(types)


def _drafter_dflash_fields(raw: dict[str, Any]) -> dict[str, Any]:
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise _fail("dflash_config", f"expected an object, got {type(dflash).__name__}")
    for name in _DFLASH2_FIELDS:
        if name in dflash or name in raw:
            raise _fail(f"dflash_config.{name}", "DFlash2 drafters are not supported")
    taps = _dflash_value(raw, dflash, "target_layer_ids")
    if not isinstance(taps, list) or not taps or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in taps
    ):
        raise _fail("dflash_config.target_layer_ids",
                    f"expected a non-empty list of ints >= 0, got {taps!r}")
    block_raw = {"block_size": _dflash_value(raw, dflash, "block_size")}
    block = _get(block_raw, "block_size", int, minimum=2)
    mask = _dflash_value(raw, dflash, "mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
        raise _fail("dflash_config.mask_token_id", f"expected an int >= 0, got {mask!r}")
    extra = {k: _dflash_value(raw, dflash, k, None) for k in (
        "input_embedding_scale", "output_multiplier", "final_logit_softcapping")}
    return {"target_layer_ids": tuple(taps), "block_size": block, "mask_token_id": mask, **extra}


def _drafter_config_from_dict(raw: dict[str, Any]) -> DrafterConfig:
    hidden = _get(raw, "hidden_size", int, minimum=1)
    heads = _get(raw, "num_attention_heads", int, minimum=1)
    kv_heads = _get(raw, "num_key_value_heads", int, heads, minimum=1)
    if heads % kv_heads:
        raise _fail("num_key_value_heads",
                    f"{kv_heads} does not divide num_attention_heads={heads}")
    n_layers = _get(raw, "num_hidden_layers", int, minimum=1)
    max_pos = _get(raw, "max_position_embeddings", int, 32768, minimum=1)
    layer_types = _drafter_layer_types(raw, n_layers)
    window = _get(raw, "sliding_window", int, None, minimum=1)
    if "sliding_attention" in layer_types and window is None:
        raise _fail("sliding_window", "is required when layer_types has sliding_attention layers")
    is_causal = raw.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise _fail("is_causal", f"expected a bool or null, got {is_causal!r}")
    head_dim = _get(raw, "head_dim", int, hidden // heads, minimum=2)
    if head_dim % 2:
        raise _fail("head_dim", f"must be even for RoPE, got {head_dim}")
    d = _drafter_dflash_fields(raw)
    softcap = d["final_logit_softcapping"]
    cfg = DrafterConfig(
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_get(raw, "intermediate_size", int, minimum=1),
        rms_norm_eps=_get(raw, "rms_norm_eps", float, 1e-6),
        rope=RopeConfig.from_hf(raw, max_pos),
        max_position_embeddings=max_pos,
        layer_types=layer_types,
        sliding_window=window,
        target_layer_ids=d["target_layer_ids"],
        block_size=d["block_size"],
        mask_token_id=d["mask_token_id"],
        vocab_size=_get(raw, "vocab_size", int, None, minimum=1),
        is_causal=is_causal,
        attention_bias=bool(raw.get("attention_bias", False)),
        hidden_act=raw.get("hidden_act", "silu"),
        num_target_layers=_get(raw, "num_target_layers", int, None, minimum=1),
        input_embedding_scale=float(d["input_embedding_scale"] or 1.0),
        output_multiplier=float(d["output_multiplier"] or 1.0),
        final_logit_softcapping=float(softcap) if softcap else None,
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
    )
    if cfg.hidden_act != "silu":
        raise _fail("hidden_act", f"'{cfg.hidden_act}' is not supported (silu)")
    if cfg.num_target_layers is not None and max(cfg.target_layer_ids) >= cfg.num_target_layers:
        raise _fail("dflash_config.target_layer_ids", f"{list(cfg.target_layer_ids)} exceed "
                    f"num_target_layers={cfg.num_target_layers}")
    if cfg.vocab_size is not None and cfg.mask_token_id >= cfg.vocab_size:
        raise _fail("dflash_config.mask_token_id",
                    f"{cfg.mask_token_id} is outside vocab_size={cfg.vocab_size}")
    return cfg
