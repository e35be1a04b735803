"""A preallocated pool of KV pages and an allocator that keeps each request contiguous.

The pool is one tensor [num_layers, num_pages, page_size, D]; layer l's cache is the
contiguous view kv[l]. The allocator hands out pages from sorted free runs: a request that
grows takes the page right after its last one when that page is free, and a new request
takes the first run long enough for its reservation (best fit), so KV stays contiguous
whenever the pool allows it and the verify kernel streams it at full bandwidth.

Pages smaller than the kernel's 64-row tile (page_size 1, the incident's layout) are read as
64-row pages through a coarse view (`kvcache.coarse`) when a request's run starts at a multiple
of 64 / page_size: the allocator places every new run there (`align`) whenever a free run
allows it, and `kvcache.defrag` moves a run placed elsewhere under pressure once one does.
"""

from __future__ import annotations

import bisect
import random

import torch


class OutOfPages(RuntimeError):
    """The pool cannot hold what was asked; the caller queues or rejects the request."""


class PageAllocator:
    """Free-page bookkeeping. Pages are ints in [0, num_pages)."""

    def __init__(self, num_pages: int, *, scattered: bool = False, seed: int = 0, align: int = 1):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        self.num_pages = num_pages
        self.align = align  # a new run starts at a multiple of this when some free run allows it
        self._free = list(range(num_pages))  # kept sorted
        # "scattered" reproduces the incident's layout (shuffled single slots) for benchmarks.
        self.scattered = scattered
        self._rng = random.Random(seed)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """n pages; contiguous (and right after page `after` when possible) unless scattered."""
        if n <= 0:
            return []
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} free of {self.num_pages}")
        if self.scattered:
            pages = self._rng.sample(self._free, n)
        else:
            pages = self._contiguous(n, after)
        if n <= 8:
            for p in pages:
                self._free.pop(bisect.bisect_left(self._free, p))
        else:  # one linear pass instead of n list pops (a 256k-token request is 256k pages at size 1)
            taken = set(pages)
            self._free = [p for p in self._free if p not in taken]
        return pages

    def _contiguous(self, n: int, after: int | None) -> list[int]:
        runs = self._runs()
        if after is not None:
            for start, length in runs:
                if start == after + 1:
                    take = min(n, length)
                    if take == n:
                        return list(range(start, start + n))
                    break
        a = self.align
        if a > 1 and after is None:  # a new run: best fit among the runs that hold n pages from
            # an aligned start. Short runs too: one request placed off the grid makes every batch
            # it joins read page by page (kvcache.coarse); a gap left before it is free for the
            # next short one. (Growth that cannot continue its run is split anyway: packed.)
            fitting = [(length, -(-start // a) * a) for start, length in runs
                       if -(-start // a) * a + n <= start + length]
            if fitting:
                _, start = min(fitting)
                return list(range(start, start + n))
        fitting = [(length, start) for start, length in runs if length >= n]
        if fitting:
            _, start = min(fitting)
            return list(range(start, start + n))
        pages: list[int] = []  # no single run fits: take the longest runs first
        for start, length in sorted(runs, key=lambda r: -r[1]):
            pages.extend(range(start, start + min(length, n - len(pages))))
            if len(pages) == n:
                break
        return pages

    def _runs(self) -> list[tuple[int, int]]:
        runs: list[tuple[int, int]] = []
        for p in self._free:
            if runs and runs[-1][0] + runs[-1][1] == p:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((p, 1))
        return runs

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool; a page that is not allocated (or given twice) is an error."""
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages {sorted(pages)[:8]}... are freed twice in one call")
        for p in pages:
            i = bisect.bisect_left(self._free, p)
            if not 0 <= p < self.num_pages or (i < len(self._free) and self._free[i] == p):
                raise ValueError(f"page {p} is not allocated")
        if len(pages) <= 8:
            for p in pages:
                bisect.insort(self._free, p)
        else:
            self._free = sorted(self._free + list(pages))


class KVPool:
    """The latent KV of every layer plus the allocator; page tables are built per batch."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        scattered: bool = False,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        from treeflash.kvcache.coarse import coarse_factor

        self.page_size = page_size
        self.kv = torch.zeros(num_layers, num_pages, page_size, dim, dtype=dtype, device=device)
        # pages a 64-row coarse page holds (None: pages hold a tile already, or cannot be grouped)
        self.coarse_factor = None if scattered else coarse_factor(page_size, num_pages)
        self.allocator = PageAllocator(num_pages, scattered=scattered, align=self.coarse_factor or 1)
        self.version = 0  # bumped whenever any request's pages change (page-table caches key on it)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def grow(self, pages: list[int], num_tokens: int) -> None:
        """Extend `pages` in place so it covers `num_tokens` positions."""
        need = self.pages_for(num_tokens) - len(pages)
        if need > 0:
            pages.extend(self.allocator.allocate(need, after=pages[-1] if pages else None))
            self.version += 1

    def release(self, pages: list[int]) -> None:
        self.allocator.free(pages)
        pages.clear()
        self.version += 1

    def kv_as(self, factor: int) -> torch.Tensor:
        """The pool as [num_layers, num_pages / factor, factor x page_size, D]: a view, no copy
        (factor 1: `kv` itself). Page p of a coarse table is pages p*factor .. p*factor+factor-1;
        pages past the last whole coarse page are in none."""
        if factor == 1:
            return self.kv
        if factor != self.coarse_factor:
            raise ValueError(f"coarse factor {factor}: this pool groups {self.coarse_factor} pages")
        from treeflash.kvcache.coarse import coarse_kv

        return coarse_kv(self.kv, factor)

    def page_table(self, page_lists: list[list[int]], device=None, factor: int = 1) -> torch.Tensor:
        """[B, max_pages] int32; padding is the page count (out of range: a stray read is caught).
        factor: the lists hold coarse pages of `kv_as(factor)`, padded with num_pages // factor."""
        width = max(1, max(len(p) for p in page_lists))
        table = torch.full((len(page_lists), width), self.num_pages // factor, dtype=torch.int32)
        for i, pages in enumerate(page_lists):
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return table.to(device or self.kv.device)
