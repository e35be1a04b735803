"""The performance model of DESIGN.md: what a step must at least cost on this hardware.

Per target layer and verify step over context L with N rows and H query heads (this GPU's):
attention bytes >= L x D x s (D = kv_lora_rank + qk_rope_head_dim, s = bytes per cache
element), flops = 2 x N x H x L x (D + kv_lora_rank). A step also reads every weight it
touches once: attention projections, the dense MLP or the shared experts plus each routed
expert that some row of the tree picked, the LM head; the drafter reads its layers, its
context K/V (sliding layers: W-1 rows) and the LM head again. Each part's floor is
max(bytes / bandwidth, flops / matmul rate); the step floor is their sum. Sizes come from
the model's own parameters, so a sharded (TP) model is costed per GPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

H200_BANDWIDTH = 4.24e12  # bytes/s, measured copy on one H200 (DESIGN.md)
H200_MATMUL = 779e12  # flop/s, measured bf16 matmul on one H200


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s
    matmul: float  # flop/s
    source: str

    def floor_s(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.bandwidth, flops / self.matmul)

    def to_dict(self) -> dict:
        return asdict(self)


def measure_ceilings(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> Ceilings:
    """A quick copy and matmul probe (where no measured figure is on record: the CPU, a GPU that
    is not in KNOWN_GPUS)."""
    n = 1 << 24 if device.type == "cpu" else 1 << 28
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _best(lambda: dst.copy_(src), device, seconds)
    m = 512 if device.type == "cpu" else 8192
    a = torch.randn(m, m, dtype=dtype, device=device)
    mm_s = _best(lambda: a @ a, device, seconds)
    return Ceilings(2 * n / copy_s, 2 * m**3 / mm_s, f"measured on {device_name(device)} (copy, {m}^3 matmul)")


# GPUs whose ceilings were measured with care (a name substring of torch.cuda.get_device_name)
KNOWN_GPUS = {"H200": Ceilings(H200_BANDWIDTH, H200_MATMUL, "H200 measured ceilings (DESIGN.md)")}
_probed: dict[tuple[str, torch.dtype], Ceilings] = {}


def default_ceilings(device: torch.device, dtype: torch.dtype, bandwidth: float | None = None,
                     matmul: float | None = None) -> Ceilings:
    """The H200's figures on an H200 (DESIGN.md); on any other device a quick probe, once a
    process (an H100's floor against an H200's ceilings would overstate every fraction by the
    gap between the two GPUs); flags override either."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    name = device_name(device)
    base = next((c for key, c in KNOWN_GPUS.items() if device.type == "cuda" and key in name), None)
    if base is None:
        key = (str(device), dtype)
        if key not in _probed:
            _probed[key] = measure_ceilings(device, dtype)
        base = _probed[key]
    if bandwidth is None and matmul is None:
        return base
    return Ceilings(bandwidth or base.bandwidth, matmul or base.matmul, base.source + ", overridden")


def _best(fn, device: torch.device, seconds: float) -> float:
    fn()
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine() or "cpu"


# ---- the parts of a step --------------------------------------------------------------
@dataclass
class Part:
    bytes: float = 0.0
    flops: float = 0.0

    def __add__(self, other: Part) -> Part:
        return Part(self.bytes + other.bytes, self.flops + other.flops)

    def scaled(self, k: float) -> Part:
        return Part(self.bytes * k, self.flops * k)


def _nbytes(module_or_tensors) -> float:
    ts = module_or_tensors.parameters() if hasattr(module_or_tensors, "parameters") else module_or_tensors
    return float(sum(t.numel() * t.element_size() for t in ts))


def _numel(module) -> float:
    return float(sum(p.numel() for p in module.parameters()))


def attention_part(model, context: int, rows: int, kv_row_bytes: int | None = None) -> Part:
    """Verify attention of one layer: the latent prefix once, 2 N H L (D + r) flops.
    kv_row_bytes: a cached token's row in one layer (`kvcache.KVFormat.row_bytes`: 656 for
    fp8_e4m3 rows at D 576); None: D values in the model's dtype."""
    cfg = model.cfg
    heads = getattr(model.model.layers[0].self_attn, "num_heads", cfg.num_attention_heads)
    row = kv_row_bytes or cfg.latent_dim * model.lm_head.weight.element_size()
    return Part(context * row,
                2.0 * rows * heads * context * (cfg.latent_dim + cfg.kv_lora_rank))


def layer_weight_part(layer, rows: int, touched_experts: float | None) -> Part:
    """One decoder layer's weights (projections + MLP, or shared + touched experts)."""
    attn = layer.self_attn
    part = Part(_nbytes(attn), 2.0 * rows * _numel(attn))
    mlp = layer.mlp
    if not hasattr(mlp, "routed_weights"):
        return part + Part(_nbytes(mlp), 2.0 * rows * _numel(mlp))
    expert = [w[0] for w in mlp.routed_weights()]  # tensors or Int4Weight (packed + scales)
    per_expert = float(sum(w.nbytes for w in expert))
    params = float(sum(math.prod(w.shape) for w in expert))
    local = mlp.routed_weights()[0].shape[0]
    k = mlp.gate.cfg.num_experts_per_tok * local / mlp.gate.cfg.n_routed_experts
    touched = local if touched_experts is None else touched_experts
    part = part + Part(_nbytes(mlp.gate), 2.0 * rows * mlp.gate.weight.numel())
    part = part + Part(touched * per_expert, 2.0 * rows * k * params)
    if mlp.shared_experts is not None:
        part = part + Part(_nbytes(mlp.shared_experts), 2.0 * rows * _numel(mlp.shared_experts))
    return part


