"""A verify call's plan: its tile (`KernelConfig`) and how its keys are cut into splits.

The host plans from sizes it knows (the page table's width), so planning never syncs and a CUDA
graph can capture the call; on the device each request then cuts its own keys over the planned
splits (`fit_chunk`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class KernelConfig:
    """Which implementation runs a call (`IMPLS` in the package) with which tile: BLOCK_M query
    rows x BLOCK_N keys a step, its warps and pipeline stages. `tma`: full tiles through TMA
    descriptors where the layout allows (the portable kernels; the Hopper kernel always).
    `wave_plan`: the wave-aware split plan (`plan_splits_waves`), else the even one (`plan_splits`)."""

    impl: str
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    wave_plan: bool = True


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=8)
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_plan(cfg: KernelConfig, batch: int, m_rows: int, capacity: int, sms: int,
         num_splits: int | None = None, v_dim: int = 512, d: int = 576) -> tuple[int, int]:
    """(num_splits, chunk) of a call: the wave-aware plan for `cfg.wave_plan` unless `num_splits`
    is given, else the even plan (which also cuts a given count into whole tiles)."""
    if cfg.wave_plan and num_splits is None:
        return plan_splits_waves(batch, m_rows, capacity, cfg.block_m, cfg.block_n, sms, v_dim, d)
    return plan_splits(batch, m_rows, capacity, cfg, sms, num_splits)


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
def plan_splits_waves(batch: int, m_rows: int, capacity: int, block_m: int, block_n: int,
                      slots: int, v_dim: int = 512, d: int = 576,
                      fill_gain: float = 0.99) -> tuple[int, int]:
    """(num_splits, chunk) minimising a wave model of the kernel's time.

    Time ~ waves x (tiles per split + 2 tiles of fixed cost) + the combine's partial traffic,
    with waves = ceil(batch x M tiles x splits / slots) and slots = the SMs.
    The even plan asks for ceil(SMs / M tiles) splits, which for 16 M tiles gives 9 x 16 = 144
    programs on 132 SMs: two waves, the second 9% full (about half the time lost).
    More splits are taken only for a >= 3% modelled gain (partials cost more than modelled
    on compute-bound shapes), or for a >= 1% gain (`fill_gain`) when they fill SMs the same
    number of waves left idle: 8 heads x 32 nodes at 256k ran 4 M tiles x 32 splits = 128
    programs on 132 SMs (33 splits: 125 tiles a program instead of 128, -2.3%, modelled 0.977).
    Chunks stay >= 2 tiles; `capacity` is host-known (no sync, graph-capturable).
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
def fit_chunk(total, num_splits, BLOCK_N: tl.constexpr):
    """This request's split length: its own keys (prefix + N) over the planned splits, in
    whole tiles. The host plans the splits on the page table's width (host-known, no sync),
    which a CUDA graph's power-of-two bucket makes up to twice the keys; cutting the planned
    `chunk` instead left half the programs idle and the others with twice the tiles (H200,
    2026-12-02: a 4-layer ddtree verify graph at 256k grew 0.94 ms a layer over 1k where the
    eager kernel took 0.49 ms). Never more than the planned chunk, so the partials fit."""
    return tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N


@dataclass(frozen=True)
class Call:
    """One call as every implementation's launcher takes it: the inputs, the outputs, the split
    partials and the sizes the package's entry point derived (`mla_verify_attention_triton`).

    q [B, N, H, D]; kv_cache [pages, page_size, D]; page_table [B, max_pages] int32; prefix_lens
    [B] int32; tree_mask [B, N, N] bool or None (causal); `tm`: the mask's bytes (uint8 view), or
    q standing in for the pointer a causal call never reads. out [B, N, H, v_dim], lse [B, N, H];
    po [B, M, splits, v_dim] and plse [B, M, splits] (the outputs again where `direct`: one
    split writes the output itself). qk_scale: the softmax scale times log2(e). M = N x H rows
    (row = n * H + h); `chunk`: the planned keys a split; block_v / block_r: the value and rope
    column blocks (powers of two >= 16)."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    page_table: torch.Tensor
    prefix_lens: torch.Tensor
    tree_mask: torch.Tensor | None
    tm: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    po: torch.Tensor
    plse: torch.Tensor
    qk_scale: float
    h: int
    n: int
    m_rows: int
    v_dim: int
    d: int
    chunk: int
    splits: int
    direct: bool
    block_v: int
    block_r: int

    def mask_strides(self) -> tuple[int, int]:
        """(s_tb, s_tn) of the contiguous [B, N, N] mask; (0, 0) for a causal call."""
        return (0, 0) if self.tree_mask is None else (self.n * self.n, self.n)

    def out_strides(self) -> tuple[int, ...]:
        """s_ob, s_on, s_oh, s_lb, s_ln: the output's and the LSE's strides."""
        return (self.out.stride(0), self.out.stride(1), self.out.stride(2), self.lse.stride(0),
                self.lse.stride(1))


def split_grid(call: Call, block_m: int) -> tuple[int, int, int]:
    """The split kernels' grid: (M tiles, splits, B)."""
    return (triton.cdiv(call.m_rows, block_m), call.splits, call.q.shape[0])
