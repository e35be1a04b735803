"""MLA verify attention in Triton: every (node, head) row of a request against its paged latent cache.

One function serves plain decode (N = 1), chain and tree verify (N = 16..256) and chunked
prefill (N up to 2048, causal chain). Design, from the two floors (bytes = L x D x 2 per
layer, flops = 2 x N x H x L x (D + v_dim)):

- heads x nodes are folded into the M tile (row r = n * H + h), so a program reads each
  latent row once for BLOCK_M query rows: the prefix is read once per request per M tile,
  not once per head;
- the key sequence 0 .. prefix_len + N - 1 is cut into `num_splits` chunks spread over the
  SMs (flash-decoding); each program writes a normalised partial (O, LSE) and a combine
  kernel merges them by log-sum-exp. When one split is enough (many M tiles, e.g. prefill)
  the main kernel writes the output directly and no combine runs;
- inside a chunk the prefix part runs unmasked (every row sees the whole prefix) and the
  tree-vs-tree part (the N rows' own latents) runs with the ancestor mask (or j <= i for a
  causal chain, where a tile stops at its last row's node);
- the values are the first v_dim columns of the same latent rows, so one K tile load serves
  both products (QK^T over D columns as [v_dim] + [D - v_dim] halves, PV over v_dim).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

from treeflash import knobs

# `impl="triton"` on CPU tensors runs under the Triton interpreter; the flag must be set
# before the @triton.jit decorators below run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

try:  # host-side TMA descriptors (Triton >= 3.4; the interpreter runs them too)
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402
except ImportError:  # pragma: no cover - older Triton: v3 falls back to pointer loads
    TensorDescriptor = None

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape of the split kernel: BLOCK_M query rows x BLOCK_N latent rows per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    prefetch: bool = False  # hand-pipelined prefix loop (then num_stages should be 1; v2 only)
    version: int = 2  # 2: the v2 kernel; 3: full-tile prefix loop (see _mla_split_kernel_v3);
    # 4: v3's loops with S = QK^T once per tile and two value-half accumulators (mla_verify_v4);
    # 5: the Gluon warp-specialised kernel (mla_verify_v5; sm_90, bf16/fp16, D 576 / v 512,
    # page_size % 64 == 0; any other call with version 5 runs v4's tile instead)
    tma: bool = False  # v3/v4: full tiles through TMA descriptors (page_size % block_n == 0)
    ctas_per_sm: int = 1  # v3 split plan: programs resident per SM (registers / shared memory)
    v3_plan: bool = False  # v2: use v3's wave-aware split plan (plan_splits_v3); v3 always does
    # v5 only: v5c (the default; mla_verify_v5 `_store_staged`), the output / partial halves
    # leave through shared memory as 16-byte row stores; False: v5b (bench variant v5bw)
    staged_store: bool = False
    # the combine's tiles and warps from the H200 sweep (`_combine_tiles`; on for the v5 family)
    combine_wide: bool = False


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pick_config(m_rows: int, dtype: torch.dtype, on_gpu: bool, version: int | None = None,
                page_size: int | None = None) -> KernelConfig:
    """The tile config of a call: `version` 2, 3, 4 or 5 gives that kernel's tile table
    (benchmarks), None the default kernel for this shape (`default_config`).

    v2: M <= 16 rows: 16x64 tiles on 8 warps (mma.sync, no spills), 3 stages; otherwise
    64x64 tiles on 8 warps (wgmma; a 64x512 fp32 accumulator is 128 registers a thread).
    v3 (the full-tile prefix loop; sm_90 compile reports in KERNEL_NOTES.md): Triton gives
    a load addressed through a page id num_stages - 3 buffers, so 5 stages = two tiles in
    flight. M <= 16: 16x64 x 8 warps (mma.sync, 194 registers, no spills, 165 KB shared).
    Otherwise 64x32 x 8 warps through TMA descriptors: the only 64-row tile whose main loop
    has no spill traffic (64x64 reloads ~50 spilled registers per tile; the 32-row
    mma.sync tiles of bench variant v3mid measured 0.12-0.20 of the floor on the H200).
    v4 (mla_verify_v4: S once per tile, two value halves; M > 16 only, v3's tile below):
    64x64 x 8 warps x 4 stages through TMA, two 72 KB tiles in flight, 224 KB shared; its
    hot loop has no spill traffic and no serialised wgmma under Triton 3.6 and 3.9.
    """
    if version is None:
        return default_config(m_rows, dtype, on_gpu, page_size)
    if not on_gpu or _interpreting():
        return KernelConfig(16, 16, 4, 1, version=version)  # the interpreter: small tiles
    if dtype == torch.float32:
        return KernelConfig(16, 32, 4, 1, version=version)  # fp32: the correctness path
    if version == 3 or (version == 4 and m_rows <= 16):  # v4 is for M > 16 only
        if m_rows <= 16:
            return KernelConfig(16, 64, 8, 5, version=3)
        return KernelConfig(64, 32, 8, 5, version=3, tma=True)
    if version == 4:
        return KernelConfig(64, 64, 8, 4, version=4, tma=True)
    if version == 5:  # every M: one 64-row tile a CTA (mla_verify_v5); 4 warps + 2 worker partitions
        return KernelConfig(64, 64, 4, 1, version=5, tma=True)
    if m_rows <= 16:
        return KernelConfig(16, 64, 8, 3)
    return KernelConfig(64, 64, 8, 2)


VERIFY_KERNELS = knobs.VERIFY_KERNELS  # TREEFLASH_VERIFY_KERNEL's values (`default_config`)
V4_MAX_NODES = 256  # v4 runs the new rows' (masked) keys in an unpipelined loop: verify trees, not prefill


def default_config(m_rows: int, dtype: torch.dtype, on_gpu: bool,
                   page_size: int | None = None, nodes: int | None = None) -> KernelConfig:
    """Which kernel a call runs by default: v5 / v4 (QK once; mla_verify_v5.py, v4.py) for more than 16
    rows (M = N x H) over whole tiles (page_size % 64 == 0) for at most V4_MAX_NODES new rows
    a request (v5 takes prefill chunks too; under v4 they keep v3: v4's masked loop is not
    pipelined), else v3, v2 + the v3 split plan where
    v3 would gather (page_size % its BLOCK_N != 0) more than 16 rows; fp32 runs v2.
    In that case the Gluon kernel v5 (mla_verify_v5) runs where it applies (sm_90, bf16/fp16,
    D = 576, v_dim = 512; other calls run v4); TREEFLASH_VERIFY_KERNEL=v4 or v3 keeps that
    kernel there (A/B). v5 runs as v5c: v5b (per-part ring release, PV_lo within its tile, Q by
    TMA) with the output / partial halves leaving through shared memory as 16-byte row stores
    and the tuned combine (`_combine_tiles`); TREEFLASH_VERIFY_KERNEL=v5b drops the staged store
    (A/B); another value is a ValueError. The first v5 (one barrier pair a ring slot), the
    lazy rescale (v5d), v6 and the other measured-and-lost variants are gone since session 16
    (they live in git at 4efd675; KERNEL_NOTES.md "Session 16"). H200, 2026-12-03 session 11
    (results/h200-20261203-softmax-conversions, its softmax without scalar conversions, 67 GPU
    checks ok): 256k 8 x 32 0.78 -> 0.84, 64 x 16 0.75 -> 0.80; 64k 64 x 16 0.75 -> 0.82,
    8 x 32 0.66 -> 0.70; the grid in h200-20261203-lazy-rescale-grid (v5d = v5c within noise).
    H200, 2026-12-03 session 8 (results/h200-20261203-kernel-v5c/kernel-v5c.log, graph
    per-layer fraction of the floor, v5b -> v5b + tuned
    combine -> v5c + tuned combine; 22 GPU checks ok): 32k 8 x 32 0.44 -> 0.49 -> 0.56, 8 x 16
    0.32 -> 0.35 -> 0.41, 64 x 16 0.63 -> 0.69 -> 0.72, 64 x 1 0.32 -> 0.39; 64k 8 x 32
    0.56 -> 0.61 -> 0.66, 64 x 1 0.46 -> 0.52; 256k 8 x 32 0.72 -> 0.75, 64 x 1 0.78 -> 0.82,
    64 x 32 / 64 x 16 0.74 -> 0.74 / 0.73 (+-0.01 of v5bw); 8 x 1 unchanged. H200, 2026-12-03
    (results/h200-20261203-kernel-v5b/k/kernel-v5b.log), v5 -> v5b at 256k: 8 x 32 0.63 ->
    0.72, 8 x 33 0.55 -> 0.63, 64 x 16 0.65 -> 0.74, 64 x 33 0.69 -> 0.76, 8 x 1 0.77 -> 0.87
    (v3's tile stays the default there); at 32k 8 x 32 0.38 -> 0.44, 64 x 32 0.59 -> 0.69;
    its 13 checks and v5's 13 ok.

    v5 on the H200 (2026-12-03, results/h200-20261203-kernel-v5/v5/kernel-v5.log, contiguous page
    64, graph per-layer fraction of the floor, v4 -> v5): 8 x 32 0.46 -> 0.63 at 256k, 0.44 ->
    0.59 at 128k, 0.32 -> 0.38 at 32k; 64 x 32 0.48 -> 0.65; 64 x 16 0.47 -> 0.64; 64 x 1
    0.54 -> 0.70; 8 x 1 (v3's 16-row tile either way) 0.79 / 0.78; its 13 GPU checks ok.

    v4 on the H200 (2026-12-02, results/h200-20261202-kernel-v4/kernel-v4.log, contiguous page 64,
    fraction of the floor, v3 -> v4): 8 x 33 0.26 -> 0.39 at 256k, 0.25 -> 0.38 at 128k,
    0.21 -> 0.30 at 32k; 64 x 33 0.33 -> 0.51; 64 x 16 0.31 -> 0.47; 8 x 16 0.30 -> 0.41 (256k);
    every check (bf16, fp16, fp32, page 1/16/64, TMA and pointer tiles) ok.

    From the H200 run of 2026-12-02 (benchmarks/results/h200-20261202-kernel-v3/
    kernel-v3.log, fraction of the floor, CUDA-graph per-layer figures; KERNEL_NOTES.md):
    - contiguous page 64: v3 is fastest on every shape, e.g. 8 heads x 1 node 0.50 / 0.67 /
      0.79 at 64k / 128k / 256k (v2 0.38 / 0.45 / 0.49), compute-bound shapes 0.27-0.32
      (v2 0.14-0.28, v2 + v3 plan 0.23-0.29), prefill 32k 0.30-0.31 (v2 0.28);
    - scattered page 1 at 64k (v3's gathered tiles): v3 wins only at M = 8 (0.48 vs 0.42);
      for M >= 64 v2 + the v3 plan is faster, e.g. 64 x 16 0.31 vs 0.25, 128 x 64 0.31 vs
      0.26, 8 x 16 0.23 vs 0.21, 64 x 1 0.29 vs 0.28. (Rows 17-63 and page sizes other
      than 1 that are not a multiple of BLOCK_N were not measured; they follow the rule.)
    page_size None: assumed to hold whole tiles (contiguous). fp32 keeps plain v2: v3 was
    measured and checked on the GPU in bf16 only.
    """
    if dtype == torch.float32:
        return pick_config(m_rows, dtype, on_gpu, version=2)
    v3 = pick_config(m_rows, dtype, on_gpu, version=3)
    gathered = page_size is not None and page_size % v3.block_n != 0
    verify = nodes is None or nodes <= V4_MAX_NODES
    choice = knobs.get("TREEFLASH_VERIFY_KERNEL")  # unset or empty: the default (v5c); checked
    v5 = choice not in ("v3", "v4") and on_gpu and not _interpreting()  # Gluon: no interpreter, no CPU
    # v5's masked tiles come by TMA like the prefix's, so prefill chunks run it too (H200,
    # 2026-12-03, results/h200-20261203-prefill-auto: N = 1024, 64-128 heads, 32k-128k,
    # 0.74-0.77 of the matmul ceiling against v3's 0.31-0.32; its 2 prefill checks ok)
    # 16 rows or fewer (plain decode, 8 heads x 1 node at TP8) ran v3's 16-row tile until the
    # v5b variant measured ahead of it at every context (H200, 2026-12-03,
    # results/h200-20261203-kernel-v5b: 8 x 1 0.87 / 0.74 / 0.59 / 0.42 of the floor at 256k /
    # 128k / 64k / 32k against v3's 0.79 / 0.67 / 0.50 / 0.33): v5b's 64-row tile reads the
    # same bytes with the loads overlapped; its padded rows cost tensor time that is free there
    small_v5 = m_rows <= 16 and v5 and choice != "v4"
    if (m_rows > 16 or small_v5) and (verify or v5) and choice != "v3":
        v4 = pick_config(m_rows, dtype, on_gpu, version=5 if v5 else 4)
        if v5:  # + the tuned combine (`_combine_tiles`) + (v5c, the default; not under v5b)
            # the staged store: the figures in the docstring. The sum over splits may round in
            # another order than the 4-warp combine's (bf16 ulp).
            v4 = replace(v4, combine_wide=True, staged_store=choice == "v5c")
        if page_size is None or page_size % v4.block_n == 0:  # whole tiles (v4 gathered: unmeasured)
            return v4
    if gathered and m_rows > 16:
        return replace(pick_config(m_rows, dtype, on_gpu, version=2), v3_plan=True)
    return v3


def plan_splits(batch: int, m_rows: int, capacity: int, cfg: KernelConfig, num_sms: int,
                num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, chunk): cut 0..capacity-1 so batch x M-tiles x splits fills the SMs.

    `capacity` = page_table width x page_size bounds every request's prefix + N and is
    known on the host, so the plan never syncs and a CUDA graph can capture the call.
    Each split writes an fp32 partial of M x v_dim; chunks stay >= 8 blocks so that
    partial traffic stays small beside the latent bytes each split streams.
    """
    m_tiles = triton.cdiv(m_rows, cfg.block_m)
    if num_splits is None:
        want = triton.cdiv(num_sms, batch * m_tiles)
        num_splits = max(1, min(want, triton.cdiv(capacity, 8 * cfg.block_n)))
    chunk = triton.cdiv(triton.cdiv(capacity, num_splits), cfg.block_n) * cfg.block_n
    return triton.cdiv(capacity, chunk), chunk


@functools.lru_cache(maxsize=1024)
def plan_splits_v3(batch: int, m_rows: int, capacity: int, block_m: int, block_n: int,
                   slots: int, v_dim: int = 512, d: int = 576,
                   fill_gain: float = 0.99) -> tuple[int, int]:
    """(num_splits, chunk) minimising a wave model of the v3 kernel's time.

    Time ~ waves x (tiles per split + 2 tiles of fixed cost) + the combine's partial traffic,
    with waves = ceil(batch x M tiles x splits / slots) and slots = SMs x programs per SM.
    v1/v2 asked for ceil(SMs / M tiles) splits, which for 16 M tiles gave 9 x 16 = 144
    programs on 132 SMs: two waves, the second 9% full (about half the time lost).
    More splits are taken only for a >= 3% modelled gain (partials cost more than modelled
    on compute-bound shapes), or for a >= 1% gain (`fill_gain`) when they fill SMs the same
    number of waves left idle: 8 heads x 32 nodes at 256k ran 4 M tiles x 32 splits = 128
    programs on 132 SMs (33 splits: 125 tiles a program instead of 128, -2.3%, modelled 0.977;
    session 8, with the one-warp combine making the 33rd partial cheap). Chunks stay >= 2
    tiles; `capacity` is host-known (no sync, graph-capturable).
    """
    units = batch * triton.cdiv(m_rows, block_m)
    tiles = triton.cdiv(capacity, block_n)
    best = None
    for s in range(1, max(1, min(tiles // 2, 4 * slots)) + 1):
        chunk_tiles = triton.cdiv(tiles, s)
        if s > 1 and triton.cdiv(tiles, chunk_tiles) < s:
            continue  # the same chunk as a smaller s
        waves = triton.cdiv(units * s, slots)
        combine = 0.0 if s == 1 else units * s * block_m * v_dim * 4 / (block_n * d * 2) / slots
        cost = waves * (chunk_tiles + 2) + combine
        gain = fill_gain if best is not None and waves == best[2] else 0.97
        if best is None or cost < gain * best[0]:  # more splits only for a clear gain
            best = (cost, s, waves)
    chunk = triton.cdiv(tiles, best[1]) * block_n
    return triton.cdiv(capacity, chunk), chunk


@triton.jit
def _fit_chunk(total, num_splits, BLOCK_N: tl.constexpr):
    """This request's split length: its own keys (prefix + N) over the planned splits, in
    whole tiles. The host plans the splits on the page table's width (host-known, no sync),
    which a CUDA graph's power-of-two bucket makes up to twice the keys; cutting the planned
    `chunk` instead left half the programs idle and the others with twice the tiles (H200,
    2026-12-02: a 4-layer ddtree verify graph at 256k grew 0.94 ms a layer over 1k where the
    eager kernel took 0.49 ms). Never more than the planned chunk, so the partials fit."""
    return tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _row_offsets(PT, pt_row, pos, valid, page_size, s_kp, s_ks):
    """Element offsets [BLOCK_N] of positions `pos` of one request (page-table lookup)."""
    page = tl.load(PT + pt_row + pos // page_size, mask=valid, other=0).to(tl.int64)
    return page * s_kp + (pos % page_size).to(tl.int64) * s_ks


@triton.jit
def _load_rows(KV, row, valid, offs_v, offs_r, v_dim, D, HAS_ROPE: tl.constexpr):
    """K/V main part [BLOCK_N, BLOCK_V] and rope part [BLOCK_N, BLOCK_R] of rows at `row`."""
    k_main = tl.load(KV + row[:, None] + offs_v[None, :],
                     mask=valid[:, None] & (offs_v[None, :] < v_dim), other=0.0,
                     eviction_policy="evict_first")
    if HAS_ROPE:
        k_rope = tl.load(KV + row[:, None] + v_dim + offs_r[None, :],
                         mask=valid[:, None] & (offs_r[None, :] < D - v_dim), other=0.0,
                         eviction_policy="evict_first")
    else:
        k_rope = k_main
    return k_main, k_rope


@triton.jit
def _load_latent_block(KV, PT, pt_row, pos, valid, page_size, s_kp, s_ks, offs_v, offs_r,
                       v_dim, D, HAS_ROPE: tl.constexpr):
    """Rows `pos` of one request: K/V main part [BLOCK_N, BLOCK_V] and rope part [BLOCK_N, BLOCK_R]."""
    row = _row_offsets(PT, pt_row, pos, valid, page_size, s_kp, s_ks)
    return _load_rows(KV, row, valid, offs_v, offs_r, v_dim, D, HAS_ROPE)


@triton.jit
def _attend(acc, m_i, l_i, q_main, q_rope, k_main, k_rope, allowed, qk_scale,
            HAS_ROPE: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
            MASKED: tl.constexpr = True):
    """One online-softmax step (log2 domain) of the rows against one latent block.
    MASKED=False: every key of the block is visible to every row (`allowed` unused)."""
    if DOT_F32:  # the interpreter's bf16 dot is wrong (Triton 3.9): do it in fp32 there
        k_main = k_main.to(tl.float32)
        k_rope = k_rope.to(tl.float32)
    s = tl.dot(q_main, tl.trans(k_main), input_precision=DOT_PREC)
    if HAS_ROPE:
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PREC)
    if MASKED:
        s = tl.where(allowed, s * qk_scale, float("-inf"))
    else:
        s = s * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k_main.dtype), k_main, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _attend_tree(acc, m_i, l_i, q_main, q_rope, KV, PT, TM, pt_row, b, n_of, row_ok, pid_m, lo, chunk,
                 prefix, N, H, s_kp, s_ks, s_tb, s_tn, offs_v, offs_r, v_dim, D, qk_scale,
                 PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_ROPE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """The tile's rows against the N new rows of this split (causal chain or ancestor mask)."""
    n_end = N
    if IS_CAUSAL:  # a causal tile never looks past its last row's node
        n_end = tl.minimum(N, (pid_m * BLOCK_M + BLOCK_M - 1) // H + 1)
    t_lo = tl.maximum(lo, prefix)
    t_hi = tl.minimum(lo + chunk, prefix + n_end)
    for start in range(t_lo, t_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < t_hi
        j = pos - prefix
        k_main, k_rope = _load_latent_block(KV, PT, pt_row, pos, valid, PAGE_SIZE, s_kp, s_ks,
                                            offs_v, offs_r, v_dim, D, HAS_ROPE)
        if IS_CAUSAL:
            allowed = (j[None, :] <= n_of[:, None]) & valid[None, :]
        else:
            tm = tl.load(TM + b.to(tl.int64) * s_tb + n_of[:, None] * s_tn + j[None, :],
                         mask=row_ok[:, None] & valid[None, :], other=0)
            allowed = tm != 0
        acc, m_i, l_i = _attend(acc, m_i, l_i, q_main, q_rope, k_main, k_rope, allowed,
                                qk_scale, HAS_ROPE, DOT_PREC, DOT_F32)

    return acc, m_i, l_i


@triton.jit
def _store_rows(acc, m_i, l_i, O, LSE, PO, PLSE, b, n_of, h_of, rows, row_ok, offs_v, v_dim, M,
                num_splits, pid_s, s_ob, s_on, s_oh, s_lb, s_ln, DIRECT: tl.constexpr):
    """Normalise and store: the output and natural-log LSE directly, or this split's partials."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    col_ok = offs_v[None, :] < v_dim
    if DIRECT:
        o_row = b.to(tl.int64) * s_ob + n_of * s_on + h_of * s_oh
        tl.store(O + o_row[:, None] + offs_v[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok)
        tl.store(LSE + b.to(tl.int64) * s_lb + n_of * s_ln + h_of, lse2 * 0.6931471805599453,
                 mask=row_ok)
    else:
        p_row = (b.to(tl.int64) * M + rows) * num_splits + pid_s  # partials [B, M, S, v_dim]
        tl.store(PO + p_row[:, None] * v_dim + offs_v[None, :], out.to(PO.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok, eviction_policy="evict_last")
        tl.store(PLSE + p_row, lse2, mask=row_ok, eviction_policy="evict_last")


@triton.jit
def _mla_split_kernel(
    Q, KV, PT, PL, TM, O, LSE, PO, PLSE,
    qk_scale, H, N, M, v_dim, D, chunk_max, num_splits,
    s_qb, s_qn, s_qh, s_kp, s_ks, s_ptb, s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln,
    PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, DIRECT: tl.constexpr, HAS_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    prefix = tl.load(PL + b)
    chunk = _fit_chunk(prefix + N, num_splits, BLOCK_N)
    lo = pid_s * chunk
    if lo >= prefix + N:  # past this request's keys: the combine never reads this split
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    n_of = rows // H
    h_of = rows % H
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    q_row = b.to(tl.int64) * s_qb + n_of * s_qn + h_of * s_qh
    kv_ty = tl.float32 if DOT_F32 else KV.dtype.element_ty
    q_main = tl.load(Q + q_row[:, None] + offs_v[None, :],
                     mask=row_ok[:, None] & (offs_v[None, :] < v_dim), other=0.0).to(kv_ty)
    if HAS_ROPE:
        q_rope = tl.load(Q + q_row[:, None] + v_dim + offs_r[None, :],
                         mask=row_ok[:, None] & (offs_r[None, :] < D - v_dim), other=0.0).to(kv_ty)
    else:
        q_rope = q_main
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    pt_row = b.to(tl.int64) * s_ptb

    # prefix part: every row sees every key, only the chunk's end is masked
    hi = tl.minimum(lo + chunk, prefix)
    if PREFETCH:
        # Software pipeline by hand (num_stages=1): the latent tile of block i+1 is loaded
        # into registers and the page-table rows of block i+2 are fetched while block i is
        # computed, so neither the index lookup nor the tile load sits on the critical path.
        # (Triton's own pipeliner keeps the gather's latency exposed: it waits on the
        # indirect load at the top of every iteration.)
        ar = tl.arange(0, BLOCK_N)
        row_n = _row_offsets(PT, pt_row, lo + ar, lo + ar < hi, PAGE_SIZE, s_kp, s_ks)
        k_main_n, k_rope_n = _load_rows(KV, row_n, lo + ar < hi, offs_v, offs_r, v_dim, D,
                                        HAS_ROPE)
        row_n = _row_offsets(PT, pt_row, lo + BLOCK_N + ar, lo + BLOCK_N + ar < hi, PAGE_SIZE,
                             s_kp, s_ks)
        for start in range(lo, hi, BLOCK_N):
            k_main = k_main_n
            k_rope = k_rope_n
            valid = start + ar < hi
            nxt = start + BLOCK_N + ar
            k_main_n, k_rope_n = _load_rows(KV, row_n, nxt < hi, offs_v, offs_r, v_dim, D,
                                            HAS_ROPE)
            row_n = _row_offsets(PT, pt_row, nxt + BLOCK_N, nxt + BLOCK_N < hi, PAGE_SIZE,
                                 s_kp, s_ks)
            acc, m_i, l_i = _attend(acc, m_i, l_i, q_main, q_rope, k_main, k_rope,
                                    valid[None, :], qk_scale, HAS_ROPE, DOT_PREC, DOT_F32)
    else:
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            valid = pos < hi
            k_main, k_rope = _load_latent_block(KV, PT, pt_row, pos, valid, PAGE_SIZE, s_kp,
                                                s_ks, offs_v, offs_r, v_dim, D, HAS_ROPE)
            acc, m_i, l_i = _attend(acc, m_i, l_i, q_main, q_rope, k_main, k_rope,
                                    valid[None, :], qk_scale, HAS_ROPE, DOT_PREC, DOT_F32)

    # tree part: the N rows' own latents at prefix .. prefix + N - 1, ancestor-masked
    acc, m_i, l_i = _attend_tree(acc, m_i, l_i, q_main, q_rope, KV, PT, TM, pt_row, b, n_of, row_ok,
                                 pid_m, lo, chunk, prefix, N, H, s_kp, s_ks, s_tb, s_tn, offs_v, offs_r,
                                 v_dim, D, qk_scale, PAGE_SIZE, IS_CAUSAL, HAS_ROPE, BLOCK_M, BLOCK_N,
                                 DOT_PREC, DOT_F32)
    _store_rows(acc, m_i, l_i, O, LSE, PO, PLSE, b, n_of, h_of, rows, row_ok, offs_v, v_dim, M,
                num_splits, pid_s, s_ob, s_on, s_oh, s_lb, s_ln, DIRECT)


@triton.jit
def _load_full_tile(KV, KVD, KRD, PT, pt_row, start, s_kp, s_ks, offs_v, offs_r, v_dim, D,
                    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROPE: tl.constexpr,
                    TILE_PAGES: tl.constexpr, USE_TMA: tl.constexpr, EVEN_V: tl.constexpr,
                    EVEN_R: tl.constexpr, EVICT: tl.constexpr):
    """Rows start .. start + BLOCK_N - 1 of one request, all of them valid (no row masks).

    TILE_PAGES (page_size % BLOCK_N == 0, start % BLOCK_N == 0): the tile lies in one page,
    so its address is one page-table entry plus an affine offset. The pipeliner then treats
    the page id as a scalar indirect load a stage ahead and streams the tile with 16-byte
    cp.async (or one TMA copy per operand with USE_TMA) into multi-buffered shared memory;
    there is no per-row index and no mask on the tile. Otherwise (page_size < BLOCK_N) one
    page-table entry per row, still without masks. EVICT: "evict_first" when one M tile reads
    the prefix (nothing else will), "" when several M tiles share it through L2."""
    ar = tl.arange(0, BLOCK_N)
    if TILE_PAGES:
        page = tl.load(PT + pt_row + start // PAGE_SIZE)
        if USE_TMA:  # descriptors over the [num_pages * page_size, D] row view
            r0 = page * PAGE_SIZE + start % PAGE_SIZE
            k_main = KVD.load([r0, 0])
            if HAS_ROPE:
                k_rope = KRD.load([r0, 0])
            else:
                k_rope = k_main
            return k_main, k_rope
        row = page.to(tl.int64) * s_kp + (start % PAGE_SIZE) * s_ks + ar.to(tl.int64) * s_ks
    else:
        pos = start + ar
        page = tl.load(PT + pt_row + pos // PAGE_SIZE).to(tl.int64)
        row = page * s_kp + (pos % PAGE_SIZE).to(tl.int64) * s_ks
    if EVEN_V:
        k_main = tl.load(KV + row[:, None] + offs_v[None, :], eviction_policy=EVICT)
    else:
        k_main = tl.load(KV + row[:, None] + offs_v[None, :], mask=offs_v[None, :] < v_dim,
                         other=0.0, eviction_policy=EVICT)
    if HAS_ROPE:
        if EVEN_R:
            k_rope = tl.load(KV + row[:, None] + v_dim + offs_r[None, :],
                             eviction_policy=EVICT)
        else:
            k_rope = tl.load(KV + row[:, None] + v_dim + offs_r[None, :],
                             mask=offs_r[None, :] < D - v_dim, other=0.0,
                             eviction_policy=EVICT)
    else:
        k_rope = k_main
    return k_main, k_rope


@triton.jit
def _mla_split_kernel_v3(
    Q, KV, KVD, KRD, PT, PL, TM, O, LSE, PO, PLSE,
    qk_scale, H, N, M, v_dim, D, chunk_max, num_splits,
    s_qb, s_qn, s_qh, s_kp, s_ks, s_ptb, s_tb, s_tn, s_ob, s_on, s_oh, s_lb, s_ln,
    PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, DIRECT: tl.constexpr, HAS_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, TILE_PAGES: tl.constexpr,
    USE_TMA: tl.constexpr, EVEN_V: tl.constexpr, EVEN_R: tl.constexpr, EVICT: tl.constexpr,
):
    """v3: as v2, but the prefix is cut into full tiles (no masks, one page id per tile when
    a tile fits in a page, pipelined) plus at most one masked tail tile; then the tree part."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    prefix = tl.load(PL + b)
    chunk = _fit_chunk(prefix + N, num_splits, BLOCK_N)
    lo = pid_s * chunk
    if lo >= prefix + N:  # past this request's keys: the combine never reads this split
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    n_of = rows // H
    h_of = rows % H
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    q_row = b.to(tl.int64) * s_qb + n_of * s_qn + h_of * s_qh
    kv_ty = tl.float32 if DOT_F32 else KV.dtype.element_ty
    q_main = tl.load(Q + q_row[:, None] + offs_v[None, :],
                     mask=row_ok[:, None] & (offs_v[None, :] < v_dim), other=0.0).to(kv_ty)
    if HAS_ROPE:
        q_rope = tl.load(Q + q_row[:, None] + v_dim + offs_r[None, :],
                         mask=row_ok[:, None] & (offs_r[None, :] < D - v_dim), other=0.0).to(kv_ty)
    else:
        q_rope = q_main
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    pt_row = b.to(tl.int64) * s_ptb

    # prefix part, full tiles: every row sees every key, nothing to mask
    hi = tl.minimum(lo + chunk, prefix)
    hi_full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, hi_full, BLOCK_N):
        k_main, k_rope = _load_full_tile(KV, KVD, KRD, PT, pt_row, start, s_kp, s_ks, offs_v,
                                         offs_r, v_dim, D, PAGE_SIZE, BLOCK_N, HAS_ROPE,
                                         TILE_PAGES, USE_TMA, EVEN_V, EVEN_R, EVICT)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q_main, q_rope, k_main, k_rope, None,
                                qk_scale, HAS_ROPE, DOT_PREC, DOT_F32, False)
    # prefix part, the one partial tile at the end of the prefix (masked rows)
    for start in range(hi_full, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        k_main, k_rope = _load_latent_block(KV, PT, pt_row, pos, valid, PAGE_SIZE, s_kp,
                                            s_ks, offs_v, offs_r, v_dim, D, HAS_ROPE)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q_main, q_rope, k_main, k_rope,
                                valid[None, :], qk_scale, HAS_ROPE, DOT_PREC, DOT_F32)

    # tree part: the N rows' own latents at prefix .. prefix + N - 1, ancestor-masked
    acc, m_i, l_i = _attend_tree(acc, m_i, l_i, q_main, q_rope, KV, PT, TM, pt_row, b, n_of, row_ok,
                                 pid_m, lo, chunk, prefix, N, H, s_kp, s_ks, s_tb, s_tn, offs_v, offs_r,
                                 v_dim, D, qk_scale, PAGE_SIZE, IS_CAUSAL, HAS_ROPE, BLOCK_M, BLOCK_N,
                                 DOT_PREC, DOT_F32)
    _store_rows(acc, m_i, l_i, O, LSE, PO, PLSE, b, n_of, h_of, rows, row_ok, offs_v, v_dim, M,
                num_splits, pid_s, s_ob, s_on, s_oh, s_lb, s_ln, DIRECT)


@triton.jit
def _mla_combine_kernel(
    PO, PLSE, PL, O, LSE, H, N, M, v_dim, num_splits,
    s_ob, s_on, s_oh, s_lb, s_ln,
    BLOCK_S: tl.constexpr, BLOCK_VC: tl.constexpr, BLOCK_N: tl.constexpr,
    ALL_SPLITS: tl.constexpr = False,
):
    # ALL_SPLITS (the v5 split kernel): every split slot holds a partial, empty ones (LSE -inf,
    # values 0) included, so a row reads all num_splits of them and the first loads do not wait
    # for prefix_lens (the same sums: an empty split weighs exactly 0)
    row = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = tl.program_id(2)
    if ALL_SPLITS:
        n_valid = num_splits
    else:
        total = tl.load(PL + b) + N
        n_valid = tl.minimum(tl.cdiv(total, _fit_chunk(total, num_splits, BLOCK_N)), num_splits)
    offs_s = tl.arange(0, BLOCK_S)
    offs_v = pid_v * BLOCK_VC + tl.arange(0, BLOCK_VC)
    base = (b.to(tl.int64) * M + row) * num_splits  # a row's splits are adjacent (partials [B, M, S])
    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([BLOCK_VC], tl.float32)
    for s0 in range(0, n_valid, BLOCK_S):
        s_ok = s0 + offs_s < n_valid
        p_row = base + (s0 + offs_s).to(tl.int64)
        lse_s = tl.load(PLSE + p_row, mask=s_ok, other=float("-inf"), eviction_policy="evict_first")
        o_s = tl.load(PO + p_row[:, None] * v_dim + offs_v[None, :],
                      mask=s_ok[:, None] & (offs_v[None, :] < v_dim), other=0.0,
                      eviction_policy="evict_first").to(tl.float32)
        m_new = tl.maximum(m_run, tl.max(lse_s, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse_s - m_use)  # [BLOCK_S]
        alpha = tl.exp2(m_run - m_use)
        l_run = l_run * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o_s, 0)
        m_run = m_new
    l_safe = tl.where(l_run == 0.0, 1.0, l_run)
    n_of = row // H
    h_of = row % H
    o_row = b.to(tl.int64) * s_ob + n_of * s_on + h_of * s_oh
    tl.store(O + o_row + offs_v, (acc / l_safe).to(O.dtype.element_ty), mask=offs_v < v_dim)
    lse = tl.where(l_run == 0.0, float("-inf"), m_run + tl.log2(l_safe)) * 0.6931471805599453
    tl.store(LSE + b.to(tl.int64) * s_lb + n_of * s_ln + h_of, lse, mask=pid_v == 0)


def _check_inputs(q, kv_cache, page_table, prefix_lens, tree_mask, v_dim):
    b, n, h, d = q.shape
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), q.dtype
    assert kv_cache.dtype in (torch.float32, torch.bfloat16, torch.float16), kv_cache.dtype
    assert kv_cache.dim() == 3 and kv_cache.shape[2] == d, (kv_cache.shape, q.shape)
    assert q.stride(3) == 1 and kv_cache.stride(2) == 1, "last dim must be contiguous"
    assert 0 < v_dim <= d, (v_dim, d)
    assert page_table.dtype == torch.int32 and page_table.dim() == 2 and page_table.shape[0] == b
    assert page_table.stride(1) == 1
    assert prefix_lens.dtype == torch.int32 and prefix_lens.shape == (b,)
    assert prefix_lens.is_contiguous()
    if tree_mask is not None:
        assert tree_mask.shape == (b, n, n) and tree_mask.dtype == torch.bool, tree_mask.shape
    devs = {t.device for t in (q, kv_cache, page_table, prefix_lens)}
    assert len(devs) == 1, devs


def mla_verify_attention_triton(q, kv_cache, page_table, prefix_lens, tree_mask, sm_scale,
                                v_dim=512, *, config: KernelConfig | None = None,
                                num_splits: int | None = None,
                                partial_dtype: torch.dtype | None = None):
    """Triton twin of `treeflash.kernels.reference.mla_verify_attention`.

    out[b, n, h] = sum_s softmax_s(sm_scale * q[b, n, h] . K[s]) V[s] over the keys s that
    row (n, h) sees: every prefix position 0 .. prefix_lens[b]-1, and node j (position
    prefix_lens[b] + j) when tree_mask[b, n, j] (tree_mask None: j <= n).
    lse[b, n, h] = log sum_s exp(sm_scale * q . K[s]) (natural log, float32).

    Shapes/dtypes: q [B, N, H, D] fp32/bf16/fp16 (last dim contiguous; any other strides);
    kv_cache [num_pages, page_size, D] (row = c_kv[0:v_dim] then k_pe[v_dim:D]; K = row,
    V = row[:v_dim]); position p of request b lives at kv_cache[page_table[b, p // page_size],
    p % page_size]; page_table [B, max_pages] int32 (entries past a request's pages are never
    read); prefix_lens [B] int32; tree_mask [B, N, N] bool or None.
    Returns out [B, N, H, v_dim] (q.dtype, contiguous) and lse [B, N, H] float32.
    Work split: grid (M tiles, splits, B) with M = N x H rows (row = n * H + h); partials
    [B, M, splits, v_dim] in `partial_dtype` (default: fp32 for fp32 q, else q.dtype) and
    [B, M, splits] fp32 (log2) are merged by a combine kernel with grid (M, v_dim / 64, B).
    Kernel, tiles and split plan: `default_config` (v3, or v2 + the v3 plan for gathered
    tiles of > 16 rows); `config` / `num_splits` override them (benchmarks;
    `KernelConfig(version=4)` runs `mla_verify_v4`, v3 where v_dim < 32).
    """
    _check_inputs(q, kv_cache, page_table, prefix_lens, tree_mask, v_dim)
    b, n, h, d = q.shape
    m_rows = n * h
    on_gpu = q.is_cuda
    cfg = config or default_config(m_rows, kv_cache.dtype, on_gpu, kv_cache.shape[1], nodes=n)
    # v5's fallback: v4, v3 for prefill. v5 takes the row max on the unscaled scores, which
    # needs sm_scale > 0 (every softmax scale in practice; the others run v4)
    if cfg.version == 5 and (not _v5_supported(q, kv_cache, v_dim) or not sm_scale > 0):
        cfg = pick_config(m_rows, kv_cache.dtype, on_gpu, version=4 if n <= V4_MAX_NODES else 3)
    sms = _num_sms(q.device.index or 0) if on_gpu and not _interpreting() else 4
    capacity = page_table.shape[1] * kv_cache.shape[1]
    if (cfg.version >= 3 or cfg.v3_plan) and num_splits is None:
        splits, chunk = plan_splits_v3(b, m_rows, capacity, cfg.block_m, cfg.block_n,
                                       sms * cfg.ctas_per_sm, v_dim, d)
    else:
        splits, chunk = plan_splits(b, m_rows, capacity, cfg, sms, num_splits)
    direct = splits == 1
    if partial_dtype is None:  # half inputs: half partials (bounded by max|V|; half the traffic)
        partial_dtype = torch.float32 if q.dtype == torch.float32 else q.dtype
    out = torch.empty(b, n, h, v_dim, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, n, h, device=q.device, dtype=torch.float32)
    if direct:
        po, plse = out, lse  # unused
    else:
        # split-minor: a row's partials are adjacent, so the combine reads each row's S x v_dim
        # values as one block (split-major put them M x v_dim apart; KERNEL_NOTES.md "Session 12")
        po = torch.empty(b, m_rows, splits, v_dim, device=q.device, dtype=partial_dtype)
        plse = torch.empty(b, m_rows, splits, device=q.device, dtype=torch.float32)
    tm = q if tree_mask is None else tree_mask.contiguous().view(torch.uint8)
    block_v = max(16, triton.next_power_of_2(v_dim))
    block_r = max(16, triton.next_power_of_2(max(d - v_dim, 1)))
    fp32 = kv_cache.dtype == torch.float32
    grid = (triton.cdiv(m_rows, cfg.block_m), splits, b)
    if cfg.version == 5:
        from treeflash.kernels.mla_verify_v5 import launch_v5

        launch_v5(grid, q, kv_cache, page_table, prefix_lens, tm, out, lse, po, plse, sm_scale,
                  h, n, m_rows, splits, tree_mask, direct, staged_store=cfg.staged_store)
    elif cfg.version == 4 and block_v >= 32:
        # imported here: mla_verify_v4 builds on this module's helpers
        from treeflash.kernels.mla_verify_v4 import launch_v4

        launch_v4(grid, cfg, q, kv_cache, page_table, prefix_lens, tm, out, lse, po, plse,
                  sm_scale, h, n, m_rows, v_dim, d, chunk, splits, tree_mask, direct,
                  block_v, block_r, fp32)
    elif cfg.version >= 3:  # v3, and v4's fallback for value parts under 32 columns
        _launch_v3(grid, cfg, q, kv_cache, page_table, prefix_lens, tm, out, lse, po, plse,
                   sm_scale, h, n, m_rows, v_dim, d, chunk, splits, tree_mask, direct,
                   block_v, block_r, fp32)
    else:
        _mla_split_kernel[grid](
            q, kv_cache, page_table, prefix_lens, tm, out, lse, po, plse,
            float(sm_scale) * LOG2E, h, n, m_rows, v_dim, d, chunk, splits,
            q.stride(0), q.stride(1), q.stride(2), kv_cache.stride(0), kv_cache.stride(1),
            page_table.stride(0),
            0 if tree_mask is None else n * n, 0 if tree_mask is None else n,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            PAGE_SIZE=kv_cache.shape[1], IS_CAUSAL=tree_mask is None, DIRECT=direct, HAS_ROPE=d > v_dim,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_V=block_v, BLOCK_R=block_r,
            DOT_PREC="ieee" if fp32 or _interpreting() else "tf32",
            DOT_F32=_interpreting(), PREFETCH=cfg.prefetch,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if not direct:
        block_s = min(64, triton.next_power_of_2(splits))
        block_vc = min(64, block_v)
        if cfg.version >= 3:  # one pass over all splits; >= ~128 programs when rows are few
            block_s = min(256, triton.next_power_of_2(splits))
            block_vc = min(32 if b * m_rows < 64 else 64, block_v)
        warps = 4
        if cfg.version >= 3 and cfg.combine_wide:
            block_s, block_vc, warps = _combine_tiles(splits, block_v, b * m_rows, sms)
        _mla_combine_kernel[(m_rows, triton.cdiv(v_dim, block_vc), b)](
            po, plse, prefix_lens, out, lse, h, n, m_rows, v_dim, splits,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            BLOCK_S=block_s, BLOCK_VC=block_vc, BLOCK_N=cfg.block_n, num_warps=warps,
            # the v5 split kernel stores every split, empty ones included
            **({"ALL_SPLITS": True} if cfg.version == 5 else {}),
        )
    return out, lse


def _combine_tiles(splits: int, block_v: int, rows: int, sms: int) -> tuple[int, int, int]:
    """`KernelConfig.combine_wide`: the combine's (BLOCK_S, BLOCK_VC, num_warps). The combine reads
    ~8.6 MB of bf16 partials the split kernel has just written (L2-resident); its time is the
    latency of one load round per program, so what counts is how many rounds an SM runs, not the
    width of a program. H200 sweep (benchmarks/tune_combine.py, results/h200-20261203-tune-combine,
    graph of 50 launches): one warp a program over <= 4096 partial values (32 splits at a time)
    beat the 4-warp tiles everywhere from 64 rows up: 8 x 32 at 33 splits 9.57 -> 4.69 us,
    8 x 16 at 65 6.98 -> 4.47, 64 x 1 at 129 5.21 -> 5.00, 64 x 16 at 8 8.03 -> 3.67, 64 x 32
    at 4 13.28 -> 3.81. Under 64 rows (8 x 1 at 129 splits: 2.80 us, the best of the sweep) the
    4-warp program over all splits stays. BLOCK_VC halves while the grid has < 2 programs an SM."""
    if rows < 64:
        return min(256, triton.next_power_of_2(splits)), min(32, block_v), 4
    block_s = min(32, triton.next_power_of_2(splits))
    block_vc = min(block_v, max(32, 4096 // block_s))
    while block_vc > 64 and rows * triton.cdiv(block_v, block_vc) < 2 * sms:
        block_vc //= 2
    return block_s, block_vc, 1


def _v5_supported(q: torch.Tensor, kv_cache: torch.Tensor, v_dim: int) -> bool:
    """Whether the Gluon kernel runs this call; never on CPU or under the interpreter (the
    module, and Gluon, are imported only on a GPU)."""
    if not q.is_cuda or _interpreting():
        return False
    from treeflash.kernels.mla_verify_v5 import supported

    return supported(q, kv_cache, v_dim)


def _tma_ok(kv_cache: torch.Tensor, v_dim: int, cfg: KernelConfig) -> bool:
    """TMA needs the [num_pages * page_size, D] row view, 16-byte aligned bases and strides."""
    es = kv_cache.element_size()
    return (TensorDescriptor is not None and cfg.tma and kv_cache.shape[1] % cfg.block_n == 0
            and kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.stride(1)
            and (kv_cache.stride(1) * es) % 16 == 0 and (v_dim * es) % 16 == 0
            and kv_cache.data_ptr() % 16 == 0)


def _launch_v3(grid, cfg, q, kv_cache, page_table, prefix_lens, tm, out, lse, po, plse,
               sm_scale, h, n, m_rows, v_dim, d, chunk, splits, tree_mask, direct,
               block_v, block_r, fp32):
    launch_tiled(_mla_split_kernel_v3, block_v, grid, cfg, q, kv_cache, page_table, prefix_lens,
                 tm, out, lse, po, plse, sm_scale, h, n, m_rows, v_dim, d, chunk, splits, tree_mask,
                 direct, block_v, block_r, fp32)


def launch_tiled(kernel, v_tile_cols, grid, cfg, q, kv_cache, page_table, prefix_lens, tm, out, lse,
                 po, plse, sm_scale, h, n, m_rows, v_dim, d, chunk, splits, tree_mask, direct,
                 block_v, block_r, fp32, **constexprs):
    """Launch a full-tile split kernel (v3, v4: one argument list): TMA descriptors over the
    [num_pages * page_size, D] row view when the layout allows (value tiles v_tile_cols
    wide), else the page-addressed pointer path."""
    page_size = kv_cache.shape[1]
    tile_pages = page_size % cfg.block_n == 0
    use_tma = tile_pages and _tma_ok(kv_cache, v_dim, cfg)
    kvd = krd = kv_cache
    if use_tma:
        rows = kv_cache.shape[0] * page_size
        flat = kv_cache.view(rows, d)  # one row per position slot
        kvd = krd = TensorDescriptor(flat, [rows, v_dim], [flat.stride(0), 1], [cfg.block_n, v_tile_cols])
        if d > v_dim:
            krd = TensorDescriptor(flat[:, v_dim:], [rows, d - v_dim], [flat.stride(0), 1],
                                   [cfg.block_n, block_r])
    kernel[grid](
        q, kv_cache, kvd, krd, page_table, prefix_lens, tm, out, lse, po, plse,
        float(sm_scale) * LOG2E, h, n, m_rows, v_dim, d, chunk, splits,
        q.stride(0), q.stride(1), q.stride(2), kv_cache.stride(0), kv_cache.stride(1),
        page_table.stride(0),
        0 if tree_mask is None else n * n, 0 if tree_mask is None else n,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        PAGE_SIZE=page_size, IS_CAUSAL=tree_mask is None, DIRECT=direct, HAS_ROPE=d > v_dim,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_V=block_v, BLOCK_R=block_r,
        DOT_PREC="ieee" if fp32 or _interpreting() else "tf32", DOT_F32=_interpreting(),
        TILE_PAGES=tile_pages, USE_TMA=use_tma, EVEN_V=block_v == v_dim,
        EVEN_R=block_r == d - v_dim, EVICT="evict_first" if grid[0] == 1 else "",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **constexprs,
    )


def flops_and_bytes(n: int, h: int, context: int, d: int = 576, v_dim: int = 512,
                    elem_bytes: int = 2) -> tuple[float, float]:
    """The two floors' numerators for one call: 2 N H L (D + v_dim) flops, L D bytes."""
    return 2.0 * n * h * context * (d + v_dim), float(context) * d * elem_bytes


__all__ = ["KernelConfig", "default_config", "flops_and_bytes", "mla_verify_attention_triton",
           "pick_config", "plan_splits", "plan_splits_v3"]
