"""The verify kernel's combine: the splits' partials of a row merged by log-sum-exp.

Each split of a call writes a normalised partial (O, log2 LSE) per row; when a call has more
than one split, this kernel merges them into the output. Partials are split-minor ([B, M,
splits, v_dim]) so a row's splits are adjacent (a7f6384: -0.5 us a call at 64k,
`h200-20261204-split-minor`). Its tiles depend on the split kernel that ran (`tiles`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from treeflash.kernels.mla_verify.plan import Call, KernelConfig, fit_chunk


@triton.jit
def _combine_kernel(
    PO, PLSE, PL, O, LSE, H, N, M, v_dim, num_splits,
    s_ob, s_on, s_oh, s_lb, s_ln,
    BLOCK_S: tl.constexpr, BLOCK_VC: tl.constexpr, BLOCK_N: tl.constexpr,
    ALL_SPLITS: tl.constexpr = False,
):
    """Grid (M, v_dim / BLOCK_VC, B): row `row` of request b, value columns pid_v * BLOCK_VC ..,
    merged over its splits by log-sum-exp (partials [B, M, splits, v_dim], LSE in log2 units)
    into out and the natural-log lse. ALL_SPLITS (after the Hopper kernel): every split slot
    holds a partial, empty ones (LSE -inf, values 0) included, so a row reads all num_splits of
    them and the first loads do not wait for prefix_lens (the same sums: an empty split weighs
    exactly 0); otherwise only the splits that ran for this request (`fit_chunk`)."""
    row = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = tl.program_id(2)
    if ALL_SPLITS:
        n_valid = num_splits
    else:
        total = tl.load(PL + b) + N
        n_valid = tl.minimum(tl.cdiv(total, fit_chunk(total, num_splits, BLOCK_N)), num_splits)
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


def tiles(impl: str, splits: int, block_v: int, rows: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_S, BLOCK_VC, num_warps) of the combine after `impl`'s split kernel over `rows`
    = B x M rows: the gathered kernel's 64 splits x 64 columns a step; the portable kernels'
    one pass over up to 256 splits (32 columns under 64 rows, so small calls still get ~128
    programs); after the Hopper kernel `hopper_tiles`."""
    if impl == "hopper":
        return hopper_tiles(splits, block_v, rows, sms)
    if impl == "gathered":
        return min(64, triton.next_power_of_2(splits)), min(64, block_v), 4
    return min(256, triton.next_power_of_2(splits)), min(32 if rows < 64 else 64, block_v), 4


def hopper_tiles(splits: int, block_v: int, rows: int, sms: int) -> tuple[int, int, int]:
    """The combine's (BLOCK_S, BLOCK_VC, num_warps) after the Hopper kernel. The combine reads
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


def launch(call: Call, cfg: KernelConfig, sms: int) -> None:
    """Merge `call`'s partials (po, plse) into its out and lse, after `cfg.impl`'s split kernel."""
    c = call
    b = c.q.shape[0]
    block_s, block_vc, warps = tiles(cfg.impl, c.splits, c.block_v, b * c.m_rows, sms)
    _combine_kernel[(c.m_rows, triton.cdiv(c.v_dim, block_vc), b)](
        c.po, c.plse, c.prefix_lens, c.out, c.lse, c.h, c.n, c.m_rows, c.v_dim, c.splits,
        *c.out_strides(), BLOCK_S=block_s, BLOCK_VC=block_vc, BLOCK_N=cfg.block_n,
        ALL_SPLITS=cfg.impl == "hopper", num_warps=warps,
    )
