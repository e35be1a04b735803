"""kv_commit over the pool's coarse view when the pool is not whole coarse pages: the layers are
strided (each contiguous). The Triton kernel asserted a contiguous pool and crashed every
speculative step at page 1 with CUDA graphs (2113 pages); it must equal the torch reference."""

from __future__ import annotations

import pytest
import torch

from treeflash import kernels
from treeflash.kvcache import KVPool


@pytest.mark.parametrize("num_pages", [128, 100])
def test_commit_through_a_strided_coarse_view_equals_torch(num_pages):
    g = torch.Generator().manual_seed(0)
    pools = [KVPool(3, num_pages, 1, 16, torch.float32, "cpu") for _ in range(2)]
    for p in pools:
        p.kv.copy_(torch.randn(p.kv.shape, generator=g.manual_seed(1)))
    table = torch.tensor([[0]], dtype=torch.int32)  # coarse page 0 = pages 0..63
    prefix = torch.tensor([20], dtype=torch.int32)
    accept = torch.tensor([[0, 2, 5]])
    rows = torch.tensor([3])
    for p, impl in zip(pools, ("torch", "triton")):
        view = p.kv_as(64)
        assert view.is_contiguous() == (num_pages % 64 == 0)
        kernels.kv_commit(view, table, prefix, accept, rows, impl=impl)
    assert torch.equal(pools[0].kv, pools[1].kv)
