"""The step-cost model: what a decode or verify step costs on this hardware, and what it must
at least cost. One model for the tree sizing (speculative/budget.py), the sweep's floors and doctor.

The floor (DESIGN.md, "Performance model"), per target layer and verify step over context L
with N rows and H query heads (this GPU's): attention bytes >= L x D x s (D = kv_lora_rank +
qk_rope_head_dim, s = bytes per cache element; an fp8_e4m3 cache reads its 656-byte row,
`kvcache.format`), flops = 2 x N x H x L x (D + kv_lora_rank). A
step also reads every weight it touches once: attention projections, the dense MLP or the
shared experts plus each routed expert some row picked (T rows touch E (1 - (1 - k/E)^T) of E
top-k experts when routing is uniform), the LM head; the drafter reads its layers, its context
K/V (sliding layers: W-1 rows) and the LM head again. Each part's floor is max(bytes /
bandwidth, flops / matmul rate); the step floor is their sum. Sizes come from the model's own
tensors (an INT4 expert stack counts its packed bytes and scales, 0.5625 B a parameter at group
32), so a sharded (TP) model is costed per GPU.

The prediction (`StepCostModel`) starts from the same parts, with the verify kernel's 64-row
tiles (heads x rows per request rounded up to whole tiles) and the distinct experts measured
from the router's counts where known, and fits seconds = F_kind + rho x parts to the step
times the engine measures (F: the fixed per-step cost of a plain or a speculative step:
launches, the drafter's fixed share, the host), times a per-budget residual once that budget
has run. This module sits below engine/ and speculative/: it imports neither them nor bench/.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

H200_BANDWIDTH = 4.24e12  # bytes/s, measured copy on one H200 (DESIGN.md)
H200_MATMUL = 779e12  # flop/s, measured bf16 matmul on one H200
TILE_ROWS = 64  # the verify kernel's tile: heads x rows of a request, in steps of 64


# ---- ceilings ---------------------------------------------------------------------------------
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


# ---- distinct experts, measured -------------------------------------------------------------
@dataclass
class ExpertTouch:
    """Distinct routed experts per MoE layer that T rows touch, from the router's counts.

    Real routing is not uniform (a batch's rows share experts), so E (1 - (1 - k/E)^T) is an
    upper estimate; each measurement keeps a decayed ratio measured / uniform for its T, and a
    T never measured borrows the ratio of the nearest measured T (log scale), 1.0 before any."""

    decay: float = 0.9
    ratios: dict[int, list[float]] = field(default_factory=dict)  # rows -> [weighted sum, weight]

    def observe(self, rows: int, touched_per_layer: Sequence[float], sizes: Sequence[MoESizes]) -> None:
        """touched_per_layer: distinct experts (of all E, the router's counts) per MoE layer."""
        if rows < 1 or not touched_per_layer or len(touched_per_layer) != len(sizes):
            return
        expected = sum(distinct_experts(rows, m.k, m.experts) for m in sizes)
        if expected <= 0:
            return
        ratio = min(1.5, sum(touched_per_layer) / expected)
        s = self.ratios.setdefault(rows, [0.0, 0.0])
        s[0] = self.decay * s[0] + ratio
        s[1] = self.decay * s[1] + 1.0

    def ratio(self, rows: float) -> float:
        if not self.ratios:
            return 1.0
        near = min(self.ratios, key=lambda r: (abs(math.log2(r / max(rows, 1e-9))), r))
        s = self.ratios[near]
        return s[0] / s[1]

    def __call__(self, rows: float, m: MoESizes) -> float:
        return self.ratio(rows) * m.local * distinct_experts(rows, m.k, m.experts) / m.experts


# ---- the online fit -------------------------------------------------------------------------
@dataclass
class StepShape:
    """One engine step as the cost model sees it: requests decoded plainly, and requests
    verifying trees of `budget` nodes (budget 0: none)."""

    plain: tuple[int, ...]  # contexts of the plain requests
    spec: tuple[int, ...]  # contexts of the speculative ones
    budget: int

    @property
    def key(self) -> int:
        """The residual's key: the budget, 0 for a plain step."""
        return self.budget if self.spec else 0


class StepCostModel:
    """Seconds of a step = (F_plain [plain rows] + F_spec [a tree] + rho x floor parts) x the
    step's budget residual.

    floor parts: `ModelCosts.parts` with whole tiles and the measured distinct experts; F and
    rho: a least-squares fit of relative errors (as if each step were measured to ~10%) over the
    last `window` measured steps, with priors rho ~ 1 +- 0.5 (so steps whose floor is a sliver
    of their time, launch-bound ones, leave rho at 1 and split into F = measured - floor: they
    cost the same at every budget; bandwidth-bound ones fit rho) and F_plain ~ F_spec (a kind
    never measured costs what the other's fixed part costs: a plain step is the verify forward
    without the drafter, and pricing it at its floor alone would turn every request off); the
    residual: the median measured / fitted of that budget's last 5 steps (1.0 before any).
    A budget's first step is no sample (its eager first runs, compiles outside a capture).
    The sizing prices every candidate every step on the host, between the step's queued work
    and its one read: the fit is redone after every sample while there are few, then every
    REFIT_EVERY samples (a budget's first samples count at once), and predictions are cached by
    (requests, summed context to ~1.5%, budget) per group until then."""

    REFIT_EVERY = 8

    def __init__(self, costs: ModelCosts, ceilings: Ceilings, window: int = 64, rho_sigma: float = 0.5,
                 rel_sigma: float = 0.1):
        self.costs, self.ceilings = costs, ceilings
        self.touch = ExpertTouch()
        self.samples: deque = deque(maxlen=window)  # (has_plain, has_spec, floor_s, seconds)
        self.residuals: dict[int, deque] = {}  # budget (0: plain) -> its last 5 samples
        self.seen: set[int] = set()
        self.rho_weight = (rel_sigma / rho_sigma) ** 2  # the prior's weight in relative-error units
        self._theta: tuple[float, float, float] | None = None
        self._floors: dict[tuple, float] = {}  # floor_parts_s by shape (contexts to ~1.5%)
        self._residual: dict[int, float] = {}  # residual(key) under the current fit
        self._preds: dict[tuple, float] = {}  # predict() by shape, until the next refit
        self._dirty = 0  # samples since the last fit

    def floor_parts_s(self, shape: StepShape) -> float:
        """rho's feature: the floor of the step's groups, tiles and measured experts included."""
        return self._floor(len(shape.plain), sum(shape.plain), len(shape.spec), sum(shape.spec), shape.budget)

    def _floor(self, n_p: int, s_p: float, n_s: int, s_s: float, budget: int) -> float:
        """Cached by (requests, summed context to ~1.5%, budget) per group: the sizing prices
        every candidate every step, and contexts move by a few tokens a step."""
        key = (n_p, _q(s_p), n_s, _q(s_s), budget)
        s = self._floors.get(key)
        if s is None:
            if len(self._floors) > 4096:
                self._floors.clear()
            s = 0.0
            for rows, n, ctx in ((1, n_p, s_p), (budget + 1, n_s, s_s)):
                if n:
                    s += self.costs.floor_of(self.ceilings, rows, n, ctx, self.touch, tiles=True)
            self._floors[key] = s
        return s

    def observe_touch(self, rows: int, touched_per_layer: Sequence[float]) -> None:
        """The router's distinct experts per MoE layer for a forward of `rows` rows (the steps
        already measured keep the floors they were measured against)."""
        self.touch.observe(rows, touched_per_layer, self.costs.moe_sizes)
        self._floors.clear()
        self._preds.clear()

    def observe(self, shape: StepShape, seconds: float) -> None:
        key = shape.key
        if key not in self.seen:
            self.seen.add(key)
            return
        sample = (bool(shape.plain), bool(shape.spec), self.floor_parts_s(shape), seconds)
        self.samples.append(sample)
        own = self.residuals.setdefault(key, deque(maxlen=5))
        own.append(sample)
        self._dirty += 1
        if self._theta is None or self._dirty >= (1 if len(self.samples) < 16 else self.REFIT_EVERY):
            self._theta, self._dirty = None, 0
            self._residual.clear()
            self._preds.clear()
        elif len(own) <= 3:  # a budget's first samples: priced by them at once
            self._residual.pop(key, None)
            self._preds.clear()

    @property
    def theta(self) -> tuple[float, float, float]:
        """(F_plain, F_spec, rho), refitted after new samples."""
        if self._theta is None:
            self._theta = self._fit()
        return self._theta

    def _fit(self) -> tuple[float, float, float]:
        # normal equations of sum_i ((y_i - a_i . theta) / y_i)^2 + prior, theta = (F_p, F_s, rho)
        a = [[0.0] * 3 for _ in range(3)]
        b = [0.0] * 3
        ref = statistics.median(s[3] for s in self.samples) if self.samples else 1.0
        for has_p, has_s, floor, y in self.samples:
            x = (float(has_p), float(has_s), floor)
            w = 1.0 / max(y, 1e-12) ** 2
            for i in range(3):
                b[i] += w * x[i] * y
                for j in range(3):
                    a[i][j] += w * x[i] * x[j]
        lam_f = 1e-4 / ref**2  # F: nearly free, defined (0) before any step
        lam_c = 0.5 / ref**2  # F_plain ~ F_spec: half a step's weight, data of both kinds outweighs it
        a[0][0] += lam_f + lam_c
        a[1][1] += lam_f + lam_c
        a[0][1] -= lam_c
        a[1][0] -= lam_c
        a[2][2] += self.rho_weight
        b[2] += self.rho_weight
        f_p, f_s, rho = _solve3(a, b)
        return max(f_p, 0.0), max(f_s, 0.0), max(rho, 0.05)

    def _fitted(self, has_plain: bool, has_spec: bool, floor: float) -> float:
        f_p, f_s, rho = self.theta
        return f_p * has_plain + f_s * has_spec + rho * floor

    def residual(self, key: int) -> float:
        """Median measured / fitted of the budget's last steps (under the current fit), 1.0 before any."""
        r = self._residual.get(key)
        if r is None:
            samples = self.residuals.get(key)
            r = statistics.median(y / max(self._fitted(p, q, f), 1e-12) for p, q, f, y in samples) if samples else 1.0
            self._residual[key] = r
        return r

    def _linear(self, n_p: int, s_p: float, n_s: int, s_s: float, budget: int) -> float:
        floor = self._floor(n_p, s_p, n_s, s_s, budget)
        return self._fitted(n_p > 0, n_s > 0, floor) * self.residual(budget if n_s else 0)

    def predict(self, shape: StepShape) -> float:
        """Seconds of a step of this shape. A step with a tree is never priced below the same
        requests' plain step, nor below a smaller budget's step, where those were measured (a
        wider tree does not verify faster: what measured otherwise was noise, or a borrowed
        ratio, which on the H200, 2026-12-03, priced 63 under 15's measured time)."""
        return self.predict_of(len(shape.plain), sum(shape.plain), len(shape.spec), sum(shape.spec), shape.budget)

    def predict_of(self, n_p: int, s_p: float, n_s: int, s_s: float, budget: int) -> float:
        """predict() of n_p plain requests whose contexts sum to s_p and n_s with trees of `budget`
        nodes whose contexts sum to s_s."""
        key = (n_p, _q(s_p), n_s, _q(s_s), budget if n_s else 0)
        seconds = self._preds.get(key)
        if seconds is not None:
            return seconds
        seconds = self._linear(n_p, s_p, n_s, s_s, budget)
        if n_s:
            if self.priced(0):
                seconds = max(seconds, self._linear(n_p + n_s, s_p + s_s, 0, 0.0, 0))
            for smaller in self.residuals:
                if 0 < smaller < budget:
                    seconds = max(seconds, self._linear(n_p, s_p, n_s, s_s, smaller))
        if len(self._preds) > 4096:
            self._preds.clear()
        self._preds[key] = seconds
        return seconds

    def priced(self, key: int) -> bool:
        return bool(self.residuals.get(key))


def _q(x: float) -> int:
    return int(round(64 * math.log1p(x)))


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float]:
    """a x = b for a 3x3 system (Gaussian elimination with partial pivoting)."""
    m = [row[:] + [rhs] for row, rhs in zip(a, b, strict=True)]
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-300:
            return 0.0, 0.0, 1.0
        for r in range(3):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    return tuple(m[i][3] / m[i][i] for i in range(3))
