"""The DCP merge in one launch: the ranks' partial attention outputs of a row merged by log-sum-exp,
read in place from the all-to-all's buffer (`models/dcp.py exchange_partials`).

The buffer is [S, rows, v + k] in the output's dtype: each rank's normalised partial, then the
float32 bits of its natural-log LSE in k = 4 / element-size columns. The math is the verify
kernel's split combine (`kernels/mla_verify/combine.py`) with the parts split-major and the LSE
inside each row, so nothing is copied or permuted first; a part that saw no key (LSE -inf, or
NaN from an empty sum) weighs nothing and its values are not read.
"""

from __future__ import annotations

import os

import torch

# on CPU tensors the kernel runs under the Triton interpreter (as `kernels/mla_verify`): the flag
# must be set before the @triton.jit below runs
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _merge_kernel(P, PL, O, LSE, V, S, p_split, p_row, l_split, l_row, l_col,
                  BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid (rows, V / BLOCK_V): row `row`'s value columns pid_v * BLOCK_V .. over its S parts."""
    row = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(PL + offs_s.to(tl.int64) * l_split + row * l_row + l_col, mask=offs_s < S,
                  other=float("-inf"))
    seen = lse > float("-inf")  # (NaN compares false)
    m = tl.max(tl.where(seen, lse, float("-inf")), 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(seen, tl.exp(lse - m_use), 0.0)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    o = tl.load(P + offs_s[:, None].to(tl.int64) * p_split + row * p_row + offs_v[None, :],
                mask=seen[:, None] & (offs_v[None, :] < V), other=0.0).to(tl.float32)
    total = tl.sum(w, 0)
    l_safe = tl.where(total == 0.0, 1.0, total)
    tl.store(O + row * V + offs_v, (tl.sum(w[:, None] * o, 0) / l_safe).to(O.dtype.element_ty), mask=offs_v < V)
    tl.store(LSE + row, tl.where(total == 0.0, float("-inf"), m_use + tl.log(l_safe)), mask=pid_v == 0)


def merge_packed_triton(packed: torch.Tensor, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """packed [S, ..., v + k] (contiguous; `models/dcp.py pack`) -> (out [..., v] in its dtype,
    lse [...] float32)."""
    s, w = packed.shape[0], packed.shape[-1]
    el = packed.element_size()
    assert packed.is_contiguous() and (v * el) % 4 == 0 and (w - v) * el == 4, (packed.shape, packed.dtype, v)
    lead = packed.shape[1:-1]
    rows = packed[0].numel() // w
    p = packed.view(s, rows, w)
    bits = p.view(torch.float32)  # [S, rows, w * el / 4]: the LSE at column v * el / 4
    out = torch.empty(rows, v, dtype=p.dtype, device=p.device)
    lse = torch.empty(rows, dtype=torch.float32, device=p.device)
    block_v = min(128, triton.next_power_of_2(v))
    _merge_kernel[(rows, triton.cdiv(v, block_v))](
        p, bits, out, lse, v, s, rows * w, w, bits.stride(0), bits.stride(1), v * el // 4,
        BLOCK_S=max(2, triton.next_power_of_2(s)), BLOCK_V=block_v, num_warps=4,
    )
    return out.view(*lead, v), lse.view(*lead)
