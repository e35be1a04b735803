"""The allocator keeps free pages as runs; its placements, refusals and free space are those of
the plain per-page free list it replaced (written out below as the oracle), over random churn
with growth, aligned pools, the scattered mode, and bad frees that must change nothing."""

from __future__ import annotations

import bisect
import random

import numpy as np
import pytest

from treeflash.kvcache.pool import OutOfPages, PageAllocator


class PerPage:
    """The per-page free list (sorted ints) with the allocator's placement rules."""

    def __init__(self, num_pages, scattered=False, seed=0, align=1):
        self.num_pages, self.align, self.scattered = num_pages, align, scattered
        self.free_pages = list(range(num_pages))
        self.rng = np.random.default_rng(seed)  # the scattered mode's draw, as the allocator's

    def runs(self):
        runs = []
        for p in self.free_pages:
            if runs and runs[-1][0] + runs[-1][1] == p:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((p, 1))
        return runs

    def allocate(self, n, after=None):
        if n <= 0:
            return []
        if n > len(self.free_pages):
            raise OutOfPages("full")
        if self.scattered:
            free = np.asarray(self.free_pages)
            pages = free[self.rng.choice(free.size, n, replace=False)].tolist()
        else:
            pages = self.place(n, after)
        taken = set(pages)
        self.free_pages = [p for p in self.free_pages if p not in taken]
        return pages

    def place(self, n, after):
        runs = self.runs()
        if after is not None:
            for start, length in runs:
                if start == after + 1:
                    if length >= n:
                        return list(range(start, start + n))
                    break
        a = self.align
        if a > 1 and after is None:
            fit = [(ln, -(-s // a) * a) for s, ln in runs if -(-s // a) * a + n <= s + ln]
            if fit:
                return list(range(min(fit)[1], min(fit)[1] + n))
        fit = [(ln, s) for s, ln in runs if ln >= n]
        if fit:
            return list(range(min(fit)[1], min(fit)[1] + n))
        pages = []
        for s, ln in sorted(runs, key=lambda r: -r[1]):
            pages.extend(range(s, s + min(ln, n - len(pages))))
            if len(pages) == n:
                break
        return pages

    def free(self, pages):
        if len(set(pages)) != len(pages):
            raise ValueError("twice")
        for p in pages:
            i = bisect.bisect_left(self.free_pages, p)
            if not 0 <= p < self.num_pages or (i < len(self.free_pages) and self.free_pages[i] == p):
                raise ValueError("not allocated")
        self.free_pages = sorted(self.free_pages + list(pages))


@pytest.mark.parametrize("seed", range(12))
def test_runs_allocator_matches_the_per_page_free_list(seed):
    rng = random.Random(seed)
    n = rng.choice([64, 300, 2048])
    kw = {"align": rng.choice([1, 4, 64]), "scattered": seed % 4 == 0, "seed": seed}
    runs, ref = PageAllocator(n, **kw), PerPage(n, **kw)
    held: list[list[int]] = []
    for _ in range(150):
        r = rng.random()
        if r < 0.5:
            k = rng.choice([1, 3, 30, 64, 100, 257])
            after = held[rng.randrange(len(held))][-1] if held and rng.random() < 0.3 else None
            got = [None, None]
            for i, a in enumerate((runs, ref)):
                try:
                    got[i] = a.allocate(k, after)
                except OutOfPages:
                    got[i] = "full"
            assert got[0] == got[1]
            if got[0] != "full":
                held.append(got[0])
        elif r < 0.85 and held:
            pages = held.pop(rng.randrange(len(held)))
            runs.free(pages)
            ref.free(pages)
        else:  # a bad free: out of range, a page twice, or a free page among allocated ones
            used = {p for h in held for p in h}
            spare = [p for p in range(n) if p not in used][:1]
            bad = rng.choice([[n], [-1], (held[0][:2] * 2) if held else [0, 0],
                              (held[0] + spare) if held and spare else [n]])
            with pytest.raises(ValueError):
                runs.free(list(bad))
            with pytest.raises(ValueError):
                ref.free(list(bad))
        assert runs.num_free == len(ref.free_pages) and runs._runs() == ref.runs()


def test_many_runs_at_once_and_a_refused_free_changes_nothing():
    """The scattered mode's one-run-a-page allocations go through the bulk path; a free with one
    page already free is refused whole."""
    a = PageAllocator(5000, scattered=True, seed=3)
    pages = a.allocate(3000)
    assert len(set(pages)) == 3000 and a.num_free == 2000
    before = a._runs()
    spare = next(p for p in range(5000) if p not in set(pages))
    with pytest.raises(ValueError, match=f"page {spare} is not allocated"):
        a.free(pages[:100] + [spare])
    assert a._runs() == before and a.num_free == 2000
    a.free(pages)
    assert a._runs() == [(0, 5000)] and a.num_free == 5000


def test_long_page_lists_in_any_order():
    """Frees of more pages than _NUMPY_SORT (sorted by numpy) and of fewer (by Python), whatever
    their order: one run given shuffled, a repeated page, a page out of range, each refused or
    taken whole."""
    from treeflash.kvcache.pool import _NUMPY_SORT

    for n in (300, _NUMPY_SORT + 904):
        a = PageAllocator(2 * n, align=64)
        pages = a.allocate(n)
        assert pages == list(range(n))
        shuffled = pages[:]
        random.Random(0).shuffle(shuffled)
        with pytest.raises(ValueError, match="freed twice"):
            a.free(shuffled + [shuffled[5]])
        with pytest.raises(ValueError, match=f"page {2 * n} is not allocated"):
            a.free(shuffled + [2 * n])
        assert a.num_free == n and a._runs() == [(n, n)]
        a.free(shuffled)
        assert a.num_free == 2 * n and a._runs() == [(0, 2 * n)]


def test_scattered_draw_is_seeded():
    """The scattered mode's layout is reproducible (benchmarks compare runs of it)."""
    draws = [PageAllocator(4096, scattered=True, seed=7).allocate(500) for _ in range(2)]
    assert draws[0] == draws[1] and sorted(draws[0]) != draws[0]
    assert PageAllocator(4096, scattered=True, seed=8).allocate(500) != draws[0]
