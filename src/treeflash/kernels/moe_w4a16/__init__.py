"""The W4A16 grouped MoE: INT4 routed experts in compressed-tensors' pack-quantized layout
(`kernels/int4.py`, Kimi K2.5 / K2.6 as published) against 16-bit activations, weights never
dequantized in memory. `kernels.moe_experts` sends `Int4Weight` stacks here.

    gate_up: H[r, :] = silu(x[t] @ Wg[e]^T) * (x[t] @ Wu[e]^T)
    down:    Y[a, :] = weight[a] * (H[r] @ Wd[e]^T)                 (a = t * top_k + j)
    out[t]  = sum_j Y[t * top_k + j] + the shared experts           (fixed order: deterministic)

Implementations (`dispatch.py` picks one by rows): `mma.py`, Gluon on tensor cores with each
thread's MMA operand unpacked in its registers from the checkpoint's words (two or three
launches); `portable.py`, Triton `tl` (any dtype, four launches); `humming.py`, humming-kernels
on a copy of the experts in its layout (optional; the layer's copy, made at load time). Timed by
`treeflash bench moe` (`bench/moe.py`); `benchmarks/notes/moe-w4a16.md` has the design, the SASS counts, the
prediction and the measurements.
"""

from __future__ import annotations

from treeflash.kernels.moe_w4a16 import dispatch, mma
from treeflash.kernels.moe_w4a16.portable import (  # noqa: F401 - the portable kernel's public names
    INTERPRETER_TILES,
    LARGE_TILES,
    SMALL_TILES,
    UNPACK_PTX,
    Tiles,
    _check_args,
    call_plan,
    default_tiles,
    moe_experts_portable,
    plan_split,
)


def moe_experts_w4a16(x, topk_weights, topk_ids, w_gate, w_up, w_down, expert_offset=0, num_experts=None,
                      split_k=None, shared=None, stats=None, tiles=None, impl=None, mma_tiles=None, humming=None):
    """Triton twin of `treeflash.kernels.reference.moe_experts` for INT4 expert stacks.

    x [T, hidden] (fp32 / bf16 / fp16, last dim contiguous); topk_weights [T, K] float; topk_ids
    [T, K] int (global expert ids, distinct within a row as a router's top-k); w_gate, w_up
    `Int4Weight` of logical shape [E, inter, hidden] (packed [E, inter, hidden / 8] int32, scale
    [E, inter, hidden / G]; gate and up with the same strides and group size), w_down `Int4Weight`
    [E, hidden, inter]: this rank's experts expert_offset .. +E; num_experts = the router's width
    (None: E). Returns out [T, hidden] in x.dtype. shared: the shared experts' (gate [Si, hidden],
    up, down [hidden, Si]) in x.dtype, added to every token as Si / inter experts of weight 1 in
    the same launches. stats: as `moe_gemm.moe_experts_triton`.
    impl: "mma" / "portable" / "humming" (None: `dispatch.impl`; "mma" falls back to "portable"
    where `mma.supported` refuses the call). mma_tiles / split_k: the MMA kernel's `MmaTiles` and
    gate_up split count (None: `dispatch` / `mma.plan`); tiles / split_k: the portable kernel's.
    humming: the layer's `humming.HummingExperts` copy of these experts, or None.
    """
    s_ch = _check_args(x, topk_weights, topk_ids, w_gate, w_up, w_down, shared)
    t = x.shape[0]
    refused = humming.refuses(x, expert_offset, num_experts) if humming is not None else "no humming copy"
    chosen = impl or dispatch.impl(t, refused is None)
    if chosen not in dispatch.IMPLS:
        raise ValueError(f"W4A16 MoE implementation {chosen!r}: expected one of {dispatch.IMPLS}")
    if chosen == dispatch.HUMMING:
        if refused is not None:
            raise ValueError(f"W4A16 MoE implementation 'humming' cannot take this call: {refused}")
        return humming(x, topk_weights, topk_ids, shared, stats)
    if chosen == dispatch.MMA and mma.supported(x, w_gate, w_down, shared) is None:
        e, inter, hid = w_gate.shape
        plan = mma.plan(t, topk_ids.shape[1], e, inter, hid, s_ch, x.device, mma_tiles, split_k)
        return mma.moe_experts_mma(x, topk_weights, topk_ids, w_gate, w_up, w_down, expert_offset, num_experts,
                                   shared, stats, s_ch, plan)
    return moe_experts_portable(x, topk_weights, topk_ids, w_gate, w_up, w_down, expert_offset, num_experts,
                                split_k=split_k if chosen == dispatch.PORTABLE else None, shared=shared, stats=stats,
                                tiles=tiles)
