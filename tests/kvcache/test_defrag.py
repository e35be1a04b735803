"""Defragmentation restores contiguity and loses no data."""

from __future__ import annotations

import random

import torch

from treeflash.kvcache import KVPool
from treeflash.kvcache.defrag import compact, defragment_request, is_contiguous, is_laid_out, move_pages, num_runs


def _fill(pool: KVPool, pages: list[int], tag: float) -> torch.Tensor:
    """Distinct rows for each of the request's pages in every layer; returns the logical rows."""
    idx = torch.tensor(pages)
    rows = torch.randn(pool.kv.shape[0], len(pages), pool.page_size, pool.kv.shape[-1]) + tag
    pool.kv[:, idx] = rows
    return rows


def _rows(pool: KVPool, pages: list[int]) -> torch.Tensor:
    return pool.kv[:, torch.tensor(pages)]


def _churned_pool(seed: int = 0):
    """Interleaved requests: growth in alternating small steps leaves every request scattered.
    (Pages of 64 rows: no coarse alignment, which would spread new small runs over the pool.)"""
    rng = random.Random(seed)
    pool = KVPool(2, 128, 64, 8, torch.float32, "cpu")
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


def test_small_pages_are_laid_out_only_in_aligned_runs():
    """Where pages are smaller than a tile (page 1: 64 pages a coarse page), one run is not
    enough: it must start on the coarse grid for the kernel to read it as 64-row pages."""
    pool = KVPool(1, 256, 1, 4, torch.float32, "cpu")
    assert is_laid_out(pool, list(range(64, 100))) and is_laid_out(pool, [])
    assert not is_laid_out(pool, list(range(10, 100)))  # one run, off the grid
    assert not is_laid_out(pool, list(range(64, 70)) + list(range(128, 140)))  # aligned, split
    big = KVPool(1, 16, 64, 4, torch.float32, "cpu")  # pages hold a tile: any single run
    assert is_laid_out(big, [3, 4, 5]) and not is_laid_out(big, [3, 5])


def test_an_unaligned_run_moves_onto_the_grid_once_an_aligned_run_is_free():
    """Placed off the grid under pressure, a contiguous request is moved only into an aligned
    run (another unaligned one gains nothing), with its rows, and no one else moves."""
    pool = KVPool(2, 256, 1, 4, torch.float32, "cpu")
    a = pool.allocator
    blocker = a.allocate(64)  # 0..63
    rest = a.allocate(64 * 3)  # 64..255: the pool is full
    a.free(rest[:50])  # free: 64..113 (no aligned start holds 40 pages but 64 itself)
    a.free(rest[-60:])  # free: 196..255
    req = a.allocate(40)
    assert req == list(range(64, 104))  # aligned: 64 is free
    a.free(req)
    a.allocate(1, after=63)  # growth takes 64: now only unaligned starts are free
    req = a.allocate(40)
    assert req[0] % 64 and is_contiguous(req) and not is_laid_out(pool, req)
    rows = _fill(pool, req, 3.0)
    others = _rows(pool, blocker).clone()
    before = list(req)
    assert not defragment_request(pool, req)  # the free runs: 105..113, 196..255, none aligned
    assert req == before and torch.equal(_rows(pool, req), rows)
    a.free(rest[50:110])  # 105..173 free: 128 is an aligned start for 40 pages
    version = pool.version
    assert defragment_request(pool, req)
    assert req == list(range(128, 168)) and is_laid_out(pool, req) and pool.version > version
    assert torch.equal(_rows(pool, req), rows) and torch.equal(_rows(pool, blocker), others)


def test_a_split_request_takes_one_unaligned_run_and_stays_on_the_list():
    """One run is better than two even off the grid: the request moves and the call says it is
    not laid out yet, so the engine tries again when an aligned run frees."""
    pool = KVPool(1, 256, 1, 4, torch.float32, "cpu")
    a = pool.allocator
    a.allocate(256)
    req = list(range(10, 20)) + list(range(30, 40))  # a request in two pieces
    a.free(list(range(150, 180)))  # one free run, no aligned start in it
    rows = _fill(pool, req, 5.0)
    assert not defragment_request(pool, req)
    assert req == list(range(150, 170)) and torch.equal(_rows(pool, req), rows)
    a.free([p for p in range(192, 256)])
    assert defragment_request(pool, req) and req == list(range(192, 212))
    assert torch.equal(_rows(pool, req), rows)
