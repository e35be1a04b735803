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
has run. This package sits below engine/ and speculative/: it imports neither them nor bench/.

Modules: `ceilings.py` (bandwidth and matmul rate), `floor.py` (the parts of a step, the step
floor, the model's sizes walked once), `fit.py` (the prediction fitted online).
"""

from __future__ import annotations

from treeflash.costs.ceilings import (
    H200_BANDWIDTH,
    H200_MATMUL,
    KNOWN_GPUS,
    Ceilings,
    default_ceilings,
    device_name,
    measure_ceilings,
)
from treeflash.costs.fit import ExpertTouch, StepCostModel, StepShape
from treeflash.costs.floor import (
    FLOOR_MODEL,
    TILE_ROWS,
    DrafterCosts,
    LayerPlan,
    ModelCosts,
    MoESizes,
    Part,
    attention_part,
    cache_row_bytes,
    distinct_experts,
    drafter_part,
    expert_sizes,
    expert_stacks,
    floor_slope_ms_per_1k,
    head_part,
    is_moe,
    layer_weight_part,
    step_floor,
)

__all__ = [
    "Ceilings", "DrafterCosts", "ExpertTouch", "FLOOR_MODEL", "H200_BANDWIDTH", "H200_MATMUL", "KNOWN_GPUS",
    "LayerPlan", "MoESizes", "ModelCosts", "Part", "StepCostModel", "StepShape", "TILE_ROWS", "attention_part",
    "cache_row_bytes", "default_ceilings", "device_name", "distinct_experts", "drafter_part", "expert_sizes",
    "expert_stacks", "floor_slope_ms_per_1k", "head_part", "is_moe", "layer_weight_part", "measure_ceilings",
    "step_floor",
]
