"""Grouped expert GEMMs for MoE: every routed (token, expert) pair in two launches, no host sync.

The token-expert assignments are sorted by expert on the device and cut into blocks of
BLOCK_M rows that never straddle two experts. One program computes one block against one
tile of the expert's weights, so at decode sizes (a 16-64 node tree: most touched experts
get a few rows, one block) each touched expert's weights are read once per step, and an
untouched expert costs nothing. The grid is sized from host-known shapes only
(cdiv(A, BLOCK_M) + min(E, A) blocks, A = T * top_k), idle blocks return at once: the
launch is CUDA-graph capturable and never asks the host how many experts were hit.

    gate_up: H[r, :] = silu(x[t] @ w_gate[e]^T) * (x[t] @ w_up[e]^T)   (row r = sorted pair)
    down:    Y[a, :] = weight[a] * (H[r] @ w_down[e]^T)                 (a = t * top_k + j)
    out[t]  = sum_j Y[t * top_k + j]                                    (fixed order: deterministic)
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BLOCK_M = 16  # rows per block: a tree's typical rows per expert fit one block


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _gate_up_kernel(X, WG, WU, HOUT, ORDER, BLK_E, BLK_R0, BLK_R1, HID, INTER, TOPK,
                    s_xt, s_we, s_wn, s_ht,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(BLK_E + pid_m)
    if e < 0:
        return
    r0 = tl.load(BLK_R0 + pid_m)
    r1 = tl.load(BLK_R1 + pid_m)
    rows = r0 + tl.arange(0, BLOCK_M)
    row_ok = rows < r1
    tok = (tl.load(ORDER + rows, mask=row_ok, other=0) // TOPK).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    w_base = e.to(tl.int64) * s_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HID, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < HID
        x = tl.load(X + tok[:, None] * s_xt + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_off = w_base + cols[None, :].to(tl.int64) * s_wn + ks[:, None]  # [BLOCK_K, BLOCK_N] = W^T tile
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(WG + w_off, mask=w_mask, other=0.0)
        wu = tl.load(WU + w_off, mask=w_mask, other=0.0)
        if DOT_F32:  # the interpreter's half-precision dot is not faithful
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(x, wg, acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(x, wu, acc_u, input_precision=DOT_PREC)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out = HOUT + rows[:, None].to(tl.int64) * s_ht + cols[None, :]
    tl.store(out, h.to(HOUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(HIN, WD, Y, ORDER, WEIGHT, BLK_E, BLK_R0, BLK_R1, HID, INTER,
                 s_ht, s_we, s_wn, s_yt,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(BLK_E + pid_m)
    if e < 0:
        return
    r0 = tl.load(BLK_R0 + pid_m)
    r1 = tl.load(BLK_R1 + pid_m)
    rows = r0 + tl.arange(0, BLOCK_M)
    row_ok = rows < r1
    pair = tl.load(ORDER + rows, mask=row_ok, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < HID
    w_base = e.to(tl.int64) * s_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < INTER
        h = tl.load(HIN + rows[:, None].to(tl.int64) * s_ht + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(WD + w_base + cols[None, :].to(tl.int64) * s_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=DOT_PREC)
    wt = tl.load(WEIGHT + pair, mask=row_ok, other=0.0)
    acc = acc * wt[:, None]
    tl.store(Y + pair[:, None] * s_yt + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def route_blocks(topk_ids: torch.Tensor, num_local: int, expert_offset: int, block_m: int = BLOCK_M):
    """Sort the pairs by local expert and cut them into blocks, on the device (no host sync).

    topk_ids [T, K] global expert ids. Returns order [A] int32 (pair index a = t*K + j,
    sorted by local expert, stable; pairs of experts this rank does not own last),
    block_expert / block_row0 / block_row1 [max_blocks] int32 (local expert or -1 for an
    idle block; its rows [row0, row1) of the sorted order) and counts [num_local] int64.
    """
    a = topk_ids.numel()
    dev = topk_ids.device
    local = topk_ids.reshape(-1) - expert_offset
    key = torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, num_local))
    order = torch.sort(key, stable=True).indices.to(torch.int32)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_local]
    seg_start = torch.cumsum(counts, 0) - counts
    nblk = (counts + block_m - 1) // block_m
    blk_cum = torch.cumsum(nblk, 0)
    max_blocks = triton.cdiv(a, block_m) + min(num_local, a)
    pid = torch.arange(max_blocks, device=dev)
    e = torch.searchsorted(blk_cum, pid, right=True)
    ec = e.clamp(max=num_local - 1)
    row0 = seg_start[ec] + (pid - (blk_cum[ec] - nblk[ec])) * block_m
    row1 = seg_start[ec] + counts[ec]
    idle = e >= num_local
    block_expert = torch.where(idle, -1, e).to(torch.int32)
    return order, block_expert, row0.to(torch.int32), row1.to(torch.int32), counts


def moe_experts_triton(x, topk_weights, topk_ids, w_gate, w_up, w_down, expert_offset=0,
                       num_experts=None):
    """Triton twin of `treeflash.kernels.reference.moe_experts` (same contract).

    x [T, hidden] (fp32/bf16/fp16, last dim contiguous); topk_weights [T, K] float;
    topk_ids [T, K] int (global expert ids); w_gate, w_up [E, inter, hidden] and w_down
    [E, hidden, inter] (this rank's experts expert_offset .. +E, last dim contiguous,
    dtype of x); num_experts = the router's width (None: E, every expert is local).
    Returns out [T, hidden] (x.dtype). Scratch: H [A, inter] (x.dtype, sorted order) and
    Y [A, hidden] fp32 (pair order), A = T * K. Weight tiles are loaded transposed
    ([BLOCK_K, BLOCK_N] of W[e] [N, K]), so no weight copy is ever made.
    Grid (cdiv(A, 16) + min(E, A), cdiv(inter or hidden, BLOCK_N)) per launch.
    """
    t, hid = x.shape
    e, inter, hid_w = w_gate.shape
    assert hid_w == hid and w_up.shape == w_gate.shape and w_down.shape == (e, hid, inter)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == t
    for w in (x, w_gate, w_up, w_down):
        assert w.stride(-1) == 1 and w.dtype == x.dtype, (w.dtype, w.stride())
    assert w_gate.stride() == w_up.stride()
    k = topk_ids.shape[1]
    a = t * k
    out_dtype = x.dtype
    if a == 0:
        return torch.zeros_like(x)
    order, blk_e, blk_r0, blk_r1, _ = route_blocks(topk_ids, e, expert_offset)
    weight = topk_weights.reshape(-1).float().contiguous()
    h = torch.empty(a, inter, device=x.device, dtype=x.dtype)
    # Pairs of experts this rank does not own are never written: zero them (EP only).
    owned_all = expert_offset == 0 and (num_experts is None or num_experts == e)
    y = (torch.empty if owned_all else torch.zeros)(a, hid, device=x.device, dtype=torch.float32)
    interp = _interpreting()
    prec = "ieee" if x.dtype == torch.float32 or interp else "tf32"
    bk = 32 if interp else 64
    bn = 32 if interp else 64
    grid_m = blk_e.shape[0]
    _gate_up_kernel[(grid_m, triton.cdiv(inter, bn))](
        x, w_gate, w_up, h, order, blk_e, blk_r0, blk_r1, hid, inter, k,
        x.stride(0), w_gate.stride(0), w_gate.stride(1), h.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec, DOT_F32=interp,
    )
    _down_kernel[(grid_m, triton.cdiv(hid, bn))](
        h, w_down, y, order, weight, blk_e, blk_r0, blk_r1, hid, inter,
        h.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec, DOT_F32=interp,
    )
    return y.view(t, k, hid).sum(1).to(out_dtype)
