"""The floors `bench sweep`, `bench kernel` and the benchmark scripts report against.

The model itself (ceilings, the parts of a step, the step floor) lives in `treeflash.costs`,
which the serving path uses too (the tree sizing prices each budget with it); the names are
re-exported here for the benchmarks.
"""

from __future__ import annotations

from treeflash.costs import (  # noqa: F401 - re-exported
    FLOOR_MODEL,
    H200_BANDWIDTH,
    H200_MATMUL,
    KNOWN_GPUS,
    Ceilings,
    LayerPlan,
    Part,
    attention_part,
    default_ceilings,
    device_name,
    drafter_part,
    floor_slope_ms_per_1k,
    head_part,
    layer_weight_part,
    measure_ceilings,
    step_floor,
)
