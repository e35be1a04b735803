"""Defragmentation restores contiguity and loses no data."""

from __future__ import annotations

import random

import torch

from treeflash.kvcache import KVPool
from treeflash.kvcache.defrag import compact, defragment_request, is_contiguous, move_pages, num_runs


def _fill(pool: KVPool, pages: list[int], tag: float) -> torch.Tensor:
    """Distinct rows for each of the request's pages in every layer; returns the logical rows."""
    idx = torch.tensor(pages)
    rows = torch.randn(pool.kv.shape[0], len(pages), pool.page_size, pool.kv.shape[-1]) + tag
    pool.kv[:, idx] = rows
    return rows


def _rows(pool: KVPool, pages: list[int]) -> torch.Tensor:
    return pool.kv[:, torch.tensor(pages)]


def _churned_pool(seed: int = 0):
    """Interleaved requests: growth in alternating small steps leaves every request scattered."""
    rng = random.Random(seed)
    pool = KVPool(2, 128, 4, 8, torch.float32, "cpu")
    reqs: list[list[int]] = [[] for _ in range(3)]
    for step in range(12):
        for r in reqs:
            r.extend(pool.allocator.allocate(1 + rng.randrange(2)))
        if step == 5:
            pool.release(reqs.pop(1))  # an aborted request leaves holes
            reqs.insert(1, [])
    reqs = [r for r in reqs if r]
    data = [_fill(pool, r, 10.0 * i) for i, r in enumerate(reqs)]
    return pool, reqs, data


def test_move_pages_is_a_permutation_safe_copy():
    kv = torch.randn(3, 6, 2, 4)
    before = kv.clone()
    move_pages(kv, [0, 1, 2], [1, 2, 0])  # a cycle: every source read before any write
    assert torch.equal(kv[:, 1], before[:, 0]) and torch.equal(kv[:, 2], before[:, 1])
    assert torch.equal(kv[:, 0], before[:, 2]) and torch.equal(kv[:, 3:], before[:, 3:])


def test_defragment_request_into_a_free_run():
    pool, reqs, data = _churned_pool()
    target = reqs[0]
    assert not is_contiguous(target)
    free_before = pool.num_free_pages
    others = [_rows(pool, r).clone() for r in reqs[1:]]
    version = pool.version
    assert defragment_request(pool, target)
    assert pool.version > version  # page-table caches must rebuild
    assert is_contiguous(target) and num_runs(target) == 1
    assert torch.equal(_rows(pool, target), data[0])
    for r, rows in zip(reqs[1:], others):
        assert torch.equal(_rows(pool, r), rows)  # nobody else moved
    assert pool.num_free_pages == free_before


def test_defragment_request_refuses_without_a_run():
    pool = KVPool(1, 8, 2, 4, torch.float32, "cpu")
    a = pool.allocator.allocate(8)
    pool.allocator.free(a[4:])
    frag = [a[0], a[2]]
    pool.allocator.free([a[1], a[3]])
    pool.allocator.allocate(4)  # takes the 4-run, leaving only the holes at 1 and 3
    rows = _fill(pool, frag, 1.0)
    assert not defragment_request(pool, frag)
    assert frag == [a[0], a[2]] and torch.equal(_rows(pool, frag), rows)


def test_compact_everyone_when_no_run_is_free():
    pool, reqs, data = _churned_pool(1)
    pool.allocator.allocate(pool.num_free_pages)  # the pool is full: no free run anywhere
    used = sorted(p for r in reqs for p in r)
    moved = compact(pool, reqs)
    assert moved > 0
    assert all(is_contiguous(r) for r in reqs)
    for r, rows in zip(reqs, data):
        assert torch.equal(_rows(pool, r), rows)
    assert sorted(p for r in reqs for p in r) == used  # same pages, new owners
    assert pool.num_free_pages == 0


def test_compact_scattered_pool_then_allocator_stays_consistent():
    pool = KVPool(2, 40, 1, 4, torch.float32, "cpu", scattered=True)
    reqs = [pool.allocator.allocate(n) for n in (9, 14, 5)]
    data = [_fill(pool, r, float(i)) for i, r in enumerate(reqs)]
    compact(pool, reqs)
    assert all(is_contiguous(r) for r in reqs)
    for r, rows in zip(reqs, data):
        assert torch.equal(_rows(pool, r), rows)
    assert pool.allocator.scattered  # the mode is restored
    rest = pool.allocator.allocate(pool.num_free_pages)
    assert sorted(rest + [p for r in reqs for p in r]) == list(range(40))
