"""The tree build's top-k of the drafter's log-probs (speculative/build.py) in one Triton launch.

`torch.log_softmax(logits.float(), -1).topk(k, -1)` over the drafter's [B, D, V] block logits
costs ~31 us a step on an H200 for [1, 15, 4096] (torch's topk is a single-block radix select
per row) plus two log_softmax kernels and the float cast. Here one program per row:

- loads the row once (V padded to a power of two, padding = -inf), in float32;
- m = max x, s = sum exp(x - m), lp = (x - m) - log s (the GPU's exp/log differ from
  torch's by an ulp or so, which moves a row's values by a few float32 ulps of |lse|);
- one int64 key per lane: the logit's order-preserving bits, then the index reversed
  (`tree_build._order_key`), so a descending top-k of the keys (all distinct: the order is
  fully determined) gives logit descending, then index ascending; padding lanes get
  INT64_MIN, below every real key (-inf included), and are never selected while k <= V;
- the top 2**ceil(log2 k) keys by tl.topk's bitonic top-k (`_topk_desc`, sum-based
  compare-and-swap, see there); the first k are stored.

Selecting on the logit and not on lp keeps the choice independent of exp/log rounding, so
the kernel and the torch twin (`reference.topk_logprobs`) pick the same tokens exactly;
lp = x - const is monotone, so the values still come out descending. Logits must not be NaN.

Cost (H200, 2026-12-03, `check_fused`, under a CUDA graph): 15.6 us for [1, 15, 4096] k = 31 at
8 warps against torch's 31.5 us (2.3 us at k = 1, 24.9 at k = 127); other warp counts 13.7-18 us
(benchmarks/tune_topk.py). The sm_90 compile: V = 4096, k = 31, 8 warps, 64 registers, no spills.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from treeflash.kernels.tree_build import _key_score, _order_key, _topk_desc  # noqa: E402

MAX_VOCAB = 16384  # one row in registers: 16k int64 keys over 16 warps = 64 registers a thread
MAX_K = 128


def supported(logits: torch.Tensor, k: int) -> bool:
    """Whether `topk_logprobs_triton` applies: a CUDA tensor (or a CPU one under the Triton
    interpreter), a float dtype, 1 <= k <= min(V, 128), V <= 16384, rows contiguous."""
    on_device = logits.is_cuda or (logits.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    v = logits.shape[-1] if logits.dim() else 0
    return (on_device and logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and 1 <= v <= MAX_VOCAB and 1 <= k <= min(v, MAX_K) and logits.stride(-1) == 1)


@triton.jit
def _topk_lp_kernel(X, O_LP, O_TOK, V, K, s_row,
                    BV: tl.constexpr, KB: tl.constexpr, LOG_V: tl.constexpr, LOG_K: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BV)
    inb = offs < V
    x = tl.load(X + r * s_row + offs, mask=inb, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    log_s = tl.log(tl.sum(tl.exp(x - m), axis=0))  # padding: exp(-inf) = 0
    key = tl.where(inb, _order_key(x, offs, BV), -9223372036854775807 - 1)
    if KB == 1:  # the chain (dflash): the maximum key
        top = tl.max(key, axis=0, keep_dims=True)
    else:
        top = _topk_desc(key, LOG_V, LOG_K)  # [KB] descending: logit desc, index asc
    tok = (BV - 1) - (top & 0xFFFFFFFF).to(tl.int32)
    lp = (_key_score(top) - m) - log_s  # the key keeps the logit's bits (-0.0 read as +0.0)
    j = tl.arange(0, KB)
    tl.store(O_LP + r * K + j, lp, mask=j < K)
    tl.store(O_TOK + r * K + j, tok.to(tl.int64), mask=j < K)


def _num_warps(bv: int) -> int:
    # 16 keys a thread (32 registers of keys): V = 4096 at 8 warps compiles to 64 registers,
    # no spills; 4 warps need 126 registers and 1.7x the instructions a warp, 16 warps 0.6x the
    # instructions a warp but 1.2x the issue slots an SM. H200 (benchmarks/tune_topk.py, [1, 15,
    # 4096] k = 31): 4 / 8 / 16 / 32 warps 18.1 / 15.4 / 15.1 / 13.7 us: within ~2 us, 8 kept.
    # V = 16384, k = 128 at 16 warps: 128 registers and 80 bytes of spills.
    return max(4, min(16, bv // 512))


def topk_logprobs_triton(logits: torch.Tensor, k: int, num_warps: int | None = None):
    """See `treeflash.kernels.topk_logprobs`. logits [..., V] with V <= 16384, 1 <= k <= 128.
    num_warps: None = `_num_warps` (benchmarks/tune_topk.py times the others)."""
    if not supported(logits, k):
        raise ValueError(f"topk_logprobs_triton: unsupported logits {list(logits.shape)} "
                         f"{logits.dtype} on {logits.device} (stride {logits.stride()}) with k={k}")
    v = logits.shape[-1]
    rows = logits.reshape(-1, v)  # [R, V]; a view when the leading dims flatten
    r = rows.shape[0]
    top_lp = torch.empty(r, k, dtype=torch.float32, device=logits.device)
    top_tok = torch.empty(r, k, dtype=torch.long, device=logits.device)
    if r:
        bv, kb = max(16, triton.next_power_of_2(v)), triton.next_power_of_2(k)
        _topk_lp_kernel[(r,)](rows, top_lp, top_tok, v, k, rows.stride(0),
                              BV=bv, KB=kb, LOG_V=bv.bit_length() - 1,
                              LOG_K=kb.bit_length() - 1, num_warps=num_warps or _num_warps(bv))
    shape = (*logits.shape[:-1], k)
    return top_lp.view(shape), top_tok.view(shape)