def head_part(model, rows: int) -> Part:
    w = model.lm_head.weight
    return Part(_nbytes([w]) + rows * w.shape[1] * w.element_size(), 2.0 * rows * w.numel())


def drafter_part(drafter, context: int, accepted: float) -> Part:
    """One propose (block of bs rows over its context) + one extend (accepted + 1 rows)."""
    if drafter is None or not hasattr(drafter, "layers"):
        return Part()
    cfg, bs = drafter.cfg, drafter.block_size
    elem = drafter.fc.weight.element_size()
    part = Part()
    for i, layer in enumerate(drafter.layers):
        w = cfg.window(i)
        ctx = context if w is None else min(context, w - 1)
        kv_bytes = 2.0 * ctx * cfg.num_key_value_heads * cfg.head_dim * elem
        attn_flops = 4.0 * bs * cfg.num_attention_heads * (ctx + bs) * cfg.head_dim
        part = part + Part(_nbytes(layer) + kv_bytes, 2.0 * bs * _numel(layer) + attn_flops)
        kv_proj = [layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]
        part = part + Part(_nbytes(kv_proj), 2.0 * (accepted + 1) * sum(t.numel() for t in kv_proj))
    v, h = drafter.lm_head_weight.shape
    part = part + Part(v * h * elem, 2.0 * (bs - 1) * v * h)
    return part + Part(_nbytes([drafter.fc.weight]), 2.0 * (accepted + 1) * drafter.fc.weight.numel())


@dataclass
class LayerPlan:
    """How many layers of each kind the floor counts (the built model, or the real one)."""

    total: int
    dense: int

    @staticmethod
    def of(model) -> LayerPlan:
        dense = sum(not hasattr(layer.mlp, "routed_weights") for layer in model.model.layers)
        return LayerPlan(len(model.model.layers), dense)


def step_floor(model, drafter, ceilings: Ceilings, context: int, rows: int, accepted: float,
               touched_experts: float | None, plan: LayerPlan | None = None,
               kv_row_bytes: int | None = None) -> dict:
    """Floors (seconds, bytes, flops) of one decode/verify step, per part and in total.

    rows: target rows verified (tree nodes + root, or 1); touched_experts: mean distinct
    routed experts per MoE layer in one step (None: all). `plan` scales per-layer parts to
    a layer count other than the built model's (a preset's real depth); kv_row_bytes: the
    cache's row in one layer (`attention_part`).
    """
    built = LayerPlan.of(model)
    plan = plan or built
    layers = list(model.model.layers)
    dense = [layer for layer in layers if not hasattr(layer.mlp, "routed_weights")]
    moe = [layer for layer in layers if hasattr(layer.mlp, "routed_weights")]
    weights = Part()
    if dense:
        mean = sum((layer_weight_part(x, rows, None) for x in dense), Part()).scaled(1 / len(dense))
        weights = weights + mean.scaled(plan.dense)
    if moe:
        mean = sum((layer_weight_part(x, rows, touched_experts) for x in moe), Part()).scaled(1 / len(moe))
        weights = weights + mean.scaled(plan.total - plan.dense)
    parts = {
        "attention": attention_part(model, context, rows, kv_row_bytes).scaled(plan.total),
        "target_weights": weights + head_part(model, rows),
        "drafter": drafter_part(drafter, context, accepted) if rows > 1 else Part(),
    }
    out = {k: {"bytes": p.bytes, "flops": p.flops, "s": ceilings.floor_s(p.bytes, p.flops)}
           for k, p in parts.items()}
    out["step_s"] = sum(v["s"] for v in out.values())
    return out


def floor_slope_ms_per_1k(model, drafter, ceilings, context, rows, accepted, touched, plan=None,
                          kv_row_bytes: int | None = None) -> float:
    """d(step floor)/d(context) in ms per +1024 tokens of context."""
    a = step_floor(model, drafter, ceilings, context, rows, accepted, touched, plan, kv_row_bytes)["step_s"]
    b = step_floor(model, drafter, ceilings, context + 1024, rows, accepted, touched, plan, kv_row_bytes)["step_s"]
    return (b - a) * 1e3


FLOOR_MODEL = (
    "per step: attention = layers x max(L*D*s / BW, 2*N*H*L*(D+r) / PEAK); target weights = "
    "max(bytes of projections + dense MLPs + shared + touched routed experts + LM head / BW, "
    "2 * rows * active params / PEAK); drafter = its layer weights + context K/V (sliding: W-1 rows) "
    "+ LM head; floor = sum of the parts (D = latent 576 on K2/V3, s = bytes per element; an fp8_e4m3 "
    "cache: D*s = its 656-byte row)"
)
