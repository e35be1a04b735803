"""What a whole model needs on each GPU when served with tensor parallelism, from its config alone.

`treeflash doctor --memory-plan` prints it: the weights one rank holds, by kind (built on the meta
device with that rank's `Parallel`, so every split and replication is the engine's own), the KV
cache per 1k tokens (the latent row in every layer; under TP every rank holds the whole latent
cache) and the drafter's window a running request, the CUDA context, the step workspace and the
CUDA graphs' pool, against a GPU's memory; then the KV tokens the rest holds and the longest
context one request can have. A checkpoint directory's safetensors headers (never its tensors)
add what it stores, by kind.

The fixed reserves are stated assumptions, not measurements: the CUDA context, cuBLAS / Triton
workspaces and the allocator's slack as `memory.GPU_RESERVE`; the workspace and the graphs as the
activations of the widest step each holds (`activation_bytes`) plus the verify attention's split
partials (`ATTENTION_PARTIALS`). `bench sweep` records each run's CUDA peak beside its weights and
KV pool (`memory` in its JSON), which measures them on a preset.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from treeflash import memory
from treeflash.config import VISION_PREFIXES, WRAPPER_PREFIX, DrafterConfig, ModelConfig

MIB = 1 << 20
# memory.total as nvidia-smi reports it on the machines benchmarks/results/ ran on
# (h100-20261206-moe-tiles/sweep-new2.log: 81559 MiB; h200-20261203-split-fit-chunk/sweep-b31.log: 143771 MiB)
GPUS: dict[str, tuple[int, str]] = {
    "h100": (81559 * MIB, "H100 80GB HBM3"),
    "h200": (143771 * MIB, "H200 141GB HBM3e"),
}
PREFILL_CHUNK = 512  # rows of the engine's eager prefill chunk (engine/engine.py)
VERIFY_ROWS = 64  # the widest verify step a request runs: auto's largest tree + its root
# fp32 partials of the verify attention's splits: <= 4 programs an SM (132 on an H100) of 64 rows
# x 512 values (kernels/mla_verify/plan.py caps the splits at 4 x the SMs)
ATTENTION_PARTIALS = 4 * 132 * 64 * 512 * 4
KINDS = ("attention (MLA projections)", "dense MLP", "shared experts", "routed experts", "router",
         "embeddings / lm_head", "norms, rotary tables", "other", "drafter")
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


@dataclass(frozen=True)
class Gpu:
    """A GPU's memory (bytes) and what to call it."""

    memory: int
    name: str


def parse_gpu(text: str) -> Gpu:
    """A GPU of `GPUS` by name (h100, h200) or a size: 141GB, 139.8GiB, 150e9 (bytes)."""
    key = text.strip().lower()
    if key in GPUS:
        return Gpu(*GPUS[key])
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)", key)
    if m is None or m.group(2) not in ("", *_UNITS):
        raise ValueError(f"GPU memory {text!r}: expected {', '.join(GPUS)} or a size such as 141GB or 139.8GiB")
    size = int(float(m.group(1)) * _UNITS.get(m.group(2) or "b"))
    if size <= 0:
        raise ValueError(f"GPU memory {text!r} must be positive")
    return Gpu(size, f"a {text.strip()} GPU")


def tensor_kind(name: str) -> str:
    """The kind of a target tensor, by treeflash's module name or a checkpoint's Hugging Face name
    (with or without the `language_model.` prefix of a wrapped checkpoint)."""
    name = name.removeprefix(WRAPPER_PREFIX)
    leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embeddings / lm_head"
    if "norm" in leaf or name.startswith("rotary."):
        return "norms, rotary tables"
    if ".mlp.experts" in name:
        return "routed experts"
    if ".mlp.shared_experts." in name:
        return "shared experts"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense MLP"
    if ".self_attn." in name:
        return "attention (MLA projections)"
    return "other"


