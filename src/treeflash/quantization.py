"""Weight quantization schemes a checkpoint's `quantization_config` may declare, read once.

Two are implemented: DeepSeek-V3's FP8 block-scaled weights (`quant_method: fp8`, dequantized
at load) and compressed-tensors' `pack-quantized` symmetric grouped INT4 weights (W4A16, as
Kimi K2.5 / K2.6 publish their routed experts; kept packed in memory, `kernels/int4.py`).
Anything else (other bit widths, asymmetric or activation quantization, other formats) is
refused here with a message naming it, before a byte of weights is read.

compressed-tensors decides which modules a config group quantizes by its `targets` (module
names, `re:` regexes matched from the start of the name, or class names) minus its `ignore`
list (the same kinds); `Int4Scheme.quantizes` does the same on module names as the checkpoint
spells them (with the `language_model.` prefix of a wrapped checkpoint).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treeflash.config import ModelConfig

# Fields of a compressed-tensors config that must be absent / empty for the schemes below.
_MUST_BE_EMPTY = ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config")


def _fail(name: str, msg: str) -> ValueError:
    return ValueError(f"config.json: quantization_config.{name}: {msg}")


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 e4m3 weights with one float32 `weight_scale_inv` per [block_out, block_in] tile."""

    block: tuple[int, int] = (128, 128)


@dataclass(frozen=True)
class Int4Scheme:
    """compressed-tensors `pack-quantized`: symmetric INT4 in groups of `group_size` along the
    input dim, weights only (W4A16). Stored per projection as `weight_packed` int32 [out, in/8],
    `weight_scale` [out, in/group_size] and `weight_shape` [2] (the layout: `kernels/int4.py`)."""

    group_size: int
    num_bits: int = 4
    symmetric: bool = True
    strategy: str = "group"
    format: str = "pack-quantized"
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

    @cached_property
    def _matchers(self) -> tuple[_Matcher, _Matcher]:
        return _Matcher.of(self.targets), _Matcher.of(self.ignore)

    def quantizes(self, name: str | tuple[str, ...], cls: str = "Linear") -> bool:
        """Whether module `name` (class `cls`) is stored quantized: a target matches and no
        ignore entry does (compressed-tensors' `is_match`). A tuple gives one module's names
        (with and without a wrapper's prefix): an entry matching any of them counts."""
        names = (name,) if isinstance(name, str) else name
        targets, ignore = self._matchers
        return targets.any(names, cls) and not ignore.any(names, cls)


@dataclass(frozen=True)
class _Matcher:
    """Entries of a targets / ignore list: plain ones equal a module's name or class name,
    `re:` ones match from the start of its name (all of them in one alternation)."""

    plain: frozenset[str]
    regex: re.Pattern | None

    @staticmethod
    def of(entries: tuple[str, ...]) -> _Matcher:
        patterns = [e[3:] for e in entries if e.startswith("re:")]
        for p in patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise _fail("ignore/targets", f"'re:{p}' is not a valid regex ({e})") from None
        regex = re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None
        return _Matcher(frozenset(e for e in entries if not e.startswith("re:")), regex)

    def any(self, names: tuple[str, ...], cls: str) -> bool:
        if cls in self.plain or any(n in self.plain for n in names):
            return True
        return self.regex is not None and any(self.regex.match(n) for n in names)


Scheme = Fp8Scheme | Int4Scheme


