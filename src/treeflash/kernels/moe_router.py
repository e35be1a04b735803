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

Small routers also fold the logits GEMM in (FUSED_LOGITS, `moe_gate_fused_triton`): the
program computes its row's E logits from x and the float32 weight itself, in float32 (x
upcast elementwise, products and sums in float32 over chunks of BLOCK_H, no tf32), instead
of a cast of x, a cuBLAS float32 GEMM (a SIMT one, plus a split-K reduce at few rows: ~4.6 us
for 32 x 256 x 8 on an H200) and this kernel: 1 launch where ~4 were. Only while one program
per row reading the whole [E, hidden] weight stays cheap (`fused_logits_ok`); the sum order
differs from cuBLAS, so logits may differ in their last bits (ids only on exact near-ties).

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
# FUSED_LOGITS only while E * hidden <= this: each program (one per row) reads the whole float32
# weight (128 KiB at the limit, L2-resident across rows) and does E * hidden FMAs on its own,
# cheap next to ~3 saved launches. The shipped pair's router (8 x 256 = 2048) is far below;
# DeepSeek-V3 (256 x 7168) and Kimi-K2 (384 x 7168) keep the cuBLAS GEMM + `_moe_gate_kernel`.
FUSED_LOGITS_MAX = 32768
# elements of one [BLOCK_G, BLOCK_S, BLOCK_H] weight chunk: 16 a thread at 4 warps (sm_90, Triton
# 3.6: 56 registers for the pair's 8 x 256, 113 for 64 x 512; 4096 took 242 for the latter)
_FUSED_TILE = 2048
# The split launch (moe_gate_split_triton) for routers past FUSED_LOGITS_MAX, at up to
# SPLIT_MAX_ROWS rows (decode, tree verify); longer forwards keep the cuBLAS GEMM + the gate kernel.
# Past SPLIT_FMA_ROWS the logits run on the tensor cores (16-bit x and weight only): the float32
# FMA form measured 50 us at 8-16 rows on the H100 against the GEMM's 29 (2026-12-06).
SPLIT_MAX_ROWS = 64
SPLIT_FMA_ROWS = 4
_SPLIT_BLOCK_E = 32  # experts a logits program
_SPLIT_MAX = 16  # hidden chunks at most (the routing programs load all partials of a row as one tile)
_SPLIT_WARPS = 8  # a [32, 512] float32 weight chunk is 64 registers a thread
_INTERPRETER_SMS = 64  # the split plan's SM count off the GPU (the interpreter: several chunks)


