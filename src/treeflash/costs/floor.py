"""The floor of a step: its parts (attention at a context, the weights the rows touch, the LM
head, the drafter) sized from the model's own tensors, each at max(bytes / bandwidth, flops /
matmul rate); the formula is the package's docstring (costs/__init__.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from treeflash.costs.ceilings import Ceilings

TILE_ROWS = 64  # the verify kernel's tile: heads x rows of a request, in steps of 64


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
    return float(sum(t.nbytes for t in ts))


def _numel(module) -> float:
    return float(sum(p.numel() for p in module.parameters()))


def is_moe(mlp) -> bool:
    return hasattr(mlp, "routed_weights") or hasattr(mlp, "experts_gate")


def expert_stacks(mlp) -> tuple:
    """The routed experts' weight stacks ([E_local, ...] each: gate, up, down) in whatever format
    they are stored: tensors, or objects with `nbytes` and a logical `shape` (an INT4 stack).
    `routed_weights()` where the MoE module offers it, else its three stacked parameters."""
    accessor = getattr(mlp, "routed_weights", None)
    if accessor is not None:
        return tuple(accessor())
    return mlp.experts_gate, mlp.experts_up, mlp.experts_down


def expert_sizes(mlp) -> tuple[int, float, float]:
    """(local experts, bytes an expert, parameters an expert) from the stacks as stored."""
    stacks = expert_stacks(mlp)
    local = stacks[0].shape[0]
    nbytes = sum(float(s.nbytes) for s in stacks)
    params = sum(float(math.prod(s.shape)) for s in stacks)
    return local, nbytes / local, params / local


def distinct_experts(rows: float, k: int, experts: int) -> float:
    """Expected distinct experts that `rows` rows, each routed to k of E uniformly, touch."""
    if rows <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - k / experts) ** rows)


def cache_row_bytes(model, kv_row_bytes: int | None = None) -> int:
    """A cached token's bytes in one layer: kv_row_bytes (`kvcache.KVFormat.row_bytes`, 656 for
    fp8_e4m3 rows at D 576) or, None, D values in the model's dtype."""
    return kv_row_bytes or model.cfg.latent_dim * model.lm_head.weight.element_size()