def activation_bytes(cfg: ModelConfig, tp: int, ep: int, rows: int) -> int:
    """The largest live tensors of a forward of `rows` rows on one rank, in float32 (an estimate):
    the residual stream, its normed copies and the sublayers' outputs (8 x hidden), this rank's
    query heads through the absorbed attention (q, q in the latent, the latent output), each row's
    routed experts' gate / up / product (top-k x 3 x this rank's intermediate) and the logits."""
    heads = cfg.num_attention_heads // tp
    inter = cfg.moe_intermediate_size // (tp // ep) if cfg.n_routed_experts else 0
    per_row = (8 * cfg.hidden_size + heads * (cfg.qk_head_dim + 2 * cfg.latent_dim)
               + cfg.num_experts_per_tok * 3 * inter + 2 * cfg.vocab_size)
    return rows * per_row * 4


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint directory stores, from its safetensors headers: files and bytes by kind."""

    files: int
    by_kind: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


def safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file (an 8-byte little-endian length, then the JSON): tensor
    names, dtypes, shapes and byte offsets. The tensors themselves are not read."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= 1 << 28:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not an object")
    return header


def read_checkpoint(path: str | Path) -> Checkpoint | None:
    """Bytes stored by kind (the vision tower apart) from every *.safetensors header under `path`;
    None where it has none (a config.json alone)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    by_kind: dict[str, int] = {}
    for f in files:
        for name, info in safetensors_header(f).items():
            if name == "__metadata__":
                continue
            try:
                start, end = info["data_offsets"]
            except (TypeError, KeyError, ValueError):
                raise ValueError(f"{f}: tensor {name!r} has no data_offsets in its header") from None
            kind = "vision tower (not loaded)" if name.startswith(VISION_PREFIXES) else tensor_kind(name)
            by_kind[kind] = by_kind.get(kind, 0) + end - start
    return Checkpoint(len(files), by_kind)


