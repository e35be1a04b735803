"""MLA verify attention in Triton: every (node, head) row of a request against its paged latent cache.

One entry point (`mla_verify_attention_triton`) serves plain decode (N = 1), chain and tree
verify (N = 16..256) and chunked prefill (N up to 2048, causal chain). Every implementation
shares the design that the two floors ask for (bytes = L x D x 2 per layer, flops =
2 x N x H x L x (D + v_dim)):

- heads x nodes are folded into M rows (row = n * H + h), so a latent row is read once for
  a whole M tile, not once per head;
- the keys 0 .. prefix_len + N - 1 are cut into splits spread over the SMs (flash-decoding,
  `plan.py`); each split writes a normalised partial (O, LSE) and `combine.py` merges them by
  log-sum-exp; one split writes the output directly and no combine runs;
- inside a split the prefix runs unmasked (every row sees the whole prefix) and the N rows'
  own latents run with the ancestor mask (or j <= i for a causal chain);
- the values are the first v_dim columns of the same latent rows, so one K tile load serves
  both products.

The family: `plan.py` (a call's tile and split plan), `combine.py` (the partials' merge),
`hopper.py` (the Gluon warp-specialised kernel, sm_90; `hopper_fp8.py` its form over fp8_e4m3
rows), `portable.py` (the Triton `tl` kernels that run elsewhere), `gathered.py` (the fp32 /
gathered-rows kernel and the building blocks it shares). Every implementation reads a cache of
16-bit values or of fp8_e4m3 rows (`kvcache.format`), the latter decoded inside its tiles.
Which one runs is `TABLE` below; `benchmarks/DESIGN_NOTES.md` section 1 has the measurements
behind it. TREEFLASH_VERIFY_KERNEL=portable runs the table without its Hopper rows (for a bug
report: does the Hopper kernel cause it?).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from treeflash import knobs

# `impl="triton"` on CPU tensors runs under the Triton interpreter; the flag must be set
# before any @triton.jit decorator of the package runs (the submodules import below).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from treeflash.kernels.mla_verify import combine, gathered, portable  # noqa: E402
from treeflash.kernels.mla_verify.plan import (  # noqa: E402
    Call,
    KernelConfig,
    interpreting,
    num_sms,
    plan_splits,
    plan_splits_waves,
    split_plan,
)
from treeflash.kvcache.format import check_fp8_rows, is_fp8_rows  # noqa: E402

LOG2E = 1.4426950408889634
HOPPER, PORTABLE, PORTABLE_TREE, GATHERED = "hopper", "portable", "portable_tree", "gathered"
IMPLS = (HOPPER, PORTABLE, PORTABLE_TREE, GATHERED)
ANY = None


@dataclass(frozen=True)
class Rule:
    """A row of `TABLE`: `impl` runs a call when every condition holds (ANY: not checked)."""

    impl: str
    dtype: str | None  # the cache's: "fp32", "16-bit" (bf16 / fp16) or "fp8" (fp8_e4m3 rows with
    # 16-bit q; `kvcache.format`); a call with fp32 q is "fp32" whatever its cache
    head: tuple[int, int] | None  # (D, v_dim)
    page: str | None  # "whole": page_size % the impl's BLOCK_N == 0 (None: whole tiles);
    # "gathers": the portable kernel's tile does not fit a page (it would gather rows)
    gpu: str | None  # "sm_90": an sm_90 GPU with Gluon (`hopper.available`)
    rows: int | None  # M = N x H must exceed this
    nodes: int | None  # N at most this (None given: a verify tree)
    plan: str  # "waves": `plan_splits_waves`; "even": `plan_splits`


# The dispatch rule: the first row whose conditions all hold names the implementation; its tile
# is `TILES`. The Hopper kernel also needs q in the cache's dtype, a TMA-addressable cache and
# sm_scale > 0 (`hopper.supported`); a call without them runs the table without that row. The
# portable tree kernel needs value halves of >= 16 columns: below v_dim 32 it runs the portable
# kernel on its own tile (`portable.launch_tree`). Measured on the H200 (DESIGN_NOTES.md 1.1-1.2):
# the Hopper kernel 1.2-1.4x the portable tree kernel, itself 1.3-1.6x the portable kernel's
# 64-row tile above 16 rows (2026-12-02/03); at page 1 the gathered kernel beats the portable
# kernel's gathered tiles from 64 rows (0.31 vs 0.25 of the floor at 64 x 16, 64k).
# fp8_e4m3 rows (`hopper_fp8.py`; not yet timed, benchmarks/notes/fp8-kv.md): the Hopper kernel
# above 16 rows; at most 16 rows the portable kernel's 16-row tile, whose MMA covers 16 rows
# where the Hopper kernel's 64-row tile spends ~2200 tensor clk a 64-key tile, more than an
# fp8 tile's bytes take on an H200 (~1.3 us).
TABLE = (
    #    implementation  cache dtype  D, v_dim     page size   GPU      rows M >  nodes N <=  split plan
    Rule(GATHERED,       "fp32",      ANY,         ANY,        ANY,     ANY,      ANY,        "even"),
    Rule(HOPPER,         "16-bit",    (576, 512),  "whole",    "sm_90", ANY,      ANY,        "waves"),
    Rule(HOPPER,         "fp8",       (576, 512),  "whole",    "sm_90", 16,       ANY,        "waves"),
    Rule(PORTABLE_TREE,  ANY,         ANY,         "whole",    ANY,     16,       256,        "waves"),
    Rule(GATHERED,       ANY,         ANY,         "gathers",  ANY,     16,       ANY,        "waves"),
    Rule(PORTABLE,       ANY,         ANY,         ANY,        ANY,     ANY,      ANY,        "waves"),
)

# Tiles on a GPU in 16-bit, (block_m, block_n, warps, stages, TMA) for M <= 16 rows and above;
# fp32 runs 16 x 32 x 4 warps x 1 stage and the interpreter 16 x 16 x 4 x 1 (no TMA) everywhere.
# The portable kernel's tiles are the spill-free ones of its sm_90 compile report: 16 x 64 x 8 x 5
# holds two 72 KB tiles in flight, 64 x 32 x 8 x 5 (TMA) is the only 64-row tile whose main loop
# has no spill traffic; the tree kernel's 64 x 64 x 8 x 4 holds two in 224 KB
# (`treeflash bench kernel --compile-report`, `cpu-20261202-compile-reports`).
TILES = {
    #                M <= 16                 M > 16
    HOPPER:         ((64, 64, 4, 1, True),  (64, 64, 4, 1, True)),
    PORTABLE_TREE:  ((64, 64, 8, 4, True),  (64, 64, 8, 4, True)),
    PORTABLE:       ((16, 64, 8, 5, False), (64, 32, 8, 5, True)),
    GATHERED:       ((64, 64, 8, 2, False), (64, 64, 8, 2, False)),
}


def tile(impl: str, rows: int, dtype: torch.dtype, gpu: str, split_plan: str = "waves") -> KernelConfig:
    """`impl`'s tile for `rows` = N x H rows of a `dtype` cache on `gpu` ("sm_90", "gpu" or
    "interpreter"; `gpu_kind`), with the split plan `split_plan` ("waves" or "even")."""
    waves = split_plan == "waves"
    if gpu == "interpreter":
        return KernelConfig(impl, 16, 16, 4, 1, wave_plan=waves)
    if dtype == torch.float32:
        return KernelConfig(impl, 16, 32, 4, 1, wave_plan=waves)
    bm, bn, warps, stages, tma = TILES[impl][rows > 16]
    return KernelConfig(impl, bm, bn, warps, stages, tma=tma, wave_plan=waves)


def gpu_kind(device: torch.device) -> str:
    """"sm_90" (where the Hopper kernel can run), "gpu" (another CUDA GPU) or "interpreter"
    (CPU tensors, or TRITON_INTERPRET set)."""
    if device.type != "cuda" or interpreting():
        return "interpreter"
    from treeflash.kernels.mla_verify import hopper  # Gluon: imported on a GPU only

    return "sm_90" if hopper.available(device) else "gpu"


def dispatch(rows: int, dtype: torch.dtype, gpu: str, page_size: int | None = None,
             nodes: int | None = None, head: tuple[int, int] = (576, 512),
             hopper: bool = True) -> KernelConfig:
    """The first row of `TABLE` that holds for a call of `rows` = N x H rows and `nodes` = N
    new rows a request over a `dtype` cache (torch.uint8: fp8_e4m3 rows) of `page_size` (None:
    whole tiles) with `head` = (D, v_dim) on `gpu` (`gpu_kind`), with its tile. `hopper` False,
    or TREEFLASH_VERIFY_KERNEL=portable (any other value than auto is a ValueError): the table
    without the Hopper rows."""
    if knobs.get("TREEFLASH_VERIFY_KERNEL") == "portable":
        hopper = False
    for rule in TABLE:
        if (rule.impl != HOPPER or hopper) and _holds(rule, rows, dtype, gpu, page_size, nodes, head):
            return tile(rule.impl, rows, dtype, gpu, rule.plan)
    raise AssertionError("the last row of TABLE holds for every call")


def _holds(rule: Rule, rows, dtype, gpu, page_size, nodes, head) -> bool:
    dtype_class = "fp32" if dtype == torch.float32 else "fp8" if dtype == torch.uint8 else "16-bit"
    return ((rule.dtype is ANY or rule.dtype == dtype_class)
            and (rule.head is ANY or rule.head == head)
            and (rule.page is ANY or _page_holds(rule, rows, dtype, gpu, page_size))
            and (rule.gpu is ANY or rule.gpu == gpu)
            and (rule.rows is ANY or rows > rule.rows)
            and (rule.nodes is ANY or nodes is None or nodes <= rule.nodes))


def _page_holds(rule: Rule, rows, dtype, gpu, page_size) -> bool:
    if rule.page == "whole":
        return page_size is None or page_size % tile(rule.impl, rows, dtype, gpu).block_n == 0
    assert rule.page == "gathers", rule.page
    return page_size is not None and page_size % tile(PORTABLE, rows, dtype, gpu).block_n != 0


def _check_inputs(q, kv_cache, page_table, prefix_lens, tree_mask, v_dim):
    b, n, h, d = q.shape
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), q.dtype
    assert kv_cache.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.uint8), kv_cache.dtype
    assert 0 < v_dim <= d, (v_dim, d)
    if is_fp8_rows(kv_cache):  # fp8_e4m3 rows: [pages, page_size, row_bytes] (kvcache.format)
        assert kv_cache.dim() == 3, kv_cache.shape
        check_fp8_rows(kv_cache, d, v_dim)
    else:
        assert kv_cache.dim() == 3 and kv_cache.shape[2] == d, (kv_cache.shape, q.shape)
    assert q.stride(3) == 1 and kv_cache.stride(2) == 1, "last dim must be contiguous"
    assert page_table.dtype == torch.int32 and page_table.dim() == 2 and page_table.shape[0] == b
    assert page_table.stride(1) == 1
    assert prefix_lens.dtype == torch.int32 and prefix_lens.shape == (b,)
    assert prefix_lens.is_contiguous()
    if tree_mask is not None:
        assert tree_mask.shape == (b, n, n) and tree_mask.dtype == torch.bool, tree_mask.shape
    devs = {t.device for t in (q, kv_cache, page_table, prefix_lens)}
    assert len(devs) == 1, devs


def _hopper_supported(q, kv_cache, v_dim, sm_scale) -> bool:
    if gpu_kind(q.device) != "sm_90":
        return False
    if is_fp8_rows(kv_cache):
        from treeflash.kernels.mla_verify import hopper_fp8

        return hopper_fp8.supported(q, kv_cache, v_dim, sm_scale)
    from treeflash.kernels.mla_verify import hopper

    return hopper.supported(q, kv_cache, v_dim, sm_scale)


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
    V = row[:v_dim]), or fp8_e4m3 rows [num_pages, page_size, row_bytes] uint8 (`kvcache.format`,
    decoded in the tile to q's dtype: no 16-bit copy of the cache); position p of request b
    lives at kv_cache[page_table[b, p // page_size], p % page_size]; page_table [B, max_pages]
    int32 (entries past a request's pages are never read); prefix_lens [B] int32; tree_mask [B, N, N] bool or None.
    Returns out [B, N, H, v_dim] (q.dtype, contiguous) and lse [B, N, H] float32.
    Work split: grid (M tiles, splits, B) with M = N x H rows (row = n * H + h); partials
    [B, M, splits, v_dim] in `partial_dtype` (default: fp32 for fp32 q, else q.dtype) and
    [B, M, splits] fp32 (log2) are merged by the combine kernel (`combine.py`).
    Implementation, tile and split plan: `dispatch` (the table `TABLE`); `config` /
    `num_splits` override them (tests, benchmarks). A Hopper config the call does not suit
    runs the table without the Hopper row.
    """
    _check_inputs(q, kv_cache, page_table, prefix_lens, tree_mask, v_dim)
    b, n, h, d = q.shape
    m_rows = n * h
    gpu = gpu_kind(q.device)
    dtype = torch.float32 if q.dtype == torch.float32 else kv_cache.dtype  # fp32 q: the fp32 row
    facts = (m_rows, dtype, gpu, kv_cache.shape[1], n, (d, v_dim))
    cfg = config or dispatch(*facts)
    if cfg.impl == HOPPER and not _hopper_supported(q, kv_cache, v_dim, sm_scale):
        cfg = dispatch(*facts, hopper=False)
    sms = num_sms(q.device.index or 0) if gpu != "interpreter" else 4
    splits, chunk = split_plan(cfg, b, m_rows, page_table.shape[1] * kv_cache.shape[1], sms,
                               num_splits, v_dim, d)
    call = _call(q, kv_cache, page_table, prefix_lens, tree_mask, sm_scale, v_dim, splits, chunk,
                 partial_dtype)
    _launch_split(call, cfg)
    if not call.direct:
        combine.launch(call, cfg, sms)
    return call.out, call.lse


