"""DFlash drafter attention: a block of Q query rows per request against its committed context
K/V plus the block's own K/V, GQA, masks from positions, without copying the context.

The torch path (`sdpa_attention`, the drafter's path before this kernel) concatenates the
block onto the context, repeats K/V to every query head and builds an [B, Q, L+Q] mask: it
copies the whole context K/V (Hq/Hkv + 1 times) every layer of every step. The floor is
reading the context K/V once (2 x Hkv x L x D x bytes per layer). The Triton kernel:

- folds the G = Hq/Hkv query heads of one kv head and the Q block rows into one M tile
  (row r = g * Q + i), so each K/V tile is loaded once for G x Q rows;
- reads the context straight from its [B, Hkv, L, D] tensors (any strides but the last)
  and computes visibility from positions: a context slot at position -1 (padding, e.g.
  the unused capacity of a static view) is never read, its K/V rows are masked off the
  loads; a sliding window cuts |p - j| >= W; causal layers cut block keys j > p;
- cuts 0..L-1 into `num_splits` chunks (flash-decoding): the split count depends only on
  shapes (B, Hkv, L, the SM count), never on data, so a CUDA graph can capture the call.
  Each split writes a partial (O in the input dtype, log2-LSE in fp32) and a combine
  kernel merges them; with one split the main kernel writes the output directly. The
  block's own Q keys go to the last split (a static view's trailing padding leaves it
  the lightest).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

# `impl="triton"` on CPU tensors runs under the Triton interpreter; the flag must be set
# before the @triton.jit decorators below run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

LOG2E = 1.4426950408889634

# A split may stream a single K/V tile. It was 4 ("its partial stays small beside them") until
# the shipped drafter's shapes were timed on the H200 (2026-12-03, benchmarks/tune_small_splits.py,
# results/h200-20261203-small-splits/tune-small-splits.log; 4 / 2 heads x 64, a block of
# 16 rows, under a CUDA graph): the sliding layer's 8-tile ring ran 12.0 us at the planned 2
# splits against 7.7 at 8 (one tile a split); the full layer (a static view of 2x the context)
# at 1k 10.5 us at the planned 8 against 7.3 at 32. Every count tried, up to 32, beat the plan's
# smaller ones: the call is latency-bound, and more, shorter splits always won. Long contexts
# keep their plan (2 programs an SM reached before 4 tiles a split did).
MIN_SPLIT_TILES = 1
PROGRAMS_PER_SM = 2  # split target: two programs resident per SM hide each other's latency


@dataclass(frozen=True)
class TileConfig:
    """BLOCK_M query rows (G x Q, padded) x BLOCK_N keys per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # True: context loads predicated on position >= 0 (padding bytes are never fetched, but
    # each K/V load waits for its tile's positions); False: loads bounded by the chunk only,
    # padding fetched and zeroed (independent loads; for the benchmark's comparison).
    pred_loads: bool = True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pick_tiles(m_rows: int, d: int, dtype: torch.dtype, on_gpu: bool) -> TileConfig:
    """Tiles of a call. M = G x Q rows padded to a power of two (>= 16 for tl.dot), at most
    128 (more rows: several M tiles). Not yet tuned on the H200 (bench_drafter_attn.py
    measures it): 64 keys x D <= 128 per step in half precision, 3 stages; 8 warps once the
    fp32 accumulator M x D reaches 128 x 128 (64 KB, 128 registers a thread on 4 warps)."""
    block_m = min(128, max(16, triton.next_power_of_2(m_rows)))
    if not on_gpu or _interpreting():
        return TileConfig(block_m, 16, 4, 1)  # the interpreter: small key tiles
    block_d = max(16, triton.next_power_of_2(d))
    warps = 8 if block_m * block_d >= 128 * 128 else 4
    if dtype == torch.float32:
        return TileConfig(block_m, 32, warps, 2)
    return TileConfig(block_m, 64 if block_d <= 128 else 32, warps, 3)


