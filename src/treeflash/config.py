"""Frozen model configurations, converted once from Hugging Face `config.json`.

`ModelConfig.from_hf` is the only place in treeflash that reads a target's config.json;
everything downstream sees these dataclasses, never a transformers object.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


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

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    # ---- construction --------------------------------------------------------------
    @staticmethod
    def from_hf(source: str | Path | dict[str, Any]) -> ModelConfig:
        """Build from a config.json path, a model directory or an already-parsed dict."""
        raw = _read_json(source)
        return _model_config_from_dict(raw)


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


def _model_config_from_dict(raw: dict[str, Any]) -> ModelConfig:
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
        extra={k: raw[k] for k in ("quantization_config",) if k in raw},
    )
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
    if cfg.first_k_dense_replace > cfg.num_hidden_layers:
        raise _fail("first_k_dense_replace", f"exceeds num_hidden_layers={cfg.num_hidden_layers}")
    if cfg.bos_token_id is not None and not (0 <= cfg.bos_token_id < cfg.vocab_size):
        raise _fail("bos_token_id", f"{cfg.bos_token_id} is outside the vocabulary")
    for e in cfg.eos_token_ids:
        if not 0 <= e < cfg.vocab_size:
            raise _fail("eos_token_id", f"{e} is outside the vocabulary ({cfg.vocab_size})")