def attention_part(model, context: int, rows: float, kv_row_bytes: int | None = None) -> Part:
    """Verify attention of one layer: the latent prefix once (rows of `cache_row_bytes`),
    2 N H L (D + r) flops. Under decode context parallelism (dcp N) a rank's: its 1/N share of the
    prefix, with the group's N x H heads."""
    cfg = model.cfg
    heads = getattr(model.model.layers[0].self_attn, "num_heads", cfg.num_attention_heads)
    dcp = getattr(getattr(model, "parallel", None), "dcp_size", 1)
    share = -(-context // dcp)
    return Part(share * cache_row_bytes(model, kv_row_bytes),
                2.0 * rows * heads * dcp * share * (cfg.latent_dim + cfg.kv_lora_rank))


def layer_weight_part(layer, rows: int, touched_experts: float | None) -> Part:
    """One decoder layer's weights (projections + MLP, or shared + touched experts)."""
    attn = layer.self_attn
    part = Part(_nbytes(attn), 2.0 * rows * _numel(attn))
    mlp = layer.mlp
    if not is_moe(mlp):
        return part + Part(_nbytes(mlp), 2.0 * rows * _numel(mlp))
    local, per_expert_bytes, per_expert_params = expert_sizes(mlp)
    cfg = mlp.gate.cfg
    k = cfg.num_experts_per_tok * local / cfg.n_routed_experts
    touched = local if touched_experts is None else touched_experts
    part = part + Part(_nbytes(mlp.gate), 2.0 * rows * mlp.gate.weight.numel())
    part = part + Part(touched * per_expert_bytes, 2.0 * rows * k * per_expert_params)
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
    return DrafterCosts.of(drafter).part(context, accepted)


@dataclass(frozen=True)
class DrafterCosts:
    """The drafter's sizes, walked once: `part(context, accepted)` is then closed-form."""

    block: int
    elem: int
    kv_row_bytes: float  # K and V of one context row in one layer
    attn_flops_per_ctx: float  # 4 bs H_q head_dim, per visible key of one layer
    windows: tuple[int | None, ...]
    layer_bytes: float  # all layers
    layer_params: float
    kv_proj_bytes: float
    kv_proj_params: float
    head_bytes: float
    head_params: float
    fc_bytes: float
    fc_params: float

    @staticmethod
    def of(drafter) -> DrafterCosts:
        cfg, bs = drafter.cfg, drafter.block_size
        elem = drafter.fc.weight.element_size()
        kv = [w for layer in drafter.layers for w in (layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight)]
        v, h = drafter.lm_head_weight.shape
        return DrafterCosts(
            bs, elem, 2.0 * cfg.num_key_value_heads * cfg.head_dim * elem,
            4.0 * bs * cfg.num_attention_heads * cfg.head_dim,
            tuple(cfg.window(i) for i in range(len(drafter.layers))),
            sum(_nbytes(layer) for layer in drafter.layers), sum(_numel(layer) for layer in drafter.layers),
            _nbytes(kv), float(sum(t.numel() for t in kv)), float(v * h * elem), float(v * h),
            _nbytes([drafter.fc.weight]), float(drafter.fc.weight.numel()))

    def part(self, context: int, accepted: float) -> Part:
        bs, part = self.block, Part()
        for w in self.windows:
            ctx = context if w is None else min(context, w - 1)
            part = part + Part(ctx * self.kv_row_bytes, self.attn_flops_per_ctx * (ctx + bs))
        part = part + Part(self.layer_bytes, 2.0 * bs * self.layer_params)
        part = part + Part(self.kv_proj_bytes, 2.0 * (accepted + 1) * self.kv_proj_params)
        part = part + Part(self.head_bytes, 2.0 * (bs - 1) * self.head_params)
        return part + Part(self.fc_bytes, 2.0 * (accepted + 1) * self.fc_params)


@dataclass
class LayerPlan:
    """How many layers of each kind the floor counts (the built model, or the real one)."""

    total: int
    dense: int

    @staticmethod
    def of(model) -> LayerPlan:
        dense = sum(not is_moe(layer.mlp) for layer in model.model.layers)
        return LayerPlan(len(model.model.layers), dense)


def step_floor(model, drafter, ceilings: Ceilings, context: int, rows: int, accepted: float,
               touched_experts: float | None, plan: LayerPlan | None = None,
               kv_row_bytes: int | None = None) -> dict:
    """Floors (seconds, bytes, flops) of one decode/verify step, per part and in total.

    rows: target rows verified (tree nodes + root, or 1); touched_experts: mean distinct
    routed experts per MoE layer in one step (None: all). `plan` scales per-layer parts to
    a layer count other than the built model's (a preset's real depth); kv_row_bytes: the
    cache's row in one layer (`cache_row_bytes`).
    """
    plan = plan or LayerPlan.of(model)
    layers = list(model.model.layers)
    dense = [layer for layer in layers if not is_moe(layer.mlp)]
    moe = [layer for layer in layers if is_moe(layer.mlp)]
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


# ---- the model's sizes, walked once ---------------------------------------------------------
@dataclass(frozen=True)
class MoESizes:
    """A MoE layer's sizes: what any rows read (projections, router, shared experts) and one
    routed expert's share."""

    fixed_bytes: float
    fixed_params: float  # per row: projections + router + shared
    expert_bytes: float
    expert_params: float
    local: int  # experts held here
    k_local: float  # experts a row picks among the local ones (k x local / E)
    k: int
    experts: int


@dataclass(frozen=True)
class ModelCosts:
    """Every size a step's floor needs, from the built model's tensors (once): `parts(...)` is
    closed-form, cheap enough to price every candidate budget every step."""

    heads: int
    latent: int
    kv_lora_rank: int
    cache_row_bytes: int  # a cached token in one layer (`cache_row_bytes`)
    dense: tuple[int, float, float]  # dense layers: (count, bytes, params) of them all
    moe: tuple[tuple[MoESizes, int], ...]  # MoE layers grouped by size: (sizes, count)
    head_bytes: float
    head_row_bytes: float
    head_params: float
    drafter: DrafterCosts | None

    @staticmethod
    def of(model, drafter=None, kv_row_bytes: int | None = None) -> ModelCosts:
        cfg = model.cfg
        dense, moe = [0, 0.0, 0.0], {}
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            a_bytes, a_params = _nbytes(attn), _numel(attn)
            if not is_moe(mlp):
                dense = [dense[0] + 1, dense[1] + a_bytes + _nbytes(mlp), dense[2] + a_params + _numel(mlp)]
                continue
            local, e_bytes, e_params = expert_sizes(mlp)
            shared = mlp.shared_experts
            fixed_b = a_bytes + _nbytes(mlp.gate) + (_nbytes(shared) if shared is not None else 0.0)
            fixed_p = a_params + mlp.gate.weight.numel() + (_numel(shared) if shared is not None else 0.0)
            g = mlp.gate.cfg
            sizes = MoESizes(fixed_b, fixed_p, e_bytes, e_params, local,
                             g.num_experts_per_tok * local / g.n_routed_experts, g.num_experts_per_tok,
                             g.n_routed_experts)
            moe[sizes] = moe.get(sizes, 0) + 1
        w = model.lm_head.weight
        heads = getattr(model.model.layers[0].self_attn, "num_heads", cfg.num_attention_heads)
        real = drafter if drafter is not None and hasattr(drafter, "layers") else None
        return ModelCosts(heads, cfg.latent_dim, cfg.kv_lora_rank, cache_row_bytes(model, kv_row_bytes), tuple(dense),
                          tuple(moe.items()),
                          _nbytes([w]), float(w.shape[1] * w.element_size()), float(w.numel()),
                          DrafterCosts.of(real) if real is not None else None)

    @property
    def layers(self) -> int:
        return self.dense[0] + sum(count for _, count in self.moe)

    @property
    def moe_sizes(self) -> tuple[MoESizes, ...]:
        """One entry a MoE layer."""
        return tuple(m for m, count in self.moe for _ in range(count))

    def tile_rows(self, rows_per_request: int) -> float:
        """Rows a request's attention computes: heads x rows rounded up to whole 64-row tiles."""
        per = self.heads * rows_per_request
        return -(-per // TILE_ROWS) * TILE_ROWS / self.heads

    def parts(self, rows_per_request: int, contexts: Sequence[int], touched=None, tiles: bool = False,
              accepted: float = 0.0) -> dict[str, Part]:
        """The floor's parts of one step of len(contexts) requests, each verifying
        rows_per_request rows (1: plain decode, no drafter). touched(rows, moe_sizes) -> mean
        distinct local experts (None: uniform routing); tiles: attention flops in whole tiles."""
        return self.parts_of(rows_per_request, len(contexts), sum(contexts), touched, tiles, accepted)

    def parts_of(self, rows_per_request: int, n: int, ctx_sum: float, touched=None, tiles: bool = False,
                 accepted: float = 0.0) -> dict[str, Part]:
        """parts() of n requests whose contexts sum to ctx_sum (all a step's floor depends on)."""
        ctx_sum = float(ctx_sum)
        rows = n * rows_per_request
        r_attn = self.tile_rows(rows_per_request) if tiles else rows_per_request
        attn = Part(ctx_sum * self.cache_row_bytes,
                    2.0 * r_attn * self.heads * ctx_sum * (self.latent + self.kv_lora_rank)).scaled(self.layers)
        weights = Part(self.head_bytes + rows * self.head_row_bytes, 2.0 * rows * self.head_params)
        weights = weights + Part(self.dense[1], 2.0 * rows * self.dense[2])
        for m, count in self.moe:
            if touched is not None:
                hit = touched(rows, m)
            else:
                hit = m.local * distinct_experts(rows, m.k, m.experts) / m.experts
            weights = weights + Part(m.fixed_bytes + hit * m.expert_bytes,
                                     2.0 * rows * (m.fixed_params + m.k_local * m.expert_params)).scaled(count)
        parts = {"attention": attn, "target_weights": weights}
        if rows_per_request > 1 and self.drafter is not None and n:
            parts["drafter"] = self.drafter.part(int(ctx_sum // n), accepted).scaled(n)
        return parts

    def floor_s(self, ceilings: Ceilings, rows_per_request: int, contexts: Sequence[int], touched=None,
                tiles: bool = False) -> float:
        return self.floor_of(ceilings, rows_per_request, len(contexts), sum(contexts), touched, tiles)

    def floor_of(self, ceilings: Ceilings, rows_per_request: int, n: int, ctx_sum: float, touched=None,
                 tiles: bool = False) -> float:
        return sum(ceilings.floor_s(p.bytes, p.flops)
                   for p in self.parts_of(rows_per_request, n, ctx_sum, touched, tiles).values())
