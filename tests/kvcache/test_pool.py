"""The page allocator keeps requests contiguous and never loses or double-frees a page."""

from __future__ import annotations

import random

import pytest

from treeflash.kvcache import KVPool, OutOfPages, PageAllocator


def is_run(pages):
    return pages == list(range(pages[0], pages[0] + len(pages)))


def test_fresh_allocations_are_contiguous():
    a = PageAllocator(64)
    for n in (5, 1, 17, 8):
        assert is_run(a.allocate(n))


def test_growth_continues_the_run():
    pool = KVPool(1, 64, 4, 8, dtype=__import__("torch").float32, device="cpu")
    pages: list[int] = []
    for tokens in range(1, 100, 7):
        pool.grow(pages, tokens)
    assert is_run(pages)
    pool.release(pages)
    assert pool.num_free_pages == 64 and pages == []


def test_best_fit_after_churn():
    a = PageAllocator(32)
    x, y, z = a.allocate(4), a.allocate(10), a.allocate(4)
    a.free(y)
    assert a.allocate(10) == y  # the hole is reused whole
    a.free(x)
    a.free(z)
    got = a.allocate(3)
    assert is_run(got)


def test_exhaustion_and_double_free():
    a = PageAllocator(8)
    p = a.allocate(8)
    with pytest.raises(OutOfPages, match="need 1 KV pages, 0 free"):
        a.allocate(1)
    a.free(p[:2])
    with pytest.raises(ValueError, match="not allocated"):
        a.free(p[:1])
    with pytest.raises(ValueError, match="not allocated"):
        a.free([99])


def test_random_churn_conserves_pages():
    rng = random.Random(0)
    a = PageAllocator(128)
    held = []
    for _ in range(500):
        if held and rng.random() < 0.45:
            a.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 12)
            if n <= a.num_free:
                held.append(a.allocate(n))
        owned = [p for h in held for p in h]
        assert len(owned) == len(set(owned))
        assert len(owned) + a.num_free == 128


def test_scattered_mode_shuffles():
    a = PageAllocator(256, scattered=True, seed=1)
    assert not is_run(a.allocate(32))


def test_page_table_padding_is_out_of_range():
    import torch

    pool = KVPool(1, 10, 2, 4, dtype=torch.float32, device="cpu")
    t = pool.page_table([[1, 2, 3], [7]])
    assert t.dtype == torch.int32 and t.tolist() == [[1, 2, 3], [7, 10, 10]]
