"""Load Hugging Face DeepSeek-V3 / Kimi-K2 safetensors checkpoints into `TargetModel`.

Single file or sharded (`model.safetensors.index.json`); fp32/bf16/fp16 tensors, FP8 e4m3
weights with block-wise `weight_scale_inv` (dequantised here, at load), and routed experts in
compressed-tensors' pack-quantized INT4 (`weight_packed` int32, `weight_scale` bf16,
`weight_shape`; kept packed: `kernels/int4.py`). Per-expert tensors
(`mlp.experts.{e}.{gate,up,down}_proj.*`) are stacked into the model's [E, ...] parameters or
buffers. A `KimiK25ForConditionalGeneration` checkpoint keeps the language model under
`language_model.` and a vision tower (`vision_tower.*`, `mm_projector.*`), which is not read.
Every expected tensor must be present with its exact shape; any other tensor is an error,
except multi-token-prediction layers (index >= num_hidden_layers), which inference does not
use. Never unpickles anything.

Under tensor/expert parallelism (`treeflash.sharding.Parallel`) each rank reads only
its slice of every split tensor through safetensors' `get_slice` (FP8 weights and their
scales are read on whole 128-blocks and trimmed after dequantisation; INT4 experts on whole
words and scale groups) and skips the routed experts it does not own; the strictness rules
are the same.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from treeflash.config import ModelConfig
from treeflash.kernels.int4 import PACK
from treeflash.models.target import TargetModel
from treeflash.quantization import Fp8Scheme
from treeflash.runtime import DEFAULT, RuntimeOptions
from treeflash.sharding import Parallel, split

log = logging.getLogger(__name__)

# field: "weight" (a plain or FP8 tensor) or one of an INT4 projection's three tensors
_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\."
                     r"(weight|weight_packed|weight_scale|weight_shape)$")
_INT4_FIELDS = ("weight_packed", "weight_scale", "weight_shape")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEAD_ROWS = re.compile(r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight$")
_MLP = re.compile(r"\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight$")
_SKIP = "skip"  # a routed expert another rank owns
Cut = tuple[int, int, int]  # (dim, start, stop): the part of a tensor this rank reads


class CheckpointError(ValueError):
    """A tensor the checkpoint layout does not allow (raised while reading, never wrapped)."""


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (index first, else model.safetensors)."""
    if not path.is_dir():
        raise ValueError(f"model path {path} is not a directory")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path} (pickle checkpoints are not loaded)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{path}: shard(s) named in the index are missing: {', '.join(missing)}")
    return files


