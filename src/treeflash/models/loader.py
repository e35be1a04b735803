"""Load Hugging Face DeepSeek-V3 / Kimi-K2 safetensors checkpoints into `TargetModel`.

Single file or sharded (`model.safetensors.index.json`); fp32/bf16/fp16 tensors, and FP8
e4m3 weights with block-wise `weight_scale_inv` (dequantised here, at load). Per-expert
tensors (`mlp.experts.{e}.{gate,up,down}_proj.weight`) are stacked into the model's
[E, ...] parameters. Every expected tensor must be present with its exact shape; any other
tensor is an error, except multi-token-prediction layers (index >= num_hidden_layers),
which inference does not use. Never unpickles anything.

Under tensor/expert parallelism (`treeflash.dist.parallel.Parallel`) each rank reads only
its slice of every split tensor through safetensors' `get_slice` (FP8 weights and their
scales are read on whole 128-blocks and trimmed after dequantisation) and skips the
routed experts it does not own; the strictness rules are the same.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from treeflash.config import ModelConfig
from treeflash.dist.parallel import Parallel, split
from treeflash.models.target import TargetModel

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEAD_ROWS = re.compile(r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight$")
_MLP = re.compile(r"\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight$")
_SKIP = "skip"  # a routed expert another rank owns
Cut = tuple[int, int, int]  # (dim, start, stop): the part of a tensor this rank reads


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
            if isinstance(e, ValueError) and str(e).startswith("tensor"):
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


def _fp8_block(cfg: ModelConfig) -> tuple[int, int]:
    q = cfg.extra.get("quantization_config") or {}
    block = q.get("weight_block_size", [128, 128])
    return int(block[0]), int(block[1])


def _cut(name: str, cfg: ModelConfig, par: Parallel) -> Cut | str | None:
    """This rank's part of tensor `name`: None (all of it), _SKIP, or (dim, start, stop)."""
    m = _EXPERT.match(name)
    if m:
        e = int(m.group(2))
        if 0 <= e < cfg.n_routed_experts and e // par.local_experts(cfg) != par.ep_rank:
            return _SKIP
        if par.moe_tp_size == 1:
            return None
        start, stop = split(cfg.moe_intermediate_size, par.moe_tp_size, par.moe_tp_rank)
        return (1 if m.group(3) == "down" else 0, start, stop)
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


def _selector(cfg: ModelConfig, par: Parallel, block: tuple[int, int] | None):
    def select(name: str, shape: list[int]):
        is_scale = name.endswith("_scale_inv")
        cut = _cut(name[: -len("_scale_inv")] if is_scale else name, cfg, par)
        if cut is None or cut is _SKIP:
            return cut
        dim, start, stop = cut
        if is_scale:  # the blocks that cover the weight's read range
            b = block[dim] if block else 1
            start, stop = start // b, -(-stop // b)
        else:
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


def _collect(cfg: ModelConfig, files: list[Path], par: Parallel | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor (this rank's part of it), dequantise FP8 pairs, drop MTP layers."""
    par = par or Parallel()
    block = _fp8_block(cfg) if cfg.extra.get("quantization_config") else None
    raw: dict[str, torch.Tensor] = {}
    for name, t in iter_tensors(files, _selector(cfg, par, block)):
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue  # multi-token-prediction module: not used for inference
        raw[name] = t
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            base = name[: -len("_scale_inv")]
            if base not in raw:
                raise ValueError(f"tensor '{name}' has no matching weight '{base}'")
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = raw.get(name + "_scale_inv")
            if scale is None:
                raise ValueError(f"tensor '{name}' is FP8 but '{name}_scale_inv' is missing")
            try:
                t = dequantize_fp8(t, scale, _fp8_block(cfg))
            except ValueError as e:
                raise ValueError(f"tensor '{name}': {e}") from None
        elif t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"tensor '{name}' has unsupported dtype {t.dtype}")
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
    par = par or Parallel()
    owned = range(par.expert_offset(cfg), par.expert_offset(cfg) + par.local_experts(cfg))
    grouped: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    rest: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m:
            grouped.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
        else:
            rest[name] = t
    for (prefix, kind), experts in grouped.items():
        missing = sorted(set(owned) - set(experts))
        extra = sorted(set(experts) - set(range(cfg.n_routed_experts)))
        if missing:
            raise ValueError(f"missing tensor '{prefix}.experts.{missing[0]}.{kind}_proj.weight'")
        if extra:
            raise ValueError(f"unexpected tensor '{prefix}.experts.{extra[0]}.{kind}_proj.weight'")
        shapes = {tuple(t.shape) for t in experts.values()}
        if len(shapes) != 1:
            raise ValueError(f"'{prefix}.experts.*.{kind}_proj.weight' have different shapes: {shapes}")
        rest[f"{prefix}.experts_{kind}"] = torch.stack([experts[e] for e in owned])
    return rest


def load_state(model: TargetModel, path: Path, dtype: torch.dtype) -> None:
    """Fill `model` (already on its device; its `parallel` says which shard) strictly."""
    cfg, par = model.cfg, model.parallel
    tensors = _stack_experts(cfg, _collect(cfg, checkpoint_files(path), par), par)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    params = dict(model.named_parameters())
    buffers = {n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    expected = {**params, **buffers}
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(f"unexpected tensor '{unexpected[0]}' in {path} ({len(unexpected)} in all)")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"missing tensor '{_hf_name(missing[0])}' in {path} ({len(missing)} in all)")
    with torch.no_grad():
        for name, target in expected.items():
            src = tensors[name]
            if src.shape != target.shape:
                raise ValueError(
                    f"tensor '{_hf_name(name)}' has shape {tuple(src.shape)}, expected {tuple(target.shape)}"
                )
            # Router weights and biases stay float32, as in the reference; a 16-bit router weight
            # stays as stored (every use upcasts it, exactly, as the reference's float32 GEMM
            # does), so the split router launch reads half the bytes.
            if name.endswith(".gate.weight") and src.dtype in (torch.bfloat16, torch.float16):
                target.data = torch.empty_like(target, dtype=src.dtype)
                target.copy_(src)
                continue
            keep32 = name.endswith(("gate.weight", "e_score_correction_bias"))
            target.copy_(src.to(torch.float32 if keep32 else dtype))


def _hf_name(name: str) -> str:
    m = re.match(r"^(model\.layers\.\d+\.mlp)\.experts_(gate|up|down)$", name)
    return f"{m.group(1)}.experts.*.{m.group(2)}_proj.weight" if m else name


def load_target(
    path: str | Path, device: torch.device, dtype: torch.dtype, parallel: Parallel | None = None
) -> TargetModel:
    path = Path(path)
    cfg = ModelConfig.from_hf(path)
    with torch.device("meta"):
        model = TargetModel(cfg, parallel)
    model = model.to_empty(device=device)
    model.to(dtype)
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gate.float()
    model.rotary = type(model.rotary)(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_state(model, path, dtype)
    model.fuse_projections()
    return model.eval()
