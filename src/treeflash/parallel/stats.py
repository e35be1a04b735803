"""MoE load figures for `doctor` and `bench sweep`: tokens per expert and per rank, max/mean.

Routing is replicated on every rank, so rank 0's model alone knows the whole picture:
`moe_load(model)` after a forward describes that forward (one step). Under expert
parallelism a rank's load is the token-expert pairs of the experts it owns; under pure
tensor parallelism every rank computes a slice of every pair, so the ranks are balanced
by construction and only the per-expert figures matter (the weights each step reads).
"""

from __future__ import annotations

from treeflash.models.target import TargetModel


def imbalance(counts: list[int]) -> float:
    """max / mean (1.0 = perfectly balanced; 0 when nothing was routed)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 0.0


def moe_load(model: TargetModel) -> dict:
    """Per MoE layer of the last forward: token-expert pairs per expert and per rank, max/mean."""
    par = model.parallel
    layers = []
    for experts, ranks in zip(model.moe_expert_counts(), model.moe_rank_counts(), strict=True):
        e, group = experts.tolist(), ranks.tolist()
        r = [group[i // par.moe_tp_size] for i in range(par.tp_size)]  # rank i is in EP group i // moe_tp
        layers.append({
            "tokens_per_expert": e,
            "experts_touched": sum(1 for c in e if c),
            "expert_max_over_mean": imbalance(e),
            "tokens_per_rank": r,
            "rank_max_over_mean": imbalance(r),
        })
    worst = max((lay["rank_max_over_mean"] for lay in layers), default=0.0)
    return {"tp": par.tp_size, "ep": par.ep_size, "layers": layers, "worst_rank_max_over_mean": worst}