def parse_quantization(q: Any) -> Scheme | None:
    """The scheme of a `quantization_config` object (None: not quantized)."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"config.json: quantization_config: expected an object, got {q!r}")
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8(q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    raise _fail("quant_method", f"'{method}' is not supported (fp8, compressed-tensors)")


def _fp8(q: dict) -> Fp8Scheme:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _fail("fmt", f"'{fmt}' is not supported (e4m3)")
    block = q.get("weight_block_size", [128, 128])
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise _fail("weight_block_size", f"expected two positive ints, got {block!r}")
    return Fp8Scheme((block[0], block[1]))


def _compressed_tensors(q: dict) -> Int4Scheme:
    fmt = q.get("format")
    if fmt != "pack-quantized":
        raise _fail("format", f"'{fmt}' is not supported (pack-quantized)")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise _fail("quantization_status", f"'{status}': only compressed checkpoints are read")
    for name in _MUST_BE_EMPTY:
        if q.get(name):
            raise _fail(name, f"{q[name]!r} is not supported")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _fail("config_groups", f"expected a non-empty object, got {groups!r}")
    ignore = _strings(q.get("ignore") or [], "ignore")
    parsed = [_group(name, g, fmt) for name, g in groups.items()]
    if len({s.group_size for s in parsed}) != 1:
        raise _fail("config_groups", "groups with different group sizes are not supported")
    targets = tuple(t for s in parsed for t in s.targets)
    return Int4Scheme(group_size=parsed[0].group_size, targets=targets, ignore=ignore)


def _strings(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise _fail(name, f"expected a list of strings, got {value!r}")
    return tuple(value)


def _group(name: str, g: Any, fmt: str) -> Int4Scheme:
    """One config group: weight-only, symmetric, INT4, grouped."""
    where = f"config_groups.{name}"
    if not isinstance(g, dict):
        raise _fail(where, f"expected an object, got {g!r}")
    if g.get("format") not in (None, fmt):
        raise _fail(f"{where}.format", f"'{g['format']}' is not supported (pack-quantized)")
    for acts in ("input_activations", "output_activations"):
        if g.get(acts) is not None:
            raise _fail(f"{where}.{acts}", "quantized activations are not supported (weights only: W4A16)")
    w = g.get("weights")
    if not isinstance(w, dict):
        raise _fail(f"{where}.weights", f"expected an object, got {w!r}")
    _check_weights(f"{where}.weights", w)
    targets = _strings(g.get("targets") or [], f"{where}.targets")
    if not targets:
        raise _fail(f"{where}.targets", "is empty")
    return Int4Scheme(group_size=w["group_size"], targets=targets)


def _check_weights(where: str, w: dict) -> None:
    expect = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    for key, want in expect.items():
        if w.get(key) != want:
            raise _fail(f"{where}.{key}", f"{w.get(key)!r} is not supported (only {want!r}: symmetric INT4 groups)")
    g = w.get("group_size")
    if not isinstance(g, int) or isinstance(g, bool) or g < 8 or g % 8:
        raise _fail(f"{where}.group_size", f"expected a positive multiple of 8, got {g!r}")
    for key in ("dynamic", "actorder", "block_structure"):
        if w.get(key) not in (None, False):
            raise _fail(f"{where}.{key}", f"{w[key]!r} is not supported")


def _plain_modules(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(name, class) of every module a quantization config could target, routed experts aside."""
    out = [("model.embed_tokens", "Embedding"), ("lm_head", "Linear")]
    attn = ["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    attn += ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    for i in range(cfg.num_hidden_layers):
        out += [(f"model.layers.{i}.self_attn.{a}", "Linear") for a in attn]
        mlp = f"model.layers.{i}.mlp"
        if not cfg.is_moe_layer(i):
            out += [(f"{mlp}.{k}_proj", "Linear") for k in ("gate", "up", "down")]
            continue
        out.append((f"{mlp}.gate", "MoEGate"))
        if cfg.n_shared_experts:
            out += [(f"{mlp}.shared_experts.{k}_proj", "Linear") for k in ("gate", "up", "down")]
    return out


def int4_expert_layers(cfg: ModelConfig, scheme: Int4Scheme) -> tuple[int, ...]:
    """The MoE layers whose routed experts `scheme` quantizes (all of a layer's or none); any
    other quantized module is refused: treeflash keeps only routed experts in INT4. Names are
    matched as the checkpoint spells them and without its wrapper prefix (copies differ)."""
    p = cfg.weight_prefix
    names = (lambda n: (p + n, n)) if p else (lambda n: n)
    for name, cls in _plain_modules(cfg):
        if scheme.quantizes(names(name), cls):
            raise _fail("ignore", f"the config quantizes '{p}{name}', which treeflash does not run in "
                        "INT4 (only routed experts; the published Kimi K2.5/K2.6 `ignore` list keeps it bf16)")
    layers = []
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(i):
            continue
        mlp = f"model.layers.{i}.mlp.experts"
        flags = {scheme.quantizes(names(f"{mlp}.{e}.{k}_proj"))
                 for e in range(cfg.n_routed_experts) for k in ("gate", "up", "down")}
        if len(flags) > 1:
            raise _fail("ignore", f"the config quantizes some of layer {i}'s routed experts but not all "
                        "(a layer's experts are stored in one format)")
        if True in flags:
            layers.append(i)
    return tuple(layers)
