"""KV write and KV commit as Triton kernels: moving latent rows into and within paged KV.

`kv_write` stores the new rows' latents at their positions before verify; `kv_commit`
moves the accepted nodes' rows down into sequential positions after verify (all layers in
one launch). Both are pure copies, so they run at memory speed; the point of doing them as
kernels is one launch per step with no host sync (CUDA-graph friendly).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _slot_offset(PT, pt_row, pos, page_size, s_kp, s_ks, mask):
    page = tl.load(PT + pt_row + pos // page_size, mask=mask, other=0).to(tl.int64)
    return page * s_kp + (pos % page_size).to(tl.int64) * s_ks


@triton.jit
def _kv_write_kernel(KV, PT, START, LAT, N, D, page_size, s_kp, s_ks, s_ptb, s_lb, s_ln,
                     BLOCK_D: tl.constexpr):
    i = tl.program_id(0)  # node
    b = tl.program_id(1)
    pid_d = tl.program_id(2)
    offs = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs < D
    pos = tl.load(START + b) + i
    dst = _slot_offset(PT, b.to(tl.int64) * s_ptb, pos, page_size, s_kp, s_ks, True)
    row = tl.load(LAT + b.to(tl.int64) * s_lb + i * s_ln + offs, mask=d_ok)
    tl.store(KV + dst + offs, row.to(KV.dtype.element_ty), mask=d_ok)


@triton.jit
def _kv_commit_kernel(KV, PT, PL, ACC, NACC, M, D, page_size, s_kl, s_kp, s_ks, s_ptb, s_ab,
                      BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr):
    layer = tl.program_id(0)
    b = tl.program_id(1)
    pid_d = tl.program_id(2)
    offs = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs < D
    prefix = tl.load(PL + b)
    n_acc = tl.minimum(tl.load(NACC + b), M)
    base = KV + layer.to(tl.int64) * s_kl
    pt_row = b.to(tl.int64) * s_ptb
    # Move j <- accept_idx[j] in chunks of BLOCK_A, loading a chunk before storing it.
    # accept_idx is increasing with accept_idx[j] >= j, so a chunk never reads a row an
    # earlier chunk wrote, and a row it overwrites was read before the barrier.
    for j0 in range(0, n_acc, BLOCK_A):
        j = j0 + tl.arange(0, BLOCK_A)
        ok = j < n_acc
        src_node = tl.load(ACC + b.to(tl.int64) * s_ab + j, mask=ok, other=0)
        src = _slot_offset(PT, pt_row, prefix + src_node, page_size, s_kp, s_ks, ok)
        dst = _slot_offset(PT, pt_row, prefix + j, page_size, s_kp, s_ks, ok)
        mask = ok[:, None] & d_ok[None, :]
        rows = tl.load(base + src[:, None] + offs[None, :], mask=mask)
        tl.debug_barrier()
        tl.store(base + dst[:, None] + offs[None, :], rows, mask=mask & (src != dst)[:, None])
        tl.debug_barrier()


def kv_write_triton(kv_cache, page_table, start_lens, latents):
    """Store latents [B, N, D] at positions start_lens[b] .. start_lens[b] + N - 1 (in place).

    kv_cache [num_pages, page_size, D] (last dim contiguous); position p of request b is
    kv_cache[page_table[b, p // page_size], p % page_size]; page_table [B, max_pages] int32;
    start_lens [B] int32. Latents are cast to the cache dtype. Grid (N, B, D / BLOCK_D).
    """
    b, n, d = latents.shape
    assert kv_cache.dim() == 3 and kv_cache.shape[2] == d and kv_cache.stride(2) == 1
    assert latents.stride(2) == 1
    assert page_table.dtype == torch.int32 and page_table.shape[0] == b and page_table.stride(1) == 1
    assert start_lens.dtype == torch.int32 and start_lens.shape == (b,) and start_lens.is_contiguous()
    if n == 0:
        return
    block_d = min(1024, triton.next_power_of_2(d))
    _kv_write_kernel[(n, b, triton.cdiv(d, block_d))](
        kv_cache, page_table, start_lens, latents, n, d, kv_cache.shape[1],
        kv_cache.stride(0), kv_cache.stride(1), page_table.stride(0),
        latents.stride(0), latents.stride(1), BLOCK_D=block_d,
    )


def kv_commit_triton(kv_cache, page_table, prefix_lens, accept_idx, num_accepted):
    """After verify, move row prefix + accept_idx[b, j] to prefix + j for j < num_accepted[b].

    kv_cache [..., num_pages, page_size, D], contiguous (leading dims = layers; all layers move
    in one launch, grid (layers, B, D / BLOCK_D)); page_table [B, max_pages] int32;
    prefix_lens [B] int32; accept_idx [B, M] int32/int64, increasing, accept_idx[b, 0] = 0;
    num_accepted [B] int32/int64. In place; rows past num_accepted are left as they are.
    """
    assert kv_cache.dim() >= 3
    # Each layer contiguous; the layers may be strided (the pool's coarse view, kvcache.coarse,
    # leaves out the pages past its last whole coarse page): the layer stride is passed as it is.
    kv_cache = kv_cache if kv_cache.dim() == 4 else kv_cache.reshape(-1, *kv_cache.shape[-3:])
    assert kv_cache[0].is_contiguous()
    layers, num_pages, page_size, d = kv_cache.shape
    b, m = accept_idx.shape
    assert page_table.dtype == torch.int32 and page_table.shape[0] == b and page_table.stride(1) == 1
    assert prefix_lens.dtype == torch.int32 and prefix_lens.shape == (b,) and prefix_lens.is_contiguous()
    assert num_accepted.shape == (b,)
    if m == 0 or layers == 0:
        return
    # Read in their own int dtype (the walk's are int64): a cast to int32 was two launches a step.
    acc, nacc = accept_idx.contiguous(), num_accepted.contiguous()
    block_d = min(256, triton.next_power_of_2(d))
    block_a = min(64, max(2, triton.next_power_of_2(m)))
    _kv_commit_kernel[(layers, b, triton.cdiv(d, block_d))](
        kv_cache, page_table, prefix_lens, acc, nacc, m, d, page_size,
        kv_cache.stride(0), page_size * d, d, page_table.stride(0), acc.stride(0),
        BLOCK_A=block_a, BLOCK_D=block_d,
    )
