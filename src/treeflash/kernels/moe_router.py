"""MoE router after the logits GEMM in one launch: scores, bias, group limiting, top-k, weights.

The torch path (`reference.moe_gate`, the model's original routing) costs ~12-15 small
kernels per layer (sigmoid, add, topk, sum, topk, zeros, scatter, repeat_interleave,
masked_fill, topk, gather, sum, div, mul); under CUDA graphs each still costs ~2-3 us of
GPU time, in every MoE layer of every step. Here one program routes one token row, with the
row's E scores held in registers as a [BLOCK_G, BLOCK_S] tile (group g, expert s in it):

    scores = sigmoid(logits) | softmax(logits)                 (over E)
    choice = scores + bias                                     (noaux_tc only)
    group  = sum of top-2 choice in the group (noaux_tc) | max (group_limited_greedy);
             groups outside the topk_group best are -inf      (n_group > 1, not greedy)
    ids    = top-k of choice (iterative argmax, lowest index on ties)
    w      = scores[ids] (/ (sum + 1e-20) if norm_topk_prob) * routed_scaling_factor

Measured on an H200 (2026-12-02, torch 2.11, triton 3.6, under a CUDA graph, logits GEMM
excluded; an ad-hoc run whose output was not kept: `benchmarks/check_fused.py` re-measures
it): DeepSeek-V3 routing (E=256, 8 groups) 38.6 -> 5.2 us at 1 row, 54.3 -> 5.6 us at
256 rows; Kimi-K2 (E=384, 1 group) 16.8 -> 4.2 us / 24.3 -> 4.6 us; same ids, weights within
6e-8 of the torch twin at 1-1000 rows.

The file is not named moe_gate.py: importing a submodule of that name would replace the
public function `treeflash.kernels.moe_gate` with the module.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MAX_EXPERTS = 512  # one row's scores live in registers
MAX_TOPK = 16


@triton.jit
def _moe_gate_kernel(LOGITS, BIAS, W_OUT, IDS_OUT, E, S, s_lt, scale,
                     SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, LIMIT: tl.constexpr,
                     TOP2_SUM: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                     TOPK: tl.constexpr, NORM: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    s = tl.arange(0, BLOCK_S)
    idx = g[:, None] * S + s[None, :]  # [BLOCK_G, BLOCK_S] expert id
    ok = (g[:, None] < N_GROUP) & (s[None, :] < S) & (idx < E)
    x = tl.load(LOGITS + row * s_lt + idx, mask=ok, other=float("-inf"))
    if SOFTMAX:
        p = tl.exp(x - tl.max(tl.max(x, 1), 0))
        scores = p / tl.sum(tl.sum(p, 1), 0)
    else:
        scores = tl.sigmoid(x)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(BIAS + idx, mask=ok, other=0.0)
    choice = tl.where(ok, choice, float("-inf"))
    if LIMIT:
        best = tl.max(choice, 1)  # [BLOCK_G]
        if TOP2_SUM:  # drop one copy of the best (a tie keeps the other), add the runner-up
            first = tl.argmax(choice, 1, tie_break_left=True)
            rest = tl.where(s[None, :] == first[:, None], float("-inf"), choice)
            best = best + tl.max(rest, 1)
        best = tl.where(g < N_GROUP, best, float("-inf"))
        keep = g < 0  # [BLOCK_G] all False
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(best, 0, tie_break_left=True)
            keep = keep | (g == pick)
            best = tl.where(g == pick, float("-inf"), best)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    big = BLOCK_G * BLOCK_S
    free = ok  # not taken yet (a masked-out group's -inf experts stay free, last in rank)
    for j in tl.static_range(TOPK):
        m = tl.max(tl.max(tl.where(free, choice, float("-inf")), 1), 0)
        pick = tl.min(tl.min(tl.where(free & (choice == m), idx, big), 1), 0)
        hit = idx == pick
        w = tl.where(kk == j, tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0), w)
        ids = tl.where(kk == j, pick.to(tl.int64), ids)
        free = free & (idx != pick)
    if NORM:
        w = w / (tl.sum(w, 0) + 1e-20)
    w = w * scale
    out_ok = kk < TOPK
    tl.store(W_OUT + row * TOPK + kk, w, mask=out_ok)
    tl.store(IDS_OUT + row * TOPK + kk, ids, mask=out_ok)


def moe_gate_triton(logits: torch.Tensor, bias: torch.Tensor | None, scoring_func: str, topk_method: str,
                    n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool,
                    routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 (row stride free, unit column stride); bias [E] (used for
    noaux_tc). Returns weights [T, top_k] float32 and ids [T, top_k] int64, both contiguous.
    Ids come in pick order (best first), unlike the torch twin's unsorted topk."""
    t, e = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, (logits.dtype, logits.stride())
    assert e <= MAX_EXPERTS and 1 <= top_k <= min(MAX_TOPK, e), (e, top_k)
    assert scoring_func in ("sigmoid", "softmax"), scoring_func
    has_bias = topk_method == "noaux_tc"
    if has_bias:
        assert bias is not None and bias.shape == (e,), None if bias is None else bias.shape
        bias = bias.to(device=logits.device, dtype=torch.float32).contiguous()
    limit = topk_method != "greedy" and n_group > 1
    groups = n_group if limit else 1
    assert e % groups == 0 and topk_group <= groups, (e, groups, topk_group)
    per_group = e // groups
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    _moe_gate_kernel[(t,)](
        logits, bias if has_bias else logits, weights, ids, e, per_group, logits.stride(0),
        float(routed_scaling_factor),
        SOFTMAX=scoring_func == "softmax", HAS_BIAS=has_bias, LIMIT=limit,
        TOP2_SUM=topk_method == "noaux_tc", N_GROUP=groups, TOPK_GROUP=topk_group, TOPK=top_k,
        NORM=bool(norm_topk_prob), BLOCK_G=triton.next_power_of_2(groups),
        BLOCK_S=triton.next_power_of_2(per_group), BLOCK_K=max(2, triton.next_power_of_2(top_k)),
    )
    return weights, ids