def plan_splits(units: int, length: int, block_n: int, num_sms: int,
                num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, chunk): cut context slots 0..length-1 into chunks of whole BLOCK_N tiles.

    units = B x Hkv x M tiles programs exist per split; the plan asks for PROGRAMS_PER_SM x
    SMs programs in all, chunks of at least MIN_SPLIT_TILES tiles. Depends only on shapes
    (no host sync, graph-capturable). `num_splits` forces a count (tests, benchmarks); it
    is clamped to one split per tile. length 0 (an empty context) is one split.
    """
    tiles = triton.cdiv(length, block_n)
    if tiles == 0:
        return 1, block_n
    if num_splits is None:
        want = triton.cdiv(PROGRAMS_PER_SM * num_sms, units)
        num_splits = min(want, triton.cdiv(tiles, MIN_SPLIT_TILES))
    num_splits = max(1, min(num_splits, tiles))
    chunk = triton.cdiv(tiles, num_splits) * block_n
    return triton.cdiv(length, chunk), chunk


def launch_plan(q: torch.Tensor, ctx_k: torch.Tensor, tiles: TileConfig | None = None,
                num_splits: int | None = None) -> tuple[TileConfig, int, int, int]:
    """(tiles, M tiles per kv head, num_splits, chunk) of a call on q [B, Hq, Q, D] and
    ctx_k [B, Hkv, L, D]: shapes and the device only."""
    b, hq, nq, d = q.shape
    hkv, length = ctx_k.shape[1], ctx_k.shape[2]
    m_rows = hq // hkv * nq
    on_gpu = q.is_cuda and not _interpreting()
    cfg = tiles or pick_tiles(m_rows, d, q.dtype, on_gpu)
    m_tiles = triton.cdiv(m_rows, cfg.block_m)
    sms = _num_sms(q.device.index or 0) if on_gpu else 4
    return (cfg, m_tiles, *plan_splits(b * hkv * m_tiles, length, cfg.block_n, sms, num_splits))


@triton.jit
def _online_step(acc, m_i, l_i, q, k, v, allowed, qk_scale,
                 DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """One online-softmax step (log2 domain) of the M rows against one K/V tile."""
    if DOT_F32:  # the interpreter's bf16 dot is wrong (Triton 3.9): do it in fp32 there
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    s = tl.where(allowed, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


# n_rows = B x Hq x Q follows the live batch (any size as a batch shrinks, not its graph bucket): not
# specialized, else a batch of a size the warm-up never ran may compile inside a served step
# (tests/engine/test_batch_step.py); it only scales the partials' row offsets
@triton.jit(do_not_specialize=["n_rows"])
def _drafter_attn_kernel(
    Q, CK, CV, BK, BV, CPOS, QPOS, O, PO, PLSE,
    qk_scale, L, NQ, HQ, G, M, M_TILES, chunk, num_splits, n_rows, window,
    s_qb, s_qh, s_qq, s_ckb, s_ckh, s_ckl, s_cvb, s_cvh, s_cvl,
    s_bkb, s_bkh, s_bkq, s_bvb, s_bvh, s_bvq, s_cpb, s_qpb, s_ob, s_oh, s_oq,
    D: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, PRED_LOADS: tl.constexpr,
):
    """Program (split s, kv head x M tile, request b): rows of the tile against context slots
    s*chunk .. (s+1)*chunk-1, and (last split only) the block's own keys."""
    pid_s = tl.program_id(0)
    pid_hm = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    kvh = (pid_hm // M_TILES).to(tl.int64)
    rows = (pid_hm % M_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    hq = kvh * G + rows // NQ  # [BLOCK_M] query head of each row
    qi = rows % NQ  # [BLOCK_M] block row of each row
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_ty = tl.float32 if DOT_F32 else Q.dtype.element_ty
    q = tl.load(Q + b * s_qb + hq[:, None] * s_qh + qi[:, None] * s_qq + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(q_ty)  # [BLOCK_M, BLOCK_D]
    p = tl.load(QPOS + b * s_qpb + qi, mask=row_ok, other=0)  # [BLOCK_M] position of each row
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # context: slots lo .. hi-1 of this split; padding (position -1) is neither read nor seen
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, L)
    ck = CK + b * s_ckb + kvh * s_ckh
    cv = CV + b * s_cvb + kvh * s_cvh
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        j = tl.load(CPOS + b * s_cpb + offs_n, mask=offs_n < hi, other=-1)  # [BLOCK_N]
        key_ok = j >= 0
        allowed = key_ok[None, :] & row_ok[:, None]
        if HAS_WINDOW:
            allowed = allowed & (p[:, None] - j[None, :] < window) & (j[None, :] - p[:, None] < window)
        n64 = offs_n.to(tl.int64)[:, None]
        if PRED_LOADS:
            kv_mask = key_ok[:, None] & d_ok[None, :]
        else:
            kv_mask = (offs_n < hi)[:, None] & d_ok[None, :]
        k = tl.load(ck + n64 * s_ckl + offs_d[None, :], mask=kv_mask, other=0.0,
                    eviction_policy="evict_first")
        v = tl.load(cv + n64 * s_cvl + offs_d[None, :], mask=kv_mask, other=0.0,
                    eviction_policy="evict_first")
        if not PRED_LOADS:  # padding rows were fetched: never let them (NaN, inf) reach the sums
            k = tl.where(key_ok[:, None], k, 0.0)
            v = tl.where(key_ok[:, None], v, 0.0)
        acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k, v, allowed, qk_scale, DOT_PREC, DOT_F32)

    # the block's own keys (positions q_pos), on the last split only
    blk_hi = tl.where(pid_s == num_splits - 1, NQ, 0)
    bk = BK + b * s_bkb + kvh * s_bkh
    bv = BV + b * s_bvb + kvh * s_bvh
    for start in range(0, blk_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < NQ
        j = tl.load(QPOS + b * s_qpb + offs_n, mask=n_ok, other=-1)
        allowed = (j >= 0)[None, :] & row_ok[:, None]
        if CAUSAL:
            allowed = allowed & (j[None, :] <= p[:, None])
        if HAS_WINDOW:
            allowed = allowed & (p[:, None] - j[None, :] < window) & (j[None, :] - p[:, None] < window)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(bk + offs_n[:, None] * s_bkq + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(bv + offs_n[:, None] * s_bvq + offs_d[None, :], mask=kv_mask, other=0.0)
        acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k, v, allowed, qk_scale, DOT_PREC, DOT_F32)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row that saw nothing: output 0, not NaN
    out = acc / l_safe[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    if DIRECT:
        o_ptr = O + b * s_ob + hq[:, None] * s_oh + qi[:, None] * s_oq + offs_d[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=mask)
    else:
        prow = pid_s.to(tl.int64) * n_rows + (b * HQ + hq) * NQ + qi  # [BLOCK_M] partial row
        tl.store(PO + prow[:, None] * D + offs_d[None, :], out.to(PO.dtype.element_ty), mask=mask)
        lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(PLSE + prow, lse2, mask=row_ok)


@triton.jit(do_not_specialize=["n_rows"])
def _drafter_combine_kernel(
    PO, PLSE, O, NQ, HQ, num_splits, n_rows, s_ob, s_oh, s_oq,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One output row (b, hq, i): the log-sum-exp merge of its num_splits partials."""
    row = tl.program_id(0)
    qi = row % NQ
    hq = (row // NQ) % HQ
    b = (row // (NQ * HQ)).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s_ok = s0 + offs_s < num_splits
        prow = (s0 + offs_s).to(tl.int64) * n_rows + row
        lse = tl.load(PLSE + prow, mask=s_ok, other=float("-inf"))
        o = tl.load(PO + prow[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        m_new = tl.maximum(m_run, tl.max(lse, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse - m_use)  # [BLOCK_S]
        alpha = tl.exp2(m_run - m_use)
        l_run = l_run * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m_run = m_new
    l_safe = tl.where(l_run == 0.0, 1.0, l_run)
    o_ptr = O + b * s_ob + hq * s_oh + qi * s_oq + offs_d
    tl.store(o_ptr, (acc / l_safe).to(O.dtype.element_ty), mask=d_ok)


def _check_inputs(q, ctx_k, ctx_v, blk_k, blk_v, ctx_pos, q_pos) -> None:
    b, hq, nq, d = q.shape
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), q.dtype
    for t in (ctx_k, ctx_v, blk_k, blk_v):
        assert t.dtype == q.dtype, (t.dtype, q.dtype)
        assert t.dim() == 4 and t.stride(3) == 1, (t.shape, t.stride())
    assert q.stride(3) == 1, "q's last dim must be contiguous"
    hkv, length = ctx_k.shape[1], ctx_k.shape[2]
    assert hq % hkv == 0, (hq, hkv)
    assert ctx_k.shape == ctx_v.shape == (b, hkv, length, d), (ctx_k.shape, ctx_v.shape)
    assert blk_k.shape == blk_v.shape == (b, hkv, nq, d), (blk_k.shape, blk_v.shape)
    assert ctx_pos.shape == (b, length) and q_pos.shape == (b, nq), (ctx_pos.shape, q_pos.shape)
    for t in (ctx_pos, q_pos):
        assert t.dtype in (torch.int64, torch.int32) and (t.shape[1] <= 1 or t.stride(1) == 1)
    devs = {t.device for t in (q, ctx_k, ctx_v, blk_k, blk_v, ctx_pos, q_pos)}
    assert len(devs) == 1, devs


def drafter_attention_triton(q, ctx_k, ctx_v, blk_k, blk_v, ctx_pos, q_pos, causal, window, scale,
                             *, tiles: TileConfig | None = None, num_splits: int | None = None):
    """Triton twin of `drafter_attention_torch`.

    out[b, h, i] = sum_s softmax_s(scale * q[b, h, i] . K[s]) V[s] over the keys s that block
    row i (position p = q_pos[b, i]) sees, K/V of query head h being those of kv head
    h // (Hq / Hkv): context slot s (position j = ctx_pos[b, s]) iff j >= 0 and, with a
    window W, |p - j| < W; block key t (position j = q_pos[b, t]) iff j >= 0, j <= p when
    causal, and |p - j| < W with a window.

    Shapes/dtypes: q [B, Hq, Q, D]; ctx_k, ctx_v [B, Hkv, L, D]; blk_k, blk_v [B, Hkv, Q, D];
    all one dtype (fp32/bf16/fp16), last dim contiguous, any other strides (L may be 0).
    ctx_pos [B, L], q_pos [B, Q] int64/int32, last dim contiguous. Context rows at position
    -1 are never read (NaN there is harmless). window: int or None; causal: bool.
    Returns out [B, Hq, Q, D] in q.dtype: a transposed view of a contiguous [B, Q, Hq, D]
    buffer, so the caller's o.transpose(1, 2).flatten(2) costs no copy.
    Work split: grid (splits, Hkv x M tiles, B), M = G x Q rows (row = g * Q + i, head
    hkv * G + g); partials [splits, B x Hq x Q, D] (q.dtype) + [splits, B x Hq x Q] fp32 (log2)
    merged by a combine kernel with grid (B x Hq x Q,). `tiles` / `num_splits` override the
    tile table and the split plan (tests, benchmarks).
    """
    _check_inputs(q, ctx_k, ctx_v, blk_k, blk_v, ctx_pos, q_pos)
    b, hq, nq, d = q.shape
    hkv, length = ctx_k.shape[1], ctx_k.shape[2]
    groups, m_rows = hq // hkv, hq // hkv * nq
    cfg, m_tiles, splits, chunk = launch_plan(q, ctx_k, tiles, num_splits)
    direct = splits == 1
    out = torch.empty(b, nq, hq, d, device=q.device, dtype=q.dtype).transpose(1, 2)
    n_rows = b * hq * nq
    if direct:
        po, plse = out, out  # unused
    else:
        # half inputs: half partials (normalised, bounded by max|V|; half the traffic)
        po = torch.empty(splits, n_rows, d, device=q.device, dtype=q.dtype)
        plse = torch.empty(splits, n_rows, device=q.device, dtype=torch.float32)
    if length == 0:  # an empty context is never read; any valid pointer will do
        ctx_k, ctx_v = blk_k, blk_v
    block_d = max(16, triton.next_power_of_2(d))
    fp32 = q.dtype == torch.float32
    _drafter_attn_kernel[(splits, hkv * m_tiles, b)](
        q, ctx_k, ctx_v, blk_k, blk_v, ctx_pos, q_pos, out, po, plse,
        float(scale) * LOG2E, length, nq, hq, groups, m_rows, m_tiles, chunk, splits, n_rows,
        0 if window is None else int(window),
        q.stride(0), q.stride(1), q.stride(2),
        ctx_k.stride(0), ctx_k.stride(1), ctx_k.stride(2),
        ctx_v.stride(0), ctx_v.stride(1), ctx_v.stride(2),
        blk_k.stride(0), blk_k.stride(1), blk_k.stride(2),
        blk_v.stride(0), blk_v.stride(1), blk_v.stride(2),
        ctx_pos.stride(0), q_pos.stride(0), out.stride(0), out.stride(1), out.stride(2),
        D=d, CAUSAL=bool(causal), HAS_WINDOW=window is not None, DIRECT=direct,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        DOT_PREC="ieee" if fp32 or _interpreting() else "tf32", DOT_F32=_interpreting(),
        PRED_LOADS=cfg.pred_loads, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not direct:
        _drafter_combine_kernel[(n_rows,)](
            po, plse, out, nq, hq, splits, n_rows, out.stride(0), out.stride(1), out.stride(2),
            D=d, BLOCK_S=min(32, triton.next_power_of_2(splits)), BLOCK_D=block_d, num_warps=4,
        )
    return out


def kv_bytes(hkv: int, length: int, d: int, elem_bytes: int) -> int:
    """Bytes the call must read at least: the context K and V once."""
    return 2 * hkv * length * d * elem_bytes


__all__ = ["TileConfig", "drafter_attention_triton", "kv_bytes", "launch_plan", "pick_tiles", "plan_splits"]