def _call(q, kv_cache, page_table, prefix_lens, tree_mask, sm_scale, v_dim, splits, chunk,
          partial_dtype) -> Call:
    """The outputs and partials of a call, allocated, with its sizes (`plan.Call`)."""
    b, n, h, d = q.shape
    m_rows, direct = n * h, splits == 1
    if partial_dtype is None:  # half inputs: half partials (bounded by max|V|; half the traffic)
        partial_dtype = torch.float32 if q.dtype == torch.float32 else q.dtype
    out = torch.empty(b, n, h, v_dim, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, n, h, device=q.device, dtype=torch.float32)
    if direct:
        po, plse = out, lse  # unused
    else:  # split-minor: a row's partials are adjacent (combine.py)
        po = torch.empty(b, m_rows, splits, v_dim, device=q.device, dtype=partial_dtype)
        plse = torch.empty(b, m_rows, splits, device=q.device, dtype=torch.float32)
    tm = q if tree_mask is None else tree_mask.contiguous().view(torch.uint8)
    return Call(q, kv_cache, page_table, prefix_lens, tree_mask, tm, out, lse, po, plse,
                float(sm_scale) * LOG2E, h, n, m_rows, v_dim, d, chunk, splits, direct,
                block_v=max(16, triton.next_power_of_2(v_dim)),
                block_r=max(16, triton.next_power_of_2(max(d - v_dim, 1))))


def _launch_split(call: Call, cfg: KernelConfig) -> None:
    """The split kernel of `cfg.impl`."""
    if cfg.impl == HOPPER and is_fp8_rows(call.kv_cache):
        from treeflash.kernels.mla_verify import hopper_fp8

        hopper_fp8.launch(call)
    elif cfg.impl == HOPPER:
        from treeflash.kernels.mla_verify import hopper

        hopper.launch(call)
    elif cfg.impl == PORTABLE_TREE:
        portable.launch_tree(call, cfg)
    elif cfg.impl == PORTABLE:
        portable.launch(call, cfg)
    elif cfg.impl == GATHERED:
        gathered.launch(call, cfg)
    else:
        raise ValueError(f"unknown verify kernel {cfg.impl!r}; expected one of {', '.join(IMPLS)}")


__all__ = ["GATHERED", "HOPPER", "IMPLS", "PORTABLE", "PORTABLE_TREE", "TABLE", "TILES", "KernelConfig",
           "dispatch", "gpu_kind", "mla_verify_attention_triton", "num_sms", "plan_splits", "plan_splits_waves",
           "split_plan", "tile"]