def iter_tensors(
    files: list[Path], select: Callable[[str, list[int]], object] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor; `select(name, shape)` may return None (read it all),
    _SKIP, or an index of slices (read only that part from disk)."""
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    if select is None:
                        yield name, handle.get_tensor(name)
                        continue
                    part = handle.get_slice(name)
                    index = select(name, list(part.get_shape()))
                    if index is _SKIP:
                        continue
                    yield name, handle.get_tensor(name) if index is None else part[index]
        except Exception as e:  # safetensors raises its own error types
            if isinstance(e, CheckpointError) or (isinstance(e, ValueError) and str(e).startswith("tensor")):
                raise
            raise ValueError(f"{f}: cannot read as safetensors ({e})") from None


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W = W_fp8 * scale_inv, one scale per [block_out, block_in] tile."""
    out_f, in_f = weight.shape
    bo, bi = block
    expected = ((out_f + bo - 1) // bo, (in_f + bi - 1) // bi)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} != expected {expected}")
    scale = scale_inv.float().repeat_interleave(bo, 0)[:out_f].repeat_interleave(bi, 1)[:, :in_f]
    return weight.float() * scale


def _fp8_block(cfg: ModelConfig) -> tuple[int, int] | None:
    q = cfg.quantization
    return q.block if isinstance(q, Fp8Scheme) else None


def _cut(name: str, cfg: ModelConfig, par: Parallel) -> Cut | str | None:
    """This rank's part of tensor `name`: None (all of it), _SKIP, or (dim, start, stop). An
    INT4 expert's packed words and scale groups are cut where its logical weight is."""
    m = _EXPERT.match(name)
    if m:
        e, field = int(m.group(3)), m.group(5)
        if 0 <= e < cfg.n_routed_experts and e // par.local_experts(cfg) != par.ep_rank:
            return _SKIP
        if par.moe_tp_size == 1 or field == "weight_shape":
            return None
        start, stop = split(cfg.moe_intermediate_size, par.moe_tp_size, par.moe_tp_rank)
        dim = 1 if m.group(4) == "down" else 0
        per = {"weight_packed": PACK, "weight_scale": cfg.int4_group_size or 1}.get(field, 1) if dim else 1
        if start % per:  # Parallel.validate refuses such splits; a defence for a hand-made Parallel
            raise ValueError(f"tensor '{name}': rank {par.tp_rank}'s slice starts mid-group ({start} % {per})")
        return dim, start // per, stop // per
    if not par.sharded:
        return None
    h0, h1 = split(cfg.num_attention_heads, par.tp_size, par.tp_rank)
    m = _HEAD_ROWS.search(name)
    if m:
        per_head = cfg.qk_head_dim if m.group(1) != "kv_b_proj" else cfg.qk_nope_head_dim + cfg.v_head_dim
        return (0, h0 * per_head, h1 * per_head)
    if name.endswith(".self_attn.o_proj.weight"):
        return (1, h0 * cfg.v_head_dim, h1 * cfg.v_head_dim)
    m = _MLP.search(name)
    if m:
        inter = cfg.moe_intermediate_size * cfg.n_shared_experts if m.group(1) else cfg.intermediate_size
        start, stop = split(inter, par.tp_size, par.tp_rank)
        return (1 if m.group(2) == "down" else 0, start, stop)
    return None


def _block_read(cut: Cut, shape: list[int], block: tuple[int, int] | None) -> Cut:
    """The read range for `cut`, widened to whole FP8 blocks when the checkpoint is FP8."""
    dim, start, stop = cut
    if block is None:
        return cut
    b = block[dim]
    return dim, start // b * b, min(-(-stop // b) * b, shape[dim] if dim < len(shape) else stop)


def _local_name(name: str, cfg: ModelConfig) -> str:
    """The language model's name of checkpoint tensor `name` (the wrapper's `language_model.`
    prefix dropped), or _SKIP for a vision-tower tensor."""
    prefix = cfg.weight_prefix
    if not prefix:
        return name
    if name.startswith(prefix):
        return name[len(prefix):]
    if name.startswith(cfg.skipped_prefixes):
        return _SKIP
    raise CheckpointError(f"unexpected tensor '{name}': this checkpoint keeps the language model under "
                          f"'{prefix}' and skips only {', '.join(p + '*' for p in cfg.skipped_prefixes)}")


def _selector(cfg: ModelConfig, par: Parallel, block: tuple[int, int] | None, skipped: list[str]):
    def select(name: str, shape: list[int]):
        name = _local_name(name, cfg)
        if name is _SKIP:
            skipped.append(name)
            return _SKIP
        is_scale = name.endswith("_scale_inv")
        cut = _cut(name[: -len("_scale_inv")] if is_scale else name, cfg, par)
        if cut is None or cut is _SKIP:
            return cut
        dim, start, stop = cut
        if is_scale:  # the blocks that cover the weight's read range
            b = block[dim] if block else 1
            start, stop = start // b, -(-stop // b)
        elif not name.endswith(_INT4_FIELDS):  # INT4 parts are cut exactly (_cut)
            _, start, stop = _block_read(cut, shape, block)
        return (slice(None),) * dim + (slice(start, stop),)

    return select


def _trim(t: torch.Tensor, cut: Cut, block: tuple[int, int] | None) -> torch.Tensor:
    """Cut the block-aligned read back to exactly this rank's range."""
    dim, start, stop = cut
    offset = start - start // block[dim] * block[dim] if block else 0
    if t.dim() <= dim or t.shape[dim] < offset + stop - start:
        return t  # a malformed tensor: the strict shape check reports it
    return t.narrow(dim, offset, stop - start)


def _read(cfg: ModelConfig, files: list[Path], par: Parallel) -> dict[str, torch.Tensor]:
    """This rank's part of every tensor by its language-model name; MTP layers and a vision
    tower dropped (the latter named in one log line)."""
    skipped: list[str] = []
    raw: dict[str, torch.Tensor] = {}
    for name, t in iter_tensors(files, _selector(cfg, par, _fp8_block(cfg), skipped)):
        name = _local_name(name, cfg)
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue  # multi-token-prediction module: not used for inference
        raw[name] = t
    if skipped:
        log.info("not loading %d vision-tower tensors (%s): treeflash runs the language model only",
                 len(skipped), ", ".join(p + "*" for p in cfg.skipped_prefixes))
    return raw


def _collect(cfg: ModelConfig, files: list[Path], par: Parallel | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor (this rank's part of it), dequantise FP8 pairs, drop MTP layers and a
    vision tower. INT4 tensors pass as stored (`_stack_experts` checks them)."""
    par = par or Parallel()
    block = _fp8_block(cfg)
    raw = _read(cfg, files, par)
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            base = name[: -len("_scale_inv")]
            if base not in raw:
                raise ValueError(f"tensor '{cfg.weight_prefix}{name}' has no matching weight '{base}'")
            continue
        if name.endswith(_INT4_FIELDS):
            out[name] = t
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = raw.get(name + "_scale_inv")
            if scale is None:
                raise ValueError(f"tensor '{name}' is FP8 but '{name}_scale_inv' is missing")
            try:
                t = dequantize_fp8(t, scale, block or (128, 128))
            except ValueError as e:
                raise ValueError(f"tensor '{name}': {e}") from None
        elif t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"tensor '{cfg.weight_prefix}{name}' has unsupported dtype {t.dtype}")
        cut = _cut(name, cfg, par)
        if isinstance(cut, tuple):
            t = _trim(t, cut, block)
        if par.tp_rank != 0 and name.endswith(".self_attn.o_proj.bias"):
            t = torch.zeros_like(t)  # row-parallel bias: added once, by rank 0, in the all-reduce
        out[name] = t
    return out


def _stack_experts(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], par: Parallel | None = None
) -> dict[str, torch.Tensor]:
    """Stack each layer's per-expert tensors into [E, ...] (`{mlp}.experts_{kind}` for plain
    weights, `{mlp}.experts_{kind}_packed` / `_scale` for INT4), strictly: the format the config
    gives the layer, every owned expert, one shape, INT4 `weight_shape` equal to the config's."""
    par = par or Parallel()
    owned = range(par.expert_offset(cfg), par.expert_offset(cfg) + par.local_experts(cfg))
    grouped: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    rest: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m:
            _check_field(cfg, name, int(m.group(2)), m.group(5))
            grouped.setdefault((m.group(1), m.group(4), m.group(5)), {})[int(m.group(3))] = t
        else:
            rest[name] = t
    for layer in cfg.int4_expert_layers:  # weight_shape has no buffer to miss: check all three here
        for kind in ("gate", "up", "down"):
            for field in _INT4_FIELDS:
                if (f"model.layers.{layer}.mlp", kind, field) not in grouped:
                    raise ValueError(f"missing tensor '{cfg.weight_prefix}model.layers.{layer}.mlp.experts."
                                     f"{owned[0]}.{kind}_proj.{field}'")
    for (prefix, kind, field), experts in grouped.items():
        hf = f"{cfg.weight_prefix}{prefix}.experts.{{}}.{kind}_proj.{field}"
        missing = sorted(set(owned) - set(experts))
        extra = sorted(set(experts) - set(range(cfg.n_routed_experts)))
        if missing:
            raise ValueError(f"missing tensor '{hf.format(missing[0])}'")
        if extra:
            raise ValueError(f"unexpected tensor '{hf.format(extra[0])}'")
        if field == "weight_shape":
            _check_weight_shapes(cfg, kind, experts, hf)
            continue
        want = _expert_shape(cfg, par, kind, field)
        for e, t in sorted(experts.items()):
            if tuple(t.shape) != want:
                raise ValueError(f"tensor '{hf.format(e)}' has shape {tuple(t.shape)}, expected {want}")
        _check_int4_dtype(field, experts, hf)
        suffix = {"weight": "", "weight_packed": "_packed", "weight_scale": "_scale"}[field]
        rest[f"{prefix}.experts_{kind}{suffix}"] = torch.stack([experts[e] for e in owned])
    return rest


def _expert_shape(cfg: ModelConfig, par: Parallel, kind: str, field: str) -> tuple[int, int]:
    """This rank's part of one expert's `field` tensor: [out, in] of the logical weight, in
    words (in / 8) for weight_packed and groups for weight_scale."""
    inter = cfg.moe_intermediate_size // par.moe_tp_size
    n, k = (cfg.hidden_size, inter) if kind == "down" else (inter, cfg.hidden_size)
    per = {"weight_packed": PACK, "weight_scale": cfg.int4_group_size or 1}.get(field, 1)
    return n, k // per


def _check_field(cfg: ModelConfig, name: str, layer: int, field: str) -> None:
    """An expert tensor of the format the config gives its layer (INT4 triple or `weight`)."""
    if layer >= cfg.num_hidden_layers or (field in _INT4_FIELDS) == cfg.experts_int4(layer):
        return
    how = ("INT4 (weight_packed, weight_scale, weight_shape)" if cfg.experts_int4(layer)
           else "unquantized (weight)")
    raise ValueError(f"unexpected tensor '{cfg.weight_prefix}{name}': quantization_config stores layer "
                     f"{layer}'s routed experts {how}")


def _check_int4_dtype(field: str, experts: dict[int, torch.Tensor], hf: str) -> None:
    want = {"weight_packed": torch.int32, "weight_scale": torch.bfloat16}.get(field)
    for e, t in experts.items():
        if want is not None and t.dtype != want:
            raise ValueError(f"tensor '{hf.format(e)}' has dtype {t.dtype}, expected {want} "
                             "(compressed-tensors pack-quantized with bf16 scales, as Kimi K2.5/K2.6 publish)")


def _check_weight_shapes(cfg: ModelConfig, kind: str, experts: dict[int, torch.Tensor], hf: str) -> None:
    """Each INT4 projection's `weight_shape` is its logical [out, in] in the config."""
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    want = [hidden, inter] if kind == "down" else [inter, hidden]
    for e, t in experts.items():
        got = t.tolist() if t.dim() == 1 and not t.is_floating_point() else None
        if got != want:
            raise ValueError(f"tensor '{hf.format(e)}' is {got if got is not None else tuple(t.shape)}, "
                             f"but the config gives {kind}_proj the shape {want}")


def load_state(model: TargetModel, path: Path, dtype: torch.dtype) -> None:
    """Fill `model` (already on its device; its `parallel` says which shard) strictly."""
    cfg, par = model.cfg, model.parallel
    tensors = _stack_experts(cfg, _collect(cfg, checkpoint_files(path), par), par)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    params = dict(model.named_parameters())
    buffers = {n: b for n, b in model.named_buffers()
               if n.endswith(("e_score_correction_bias", "_packed", "_scale"))}
    expected = {**params, **buffers}
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(f"unexpected tensor '{_hf_name(cfg, unexpected[0])}' in {path} ({len(unexpected)} in all)")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"missing tensor '{_hf_name(cfg, missing[0])}' in {path} ({len(missing)} in all)")
    with torch.no_grad():
        for name, target in expected.items():
            src = tensors[name]
            if src.shape != target.shape:
                raise ValueError(f"tensor '{_hf_name(cfg, name)}' has shape {tuple(src.shape)}, "
                                 f"expected {tuple(target.shape)}")
            _copy(name, target, src, dtype)


def _copy(name: str, target: torch.Tensor, src: torch.Tensor, dtype: torch.dtype) -> None:
    # Router weights and biases stay float32, as in the reference; a 16-bit router weight
    # stays as stored (every use upcasts it, exactly, as the reference's float32 GEMM
    # does), so the split router launch reads half the bytes. INT4 words and their bf16
    # scales stay as stored, whatever the model's dtype.
    if (name.endswith(".gate.weight") and src.dtype in (torch.bfloat16, torch.float16)) or \
            name.endswith(("_packed", "_scale")):
        target.data = torch.empty_like(target, dtype=src.dtype)
        target.copy_(src)
        return
    keep32 = name.endswith(("gate.weight", "e_score_correction_bias"))
    target.copy_(src.to(torch.float32 if keep32 else dtype))


def _hf_name(cfg: ModelConfig, name: str) -> str:
    """The checkpoint's name of model tensor `name` (a stacked expert tensor: its per-expert form)."""
    m = re.match(r"^(model\.layers\.\d+\.mlp)\.experts_(gate|up|down)(_packed|_scale)?$", name)
    if m:
        name = f"{m.group(1)}.experts.*.{m.group(2)}_proj.weight{m.group(3) or ''}"
    return cfg.weight_prefix + name


def load_target(
    path: str | Path, device: torch.device, dtype: torch.dtype, parallel: Parallel | None = None,
    options: RuntimeOptions = DEFAULT,
) -> TargetModel:
    path = Path(path)
    cfg = ModelConfig.from_hf(path)
    with torch.device("meta"):
        model = TargetModel(cfg, parallel, options)
    model = model.to_empty(device=device)
    model.to(dtype)
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gate.float()
    model.rotary = type(model.rotary)(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave, options).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_state(model, path, dtype)
    model.fuse_projections()
    model.prepare_experts()
    return model.eval()