@triton.jit
def _route(x, idx, ok, g, s, BIAS, scale,
           SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, LIMIT: tl.constexpr, TOP2_SUM: tl.constexpr,
           N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr, NORM: tl.constexpr,
           BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row's routing from its logits x [BLOCK_G, BLOCK_S] (expert idx, -inf where not ok):
    (weights [BLOCK_K] float32, ids [BLOCK_K] int64), the first TOPK in pick order."""
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
    # One block reduction a pick: each expert's key is its choice's order-preserving bits
    # (float32 bits, the negatives' magnitude bits flipped; + 0.0 makes -0.0 rank as 0.0) over
    # the complement of its id, so the largest key is the best choice and, among equal choices,
    # the smallest id. A taken or invalid expert's key is the int64 minimum (a masked-out
    # group's -inf experts stay eligible, last in rank). The weights are gathered once after
    # the picks; three reductions a pick (max, tie-break, score) took 24 for Kimi K2's top 8.
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    bits = (choice + 0.0).to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (bits.to(tl.int64) << 32) | (65535 - idx).to(tl.int64)  # 65535 > any id (MAX_EXPERTS)
    taken = tl.full((BLOCK_G, BLOCK_S), -9223372036854775807 - 1, tl.int64)
    key = tl.where(ok, key, taken)
    rank = tl.full((BLOCK_G, BLOCK_S), -1, tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.max(tl.max(key, 1), 0)
        pick = 65535 - (best & 0xFFFFFFFF)
        hit = idx == pick
        rank = tl.where(hit, j, rank)
        ids = tl.where(kk == j, pick, ids)
        key = tl.where(hit, taken, key)
    hit_k = rank[:, :, None] == kk[None, None, :]  # [BLOCK_G, BLOCK_S, BLOCK_K]
    w = tl.sum(tl.sum(tl.where(hit_k, scores[:, :, None], 0.0), 1), 0)
    if NORM:
        w = w / (tl.sum(w, 0) + 1e-20)
    w = w * scale
    return w, ids


@triton.jit
def _moe_gate_kernel(LOGITS, X, W, BIAS, W_OUT, IDS_OUT, E, S, H, s_lt, s_x, s_w, scale,
                     FUSED_LOGITS: tl.constexpr,
                     SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, LIMIT: tl.constexpr,
                     TOP2_SUM: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                     TOPK: tl.constexpr, NORM: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    s = tl.arange(0, BLOCK_S)
    idx = g[:, None] * S + s[None, :]  # [BLOCK_G, BLOCK_S] expert id
    ok = (g[:, None] < N_GROUP) & (s[None, :] < S) & (idx < E)
    if FUSED_LOGITS:  # logits = x[row] @ W.T in float32: x upcast, products and sums in float32
        hh = tl.arange(0, BLOCK_H)
        w_ptr = W + idx[:, :, None] * s_w + hh[None, None, :]  # [BLOCK_G, BLOCK_S, BLOCK_H]
        x_ptr = X + row * s_x + hh
        acc = tl.zeros((BLOCK_G, BLOCK_S), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h_ok = h0 + hh < H
            xh = tl.load(x_ptr + h0, mask=h_ok, other=0.0).to(tl.float32)
            wh = tl.load(w_ptr + h0, mask=ok[:, :, None] & h_ok[None, None, :], other=0.0)
            acc += tl.sum(wh * xh[None, None, :], 2)
        x = tl.where(ok, acc, float("-inf"))
    else:
        x = tl.load(LOGITS + row * s_lt + idx, mask=ok, other=float("-inf"))
    w, ids = _route(x, idx, ok, g, s, BIAS, scale, SOFTMAX, HAS_BIAS, LIMIT, TOP2_SUM, N_GROUP, TOPK_GROUP,
                    TOPK, NORM, BLOCK_G, BLOCK_S, BLOCK_K)
    kk = tl.arange(0, BLOCK_K)
    out_ok = kk < TOPK
    tl.store(W_OUT + row * TOPK + kk, w, mask=out_ok)
    tl.store(IDS_OUT + row * TOPK + kk, ids, mask=out_ok)


@triton.jit
def _moe_gate_split_kernel(X, W, PART, CNT, BIAS, W_OUT, IDS_OUT, T, E, S, H, N_LOGIT, NSPLIT, N_RGRP,
                           s_x, s_w, scale,
                           SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, LIMIT: tl.constexpr,
                           TOP2_SUM: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                           TOPK: tl.constexpr, NORM: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, K_CHUNK: tl.constexpr,
                           NSPLIT_P2: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """Programs pid < N_LOGIT: logits of BLOCK_T rows (one of N_RGRP groups) for BLOCK_E experts
    over one hidden chunk of K_CHUNK, float32 partials into PART [NSPLIT, T, E], then one count on
    CNT[0]. Programs N_LOGIT + t: row t's routing, once CNT[0] holds N_LOGIT (the NSPLIT partials
    loaded as one tile and summed in a fixed order: deterministic); the last of them to finish
    (CNT[1]) zeroes both counters. Each side loads what it needs as
    one tile, so that all of a program's loads are in flight at once (a loop would wait out each
    load's latency in turn: the first version, 6 rolled steps a program, took 17 us for Kimi K2's
    router at one row)."""
    pid = tl.program_id(0)
    if pid < N_LOGIT:
        rg = pid % N_RGRP  # the row group: programs of one (expert block, chunk) are neighbours
        sp = (pid // N_RGRP) % NSPLIT
        es = (pid // (N_RGRP * NSPLIT)) * BLOCK_E + tl.arange(0, BLOCK_E)
        rows = rg * BLOCK_T + tl.arange(0, BLOCK_T)
        e_ok = es < E
        r_ok = rows < T
        hk = sp * K_CHUNK + tl.arange(0, K_CHUNK)
        k_ok = hk < H
        # the program's whole weight chunk in one load: every byte of it in flight at once
        wc = tl.load(W + es[:, None].to(tl.int64) * s_w + hk[None, :], mask=e_ok[:, None] & k_ok[None, :],
                     other=0.0)  # [BLOCK_E, K_CHUNK]
        if USE_DOT:  # 16-bit x and weight on the tensor cores: exact products, float32 sums
            xk = tl.load(X + rows[:, None].to(tl.int64) * s_x + hk[None, :], mask=r_ok[:, None] & k_ok[None, :],
                         other=0.0)
            if DOT_F32:  # the interpreter's half-precision dot is not faithful: the same sums in float32
                acc = tl.dot(xk.to(tl.float32), tl.trans(wc.to(tl.float32)), input_precision="ieee")
            else:
                acc = tl.dot(xk, tl.trans(wc), out_dtype=tl.float32)
        else:  # float32 products and sums (FMA)
            wc = wc.to(tl.float32)
            acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
            for i in tl.static_range(BLOCK_T):
                r_i = rg * BLOCK_T + i
                xi = tl.load(X + r_i.to(tl.int64) * s_x + hk, mask=k_ok & (hk * 0 + r_i < T), other=0.0).to(tl.float32)
                acc = tl.where(rows[:, None] == r_i, tl.sum(wc * xi[None, :], 1)[None, :], acc)
        part = PART + (sp * T + rows[:, None]).to(tl.int64) * E + es[None, :]
        tl.store(part, acc, mask=r_ok[:, None] & e_ok[None, :])
        tl.debug_barrier()  # every thread's partial stored before the release below
        tl.atomic_add(CNT, 1, sem="release", scope="gpu")
    else:
        row = pid - N_LOGIT
        seen = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
        while seen < N_LOGIT:  # the logits programs are all resident or done: this ends
            seen = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
        g = tl.arange(0, BLOCK_G)
        s = tl.arange(0, BLOCK_S)
        idx = g[:, None] * S + s[None, :]  # [BLOCK_G, BLOCK_S] expert id
        ok = (g[:, None] < N_GROUP) & (s[None, :] < S) & (idx < E)
        j = tl.arange(0, NSPLIT_P2)[:, None, None]
        p_all = PART + (j * T + row).to(tl.int64) * E + idx[None, :, :]  # [NSPLIT_P2, BLOCK_G, BLOCK_S]
        x = tl.sum(tl.load(p_all, mask=(j < NSPLIT) & ok[None, :, :], other=0.0, cache_modifier=".cg"), 0)
        x = tl.where(ok, x, float("-inf"))
        w, ids = _route(x, idx, ok, g, s, BIAS, scale, SOFTMAX, HAS_BIAS, LIMIT, TOP2_SUM, N_GROUP,
                        TOPK_GROUP, TOPK, NORM, BLOCK_G, BLOCK_S, BLOCK_K)
        kk = tl.arange(0, BLOCK_K)
        out_ok = kk < TOPK
        tl.store(W_OUT + row * TOPK + kk, w, mask=out_ok)
        tl.store(IDS_OUT + row * TOPK + kk, ids, mask=out_ok)
        tl.debug_barrier()  # every thread's ids stored before the release below
        if tl.atomic_add(CNT + 1, 1, sem="acq_rel", scope="gpu") == T - 1:  # every row is past its wait
            tl.atomic_xchg(CNT, 0, sem="relaxed", scope="gpu")  # ready for the next call
            tl.atomic_xchg(CNT + 1, 0, sem="relaxed", scope="gpu")


def _check_routing(e, top_k, scoring_func, topk_method, n_group, topk_group, bias, device):
    """Shared argument checks: (bias as float32 or None, LIMIT, groups, experts per group)."""
    assert e <= MAX_EXPERTS and 1 <= top_k <= min(MAX_TOPK, e), (e, top_k)
    assert scoring_func in ("sigmoid", "softmax"), scoring_func
    if topk_method == "noaux_tc":
        assert bias is not None and bias.shape == (e,), None if bias is None else bias.shape
        bias = bias.to(device=device, dtype=torch.float32).contiguous()
    else:
        bias = None
    limit = topk_method != "greedy" and n_group > 1
    groups = n_group if limit else 1
    assert e % groups == 0 and topk_group <= groups, (e, groups, topk_group)
    return bias, limit, groups, e // groups


def _launch(t, e, logits, x, w, h, bias, scoring_func, topk_method, n_group, topk_group, top_k,
            norm_topk_prob, routed_scaling_factor, device):
    bias, limit, groups, per_group = _check_routing(e, top_k, scoring_func, topk_method, n_group,
                                                    topk_group, bias, device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=device)
    if t == 0:
        return weights, ids
    fused = logits is None
    block_g, block_s = triton.next_power_of_2(groups), triton.next_power_of_2(per_group)
    block_h = min(triton.next_power_of_2(h), max(16, _FUSED_TILE // (block_g * block_s))) if fused else 1
    any_t = x if fused else logits  # stands in for the pointers the variant does not read
    _moe_gate_kernel[(t,)](
        any_t, any_t, w if fused else any_t, any_t if bias is None else bias, weights, ids,
        e, per_group, h, 0 if fused else logits.stride(0), x.stride(0) if fused else 0,
        w.stride(0) if fused else 0, float(routed_scaling_factor),
        FUSED_LOGITS=fused, SOFTMAX=scoring_func == "softmax", HAS_BIAS=bias is not None, LIMIT=limit,
        TOP2_SUM=topk_method == "noaux_tc", N_GROUP=groups, TOPK_GROUP=topk_group, TOPK=top_k,
        NORM=bool(norm_topk_prob), BLOCK_G=block_g, BLOCK_S=block_s,
        BLOCK_K=max(2, triton.next_power_of_2(top_k)), BLOCK_H=block_h,
    )
    return weights, ids


def moe_gate_triton(logits: torch.Tensor, bias: torch.Tensor | None, scoring_func: str, topk_method: str,
                    n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool,
                    routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 (row stride free, unit column stride); bias [E] (used for
    noaux_tc). Returns weights [T, top_k] float32 and ids [T, top_k] int64, both contiguous.
    Ids come in pick order (best first), unlike the torch twin's unsorted topk."""
    t, e = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, (logits.dtype, logits.stride())
    return _launch(t, e, logits, None, None, 0, bias, scoring_func, topk_method, n_group, topk_group,
                   top_k, norm_topk_prob, routed_scaling_factor, logits.device)


