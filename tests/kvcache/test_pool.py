"""The page allocator keeps requests contiguous and never loses or double-frees a page."""

from __future__ import annotations

import random

import pytest
import torch

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


def test_new_runs_start_aligned_when_a_free_run_allows_it():
    """With align f (a page-1 pool's 64), every new run starts at a multiple of f (best fit
    among such starts), short ones too, so it reads as coarse pages; growth continues its run
    or is packed, and a run that no aligned start can hold is placed as before."""
    a = PageAllocator(512, align=64)
    small = a.allocate(10)
    assert small == list(range(10))
    big = a.allocate(100)
    assert big == list(range(64, 164))  # aligned, leaving 10..63 free
    assert a.allocate(20) == list(range(192, 212))  # short, aligned too: 10..63 holds no aligned start
    assert a.allocate(3, after=small[-1]) == [10, 11, 12]  # growth continues its run
    assert a.allocate(2, after=big[-1] + 50) == [164, 165]  # growth elsewhere: best fit, unaligned
    a.free(big)
    mid = a.allocate(64)
    assert mid == list(range(64, 128))  # best fit among aligned starts: the first free 64-aligned run
    a.free([10, 11, 12, 164, 165] + list(range(192, 212)))  # free: 10..63, 128..511
    odd = a.allocate(400)  # no aligned start holds 400: the longest runs, unaligned
    assert odd[:384] == list(range(128, 512)) and odd[384:] == list(range(10, 26))
    assert a.allocate(30) == list(range(26, 56))  # no aligned start left at all: packed
    with pytest.raises(ValueError, match="align"):
        PageAllocator(8, align=0)
    pool = KVPool(1, 256, 1, 4, torch.float32, "cpu")
    assert pool.coarse_factor == 64 and pool.allocator.align == 64
    assert KVPool(1, 256, 1, 4, torch.float32, "cpu", scattered=True).coarse_factor is None
    assert KVPool(1, 256, 64, 4, torch.float32, "cpu").coarse_factor is None
    assert pool.kv_as(64).shape == (1, 4, 64, 4) and pool.kv_as(1) is pool.kv