@dataclass(frozen=True)
class GpuPlan:
    """Rank 0's memory (the drafter runs there: the other ranks hold the same less the drafter)."""

    title: str
    tp: int
    ep: int
    dtype: torch.dtype
    kv_cache: str
    expert_format: str
    weights: dict[str, int]  # bytes by kind
    kv_per_token: int  # every target layer's latent row (+ the drafter's full layers), one rank
    drafter_window: int  # a running request's drafter rings (sliding layers)
    reserve: int
    workspace: int
    graphs: int
    rows: int  # the widest step's rows a request (its graphs; a request's room)
    batch: int
    max_positions: int
    layers: int
    checkpoint: Checkpoint | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fixed(self) -> int:
        """Everything but the KV cache."""
        return sum(self.weights.values()) + self.reserve + self.workspace + self.graphs

    def kv_tokens(self, gpu_memory: int) -> int:
        """KV tokens the memory left after `fixed` and each running request's drafter window holds."""
        return max(gpu_memory - self.fixed - self.batch * self.drafter_window, 0) // self.kv_per_token

    def longest_context(self, gpu_memory: int) -> int:
        """The longest context one of `batch` requests can have (room kept for its widest step's
        rows), within the model's max_position_embeddings."""
        return max(0, min(self.kv_tokens(gpu_memory) // self.batch - self.rows, self.max_positions))

    def fits(self, gpu_memory: int, context: int) -> bool:
        return self.longest_context(gpu_memory) >= context


def plan_model(cfg: ModelConfig, dcfg: DrafterConfig | None, tp: int = 1, ep: int = 1,
               dtype: torch.dtype = torch.bfloat16, kv_cache_dtype: str = "auto", batch: int = 1,
               title: str = "", checkpoint: Checkpoint | None = None) -> GpuPlan:
    """Rank 0's memory for `cfg` (+ `dcfg`) split over `tp` ranks (`ep` expert-parallel groups),
    serving `batch` requests at once; ValueError where a dimension does not split."""
    from treeflash.sharding import Parallel

    par = Parallel(tp_size=tp, tp_rank=0, ep_size=ep)
    par.validate(cfg)
    if dcfg is not None:
        dcfg.check_fits(cfg)
    weights = dict.fromkeys(KINDS, 0)
    for name, t, param in memory.meta_tensors(cfg, dcfg, par):
        kind = "drafter" if name.startswith("drafter.") else tensor_kind(name)
        weights[kind] += memory.tensor_bytes(t, param, dtype)
    fmt = "int4" if cfg.int4_expert_layers else str(dtype).removeprefix("torch.")
    weights = {(f"routed experts ({fmt})" if k == "routed experts" else k): v for k, v in weights.items() if v}
    rows = batch * VERIFY_ROWS
    return GpuPlan(
        title=title, tp=tp, ep=ep, dtype=dtype, kv_cache=kv_cache_dtype, expert_format=fmt, weights=weights,
        kv_per_token=memory.kv_bytes_per_token(cfg, dtype, dcfg, kv_cache_dtype),
        drafter_window=memory.drafter_window_bytes(dcfg, dtype), reserve=memory.GPU_RESERVE,
        workspace=activation_bytes(cfg, tp, ep, PREFILL_CHUNK) + ATTENTION_PARTIALS,
        graphs=activation_bytes(cfg, tp, ep, rows) + ATTENTION_PARTIALS, rows=VERIFY_ROWS, batch=batch,
        max_positions=cfg.max_position_embeddings, layers=cfg.num_hidden_layers, checkpoint=checkpoint)


def _size(n: int, width: int = 0) -> str:
    """GB (1e9) with two decimals, or MB below 10 MB."""
    return f"{n / 1e9:{width}.2f} GB" if n >= 10**7 else f"{n / 1e6:{width}.2f} MB"


def _row(label: str, n: int, note: str = "") -> str:
    return f"  {label:<40} {_size(n, 8)}" + (f"   {note}" if note else "")


def report(plan: GpuPlan, gpus: list[Gpu], context: int) -> str:
    """The plan, then one verdict line per GPU: KV room, tokens, the longest context, fits or not."""
    dtype = str(plan.dtype).removeprefix("torch.")
    rank = "one GPU" if plan.tp == 1 else "per GPU, rank 0 (it also runs the drafter; the other ranks hold " \
        "the same less the drafter)" if "drafter" in plan.weights else "per GPU"
    kv = f"auto ({dtype})" if plan.kv_cache == "auto" else plan.kv_cache
    lines = [f"memory plan: {plan.title}, TP {plan.tp}" + (f", EP {plan.ep}" if plan.ep > 1 else "")
             + f", weights {dtype}, KV cache {kv}; {rank}"]
    notes = {"embeddings / lm_head": "replicated on every rank",
             f"routed experts ({plan.expert_format})": "INT4: packed words + bf16 scales, 0.5625 B a parameter"
             if plan.expert_format == "int4" else "",
             "drafter": "rank 0 only"}
    lines += [_row(k, v, notes.get(k, "")) for k, v in plan.weights.items()]
    lines.append(_row("weights", sum(plan.weights.values())))
    lines.append(_row("CUDA context, libraries, allocator slack", plan.reserve, "assumed (memory.GPU_RESERVE)"))
    lines.append(_row(f"workspace: a {PREFILL_CHUNK}-token prefill chunk", plan.workspace,
                      "estimate: its activations + the attention's split partials"))
    lines.append(_row(f"CUDA graphs: {plan.batch} x {plan.rows} verify rows", plan.graphs,
                      "estimate: the widest captured step's activations (one pool)"))
    lines.append(_row("fixed (all but the KV cache)", plan.fixed))
    kv_1k = plan.kv_per_token * 1024
    lines.append(f"  KV cache: {plan.kv_per_token:,} B a token over {plan.layers} layers = {kv_1k / 1e6:.1f} MB per 1k "
                 f"tokens (under TP every rank holds the whole latent cache)"
                 + (f"; the drafter's window: {plan.drafter_window / 1e6:.1f} MB a running request"
                    if plan.drafter_window else ""))
    if plan.checkpoint is not None:
        ck = plan.checkpoint
        kinds = ", ".join(f"{k} {_size(v)}" for k, v in sorted(ck.by_kind.items(), key=lambda kv: -kv[1]))
        lines.append(f"  checkpoint (safetensors headers, the whole model as stored): {ck.files} file(s), "
                     f"{_size(ck.total)}: {kinds}")
    lines += [verdict(plan, g, context) for g in gpus]
    return "\n".join(lines)


def verdict(plan: GpuPlan, gpu: Gpu, context: int) -> str:
    """One line: on `gpu`, the KV room and tokens, the longest context, and whether `context` fits."""
    room = gpu.memory - plan.fixed
    if room <= 0:
        return (f"  on {gpu.name} ({gpu.memory / 1e9:.1f} GB): DOES NOT FIT: the fixed part alone needs "
                f"{plan.fixed / 1e9:.1f} GB ({-room / 1e9:.1f} GB over)")
    tokens, longest = plan.kv_tokens(gpu.memory), plan.longest_context(gpu.memory)
    limit = " (the model's max_position_embeddings)" if longest == plan.max_positions else ""
    ok = "FITS" if plan.fits(gpu.memory, context) else "DOES NOT FIT" + (
        f" (beyond the model's {plan.max_positions:,} positions)" if context > plan.max_positions else "")
    return (f"  on {gpu.name} ({gpu.memory / 1e9:.1f} GB): KV room {room / 1e9:.1f} GB = {tokens:,} tokens; "
            f"longest context at batch {plan.batch}: {longest:,}{limit}; a {context:,}-token request: {ok}")
