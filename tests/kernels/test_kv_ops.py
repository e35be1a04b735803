"""KV write and commit: Triton (interpreter on CPU) against the torch reference."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from treeflash.kernels import kv_commit, kv_write, reference  # noqa: E402
from treeflash.kernels.testing import random_paged_kv  # noqa: E402


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN included (poisoned slots must stay exactly as they were)."""
    return torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a.view(torch.int16),
                       b.view(torch.int32) if b.dtype == torch.float32 else b.view(torch.int16))


@pytest.mark.parametrize("page_size,layout,dtype", [(1, "scattered", torch.float32),
                                                     (16, "contiguous", torch.bfloat16),
                                                     (3, "scattered", torch.float16)])
def test_kv_write(page_size, layout, dtype):
    g = torch.Generator().manual_seed(0)
    start = [5, 0, 31]
    n = 7
    kv = random_paged_kv([s + n for s in start], 40, page_size, dtype, layout, generator=g)
    # latents in the cache dtype: the interpreter truncates fp32 -> bf16 where the GPU rounds
    lat = torch.randn(3, n, 40, generator=g).to(dtype)
    start_t = torch.tensor(start, dtype=torch.int32)
    ours, ref = kv.kv_cache.clone(), kv.kv_cache.clone()
    kv_write(ours, kv.page_table, start_t, lat, impl="triton")
    reference.kv_write(ref, kv.page_table, start_t, lat)
    assert _same(ours, ref)


@pytest.mark.parametrize("page_size,layout", [(1, "scattered"), (4, "contiguous"), (5, "scattered")])
def test_kv_commit_all_layers(page_size, layout):
    g = torch.Generator().manual_seed(1)
    prefix = [9, 0, 22]
    n, d, layers = 11, 24, 3
    kvs = [random_paged_kv([p + n for p in prefix], d, page_size, torch.float32, layout,
                           generator=torch.Generator().manual_seed(7)) for _ in range(layers)]
    pool = torch.stack([k.kv_cache for k in kvs])  # same pages for all layers, different rows
    pool[1:] = torch.randn(pool[1:].shape, generator=g).where(~pool[1:].isnan(), pool[1:])
    table = kvs[0].page_table
    accept = torch.tensor([[0, 2, 3, 7, 10], [0, 1, 2, 3, 4], [0, 5, 6, 0, 0]])
    num = torch.tensor([5, 3, 3])
    prefix_t = torch.tensor(prefix, dtype=torch.int32)
    ours, ref = pool.clone(), pool.clone()
    kv_commit(ours, table, prefix_t, accept, num, impl="triton")
    reference.kv_commit(ref, table, prefix_t, accept, num)
    assert _same(ours, ref)
    assert not _same(ours, pool)


def test_kv_commit_long_path_chunks():
    """More accepted rows than one load chunk (64), with a shifting path."""
    g = torch.Generator().manual_seed(2)
    n = 150
    kv = random_paged_kv([3 + n], 16, 2, torch.float32, "scattered", generator=g)
    idx = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(n - 1, generator=g)[:99] + 1])
    accept = idx.sort().values[None]
    num = torch.tensor([100])
    prefix_t = torch.tensor([3], dtype=torch.int32)
    ours, ref = kv.kv_cache.clone(), kv.kv_cache.clone()
    kv_commit(ours, kv.page_table, prefix_t, accept, num, impl="triton")
    reference.kv_commit(ref, kv.page_table, prefix_t, accept, num)
    assert _same(ours, ref)