def fused_logits_ok(e: int, hidden: int, top_k: int) -> bool:
    """Whether `moe_gate_fused_triton` applies (and is meant) for an E x hidden router."""
    return e * hidden <= FUSED_LOGITS_MAX and e <= MAX_EXPERTS and 1 <= top_k <= min(MAX_TOPK, e)


def moe_gate_fused_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scoring_func: str,
                          topk_method: str, n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool,
                          routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_gate_triton(F.linear(x.float(), weight), ...)` in one launch: x [T, hidden] (any float
    dtype, row stride free; a non-unit column stride is copied), weight [E, hidden] float32
    (row stride free). The logits are float32 dot products in the kernel's own sum order."""
    t, h = x.shape
    e, hw = weight.shape
    assert hw == h and weight.dtype == torch.float32 and x.is_floating_point(), (weight.shape, weight.dtype, x.dtype)
    assert weight.device == x.device, (weight.device, x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    return _launch(t, e, None, x, weight, h, bias, scoring_func, topk_method, n_group, topk_group, top_k,
                   norm_topk_prob, routed_scaling_factor, x.device)


def split_logits_ok(t: int, e: int, top_k: int, x_dtype: torch.dtype, w_dtype: torch.dtype) -> bool:
    """Whether `moe_gate_split_triton` applies to t rows of an E-expert router: up to
    SPLIT_FMA_ROWS rows in any float dtypes (float32 FMAs), up to SPLIT_MAX_ROWS where x and the
    weight are the same 16-bit dtype (tensor cores: their products are exact in float32)."""
    rows = SPLIT_MAX_ROWS if x_dtype == w_dtype and x_dtype in (torch.bfloat16, torch.float16) else SPLIT_FMA_ROWS
    return 1 <= t <= rows and e <= MAX_EXPERTS and 1 <= top_k <= min(MAX_TOPK, e)


def plan_router_split(t: int, e: int, hidden: int, num_sms: int) -> dict:
    """The split launch's shape from host-known sizes (graph-capturable): BLOCK_E experts x one
    hidden chunk x BLOCK_T rows a program, about two programs an SM for each row group, at most
    _SPLIT_MAX chunks (Kimi K2, 384 x 7168 on 132 SMs: 12 expert blocks x 14 chunks of 512, each
    program 32 KB of weight in flight at once); rows <= SPLIT_FMA_ROWS as broadcast float32 sums
    (no padding), more as a tensor-core dot over groups of 16 rows (a group's program re-reads
    its chunk from L2)."""
    use_dot = t > SPLIT_FMA_ROWS
    block_t = 16 if use_dot else triton.next_power_of_2(t)
    n_eblk = triton.cdiv(e, _SPLIT_BLOCK_E)
    want = min(_SPLIT_MAX, max(1, 2 * num_sms // n_eblk))
    # (a small hidden dim still splits, in narrower chunks: the tests' models exercise the partials)
    k_chunk = max(16, triton.next_power_of_2(triton.cdiv(hidden, want)))
    nsplit = triton.cdiv(hidden, k_chunk)
    return dict(n_eblk=n_eblk, nsplit=nsplit, n_rgrp=triton.cdiv(t, block_t), BLOCK_T=block_t,
                BLOCK_E=_SPLIT_BLOCK_E, K_CHUNK=k_chunk, NSPLIT_P2=triton.next_power_of_2(nsplit), USE_DOT=use_dot)


def moe_gate_split_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scoring_func: str,
                          topk_method: str, n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool,
                          routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_gate_triton(F.linear(x.float(), weight.float()), ...)` in one launch for large routers at
    decode / verify sizes (`split_logits_ok`): the logits over (expert block, hidden chunk)
    programs across the SMs, each row routed by one more program of the same launch as soon as
    every partial is in (an arrival counter, no second kernel). x [T, hidden] and weight
    [E, hidden] in any float dtype (row strides free), read as they are and upcast: float32
    products and sums, in the kernel's own order (last-bit differences from cuBLAS)."""
    from treeflash.kernels.device import num_sms as _num_sms
    from treeflash.kernels.device import tile_counters as _tile_counters

    t, h = x.shape
    e, hw = weight.shape
    assert hw == h and x.is_floating_point() and weight.is_floating_point(), (weight.shape, weight.dtype, x.dtype)
    assert weight.device == x.device and split_logits_ok(t, e, top_k, x.dtype, weight.dtype), (
        weight.device, x.device, t, e, top_k, x.dtype, weight.dtype)
    bias, limit, groups, per_group = _check_routing(e, top_k, scoring_func, topk_method, n_group,
                                                    topk_group, bias, x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    num_sms = _num_sms(x.device.index or 0) if x.is_cuda else _INTERPRETER_SMS
    plan = plan_router_split(t, e, h, num_sms)
    n_logit = plan.pop("n_eblk") * plan["nsplit"] * plan["n_rgrp"]
    part = torch.empty(plan["nsplit"], t, e, dtype=torch.float32, device=x.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    cnt = _tile_counters(x.device, 2)
    _moe_gate_split_kernel[(n_logit + t,)](
        x, weight, part, cnt, weights if bias is None else bias, weights, ids, t, e, per_group, h, n_logit,
        plan.pop("nsplit"), plan.pop("n_rgrp"), x.stride(0), weight.stride(0), float(routed_scaling_factor),
        SOFTMAX=scoring_func == "softmax", HAS_BIAS=bias is not None, LIMIT=limit,
        TOP2_SUM=topk_method == "noaux_tc", N_GROUP=groups, TOPK_GROUP=topk_group, TOPK=top_k,
        NORM=bool(norm_topk_prob), BLOCK_G=triton.next_power_of_2(groups),
        BLOCK_S=triton.next_power_of_2(per_group), BLOCK_K=max(2, triton.next_power_of_2(top_k)),
        DOT_F32=not x.is_cuda, **plan,
        num_warps=_SPLIT_WARPS,
    )
    return weights, ids


# ---- routing statistics: tokens per expert of one forward, and the running total ------------
# MoE._count did it in four launches a MoE layer (zero_, ones_like, scatter_add_, +=): 20 of the
# shipped pair's ~200 kernels a decode step, in every mode, for figures only the sweep and the
# doctor read. One program histograms every (token, expert) id of a forward here instead, where
# the forward is decode- or verify-sized; a long prefill chunk keeps the torch ops (a single
# program would walk its ~65k ids serially).
COUNT_MAX_IDS = 8192  # ids a forward (tokens x top_k) the one-program count takes


@triton.jit
def _expert_count_kernel(IDS, LAST, TOTAL, N, E, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, N, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        ok = idx < N
        v = tl.load(IDS + idx, mask=ok, other=0).to(tl.int32)
        acc += tl.histogram(v, BLOCK_E, mask=ok)
    counts = acc.to(tl.int64)
    e_ok = e < E
    tl.store(LAST + e, counts, mask=e_ok)
    tl.store(TOTAL + e, tl.load(TOTAL + e, mask=e_ok, other=0) + counts, mask=e_ok)


def expert_counts_triton(ids: torch.Tensor, last: torch.Tensor, total: torch.Tensor) -> None:
    """last[:] = tokens per expert among `ids` (any shape, int, values in [0, E)); total += last.
    last / total: [E] int64, contiguous. One launch, one program: any number of ids, in blocks of
    1024 one after another (kernels.expert_counts takes it for up to COUNT_MAX_IDS)."""
    flat = ids.reshape(-1)
    n, e = flat.numel(), last.numel()
    assert last.dtype == total.dtype == torch.int64, (last.dtype, total.dtype)
    assert last.is_contiguous() and total.is_contiguous() and total.numel() == e, (last.shape, total.shape)
    block_n = min(1024, max(16, triton.next_power_of_2(max(n, 1))))
    _expert_count_kernel[(1,)](flat.contiguous(), last, total, n, e, BLOCK_N=block_n,
                               BLOCK_E=max(16, triton.next_power_of_2(e)), num_warps=4)
