"""Coarse views read a defragmented page-1 request as 64-row pages, with the same answer."""

from __future__ import annotations

import torch

from treeflash.kernels import reference
from treeflash.kvcache import KVPool
from treeflash.kvcache.coarse import coarse_factor, coarse_kv, coarsen, whole_tiles
from treeflash.kvcache.defrag import compact


def test_factor_and_layouts():
    assert coarse_factor(1, 4096) == 64 and coarse_factor(16, 64) == 4
    assert coarse_factor(64, 4096) is None and coarse_factor(128, 64) is None  # already whole tiles
    assert coarse_factor(3, 4096) is None  # 64 % 3: no whole factor
    assert coarse_factor(1, 4100) == 64 and coarse_factor(1, 63) is None  # at least one coarse page
    assert coarsen([list(range(4032, 4100))], 1, 4100) is None  # 4096.. is in no coarse page
    assert coarsen([list(range(3968, 4032))], 1, 4100) == [[62]]
    assert coarsen([list(range(128, 320))], 1, 4096) == [[2, 3, 4]]  # tail group short, aligned
    assert coarsen([list(range(128, 320)), list(range(0, 64))], 1, 4096) == [[2, 3, 4], [0]]
    assert coarsen([list(range(129, 321))], 1, 4096) is None  # not aligned
    assert coarsen([list(range(0, 64)) + list(range(65, 129))], 1, 4096) is None  # a hole
    assert coarsen([list(range(0, 63)) + [200]], 1, 4096) is None  # one page elsewhere
    assert coarsen([[4, 5, 6, 7, 0, 1]], 16, 64) == [[1, 0]]  # groups in any order
    assert coarsen([[]], 1, 4096) == [[]]
    assert coarsen([list(range(64))], 64, 4096) is None
    assert (whole_tiles(65, 1), whole_tiles(64, 16), whole_tiles(65, 64), whole_tiles(65, 3)) == (128, 64, 65, 65)


def test_coarse_view_is_the_same_rows():
    kv = torch.randn(3, 256, 1, 8)
    view = coarse_kv(kv[1], 64)
    assert view.shape == (4, 64, 8) and view.data_ptr() == kv[1].data_ptr()
    assert torch.equal(view[2, 5], kv[1, 2 * 64 + 5, 0])


def test_defragmented_page1_request_attends_the_same_through_the_coarse_view():
    """A page-1 request scattered over the pool, compacted, then read through its coarse table:
    the reference attention over the coarse view (page size 64) equals the fine one exactly
    (same rows, same order), and the scattered layout does not coarsen."""
    g = torch.Generator().manual_seed(0)
    pool = KVPool(2, 1024, 1, 24, torch.float64, "cpu", scattered=True)
    pool.kv.normal_(generator=g)
    pages = pool.allocator.allocate(300)
    assert coarsen([pages], 1, pool.num_pages) is None
    before = pool.kv[:, torch.tensor(pages)].clone()
    compact(pool, [pages])
    assert torch.equal(pool.kv[:, torch.tensor(pages)], before)
    coarse = coarsen([pages], 1, pool.num_pages)
    assert coarse is not None and len(coarse[0]) == 5
    q = torch.randn(1, 4, 3, 24, generator=g, dtype=torch.float64)
    prefix = torch.tensor([296], dtype=torch.int32)
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool))[None]
    fine = reference.mla_verify_attention(q, pool.kv[1], pool.page_table([pages]), prefix, mask,
                                          0.2, 16)
    table = torch.tensor(coarse, dtype=torch.int32)
    big = reference.mla_verify_attention(q, coarse_kv(pool.kv[1], 64), table, prefix, mask, 0.2, 16)
    assert torch.equal(fine[0], big[0]) and torch.equal(fine[1], big[1])
