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

import numpy as np
import torch

from treeflash.kvcache.format import kv_format


class OutOfPages(RuntimeError):
    """The pool cannot hold what was asked; the caller queues or rejects the request."""


class PageAllocator:
    """Free-page bookkeeping. Pages are ints in [0, num_pages).

    The free pages are kept as sorted runs (start -> length), not page by page: at page size 1
    a pool holds a page per token (a million and more), and a per-page free list made every
    admission and every finish cost a pass over all of it (217-343 ms and 14-100 ms at 2^20
    pages, benchmarks/bench_allocator.py), on the engine's thread, between two steps of every
    running request. Now an allocation costs a pass over the free runs, and a free the length
    of the freed list plus a search per run. Lists of many runs (the scattered mode) go through
    numpy end to end: a request of 131072 scattered pages in a 2^20-page pool took 234 ms to
    admit and 115 ms to free while runs were Python tuples (benchmarks/results/cpu-20261206-allocator-numpy).
    """

    def __init__(self, num_pages: int, *, scattered: bool = False, seed: int = 0, align: int = 1):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        self.num_pages = num_pages
        self.align = align  # a new run starts at a multiple of this when some free run allows it
        self._starts = [0]  # free runs: sorted starts, and each one's length
        self._lens = {0: num_pages}
        self._num_free = num_pages
        # "scattered" reproduces the incident's layout (shuffled single slots) for benchmarks.
        self.scattered = scattered
        self._rng = np.random.default_rng(seed)

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """n pages; contiguous (and right after page `after` when possible) unless scattered."""
        if n <= 0:
            return []
        if n > self._num_free:
            raise OutOfPages(f"need {n} KV pages, {self._num_free} free of {self.num_pages}")
        if self.scattered:  # n distinct free pages in a seeded random order
            mask = self._mask()
            free = np.flatnonzero(mask)
            chosen = free[self._rng.choice(free.size, n, replace=False)]
            runs = _as_runs(np.sort(chosen))[0]
            if runs is None:  # one run a page, nearly: the bulk path
                mask[chosen] = False
                self._set_mask(mask)
                return chosen.tolist()
            pages = chosen.tolist()
        else:
            pages = self._contiguous(n, after)
            runs = _as_runs(sorted(pages))[0]
            if runs is None:  # a placement split over many runs (a pool in holes)
                mask = self._mask()
                mask[np.asarray(pages, dtype=np.int64)] = False
                self._set_mask(mask)
                return pages
        for start, length in runs:
            self._take(start, length)
        return pages

    def _contiguous(self, n: int, after: int | None) -> list[int]:
        if after is not None and after + 1 in self._lens:
            if self._lens[after + 1] >= n:
                return list(range(after + 1, after + 1 + n))
        runs = self._runs()
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
        return [(s, self._lens[s]) for s in self._starts]

    def _take(self, start: int, length: int) -> None:
        """Remove pages start .. start + length - 1, all free and inside one free run."""
        i = bisect.bisect_right(self._starts, start) - 1
        run = self._starts[i]
        run_len = self._lens.pop(run)
        end, run_end = start + length, run + run_len
        assert run <= start and end <= run_end, (start, length, run, run_len)
        del self._starts[i]
        if run < start:  # the part before stays free
            self._starts.insert(i, run)
            self._lens[run] = start - run
            i += 1
        if end < run_end:  # and the part after
            self._starts.insert(i, end)
            self._lens[end] = run_end - end
        self._num_free -= length

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool; a page that is not allocated (or given twice) is an error.
        Nothing is freed when any page is in error."""
        if not pages:
            return
        big = len(pages) > _NUMPY_SORT  # numpy's sort is ~4x Python's on 10^5 shuffled ids
        ordered = np.sort(np.asarray(pages, dtype=np.int64)) if big else sorted(pages)
        runs, repeated = _as_runs(ordered)
        if repeated:
            raise ValueError(f"pages {list(ordered[:8])}... are freed twice in one call")
        if ordered[0] < 0 or ordered[-1] >= self.num_pages:
            raise ValueError(f"page {int(ordered[0] if ordered[0] < 0 else ordered[-1])} is not allocated")
        if runs is None:  # many runs (the scattered mode: one a page): one numpy pass
            free, arr = self._mask(), np.asarray(ordered, dtype=np.int64)
            hit = free[arr]
            if hit.any():
                raise ValueError(f"page {int(arr[hit][0])} is not allocated")
            free[arr] = True
            self._set_mask(free)
            return
        for start, length in runs:
            i = bisect.bisect_right(self._starts, start + length - 1) - 1  # the last free run at or before the end
            if i >= 0 and self._starts[i] + self._lens[self._starts[i]] > start:  # overlaps [start, end)
                raise ValueError(f"page {max(start, self._starts[i])} is not allocated")
        for start, length in runs:
            self._give(start, length)

    def _mask(self):
        """The free pages as a numpy bool array (for operations on many runs at once)."""
        delta = np.zeros(self.num_pages + 1, dtype=np.int64)
        starts = np.asarray(self._starts, dtype=np.int64)
        delta[starts] += 1
        delta[starts + np.asarray([self._lens[s] for s in self._starts], dtype=np.int64)] -= 1
        return np.cumsum(delta[:-1]) > 0

    def _set_mask(self, free) -> None:
        edges = np.diff(np.concatenate(([0], free.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        self._starts = starts.tolist()
        self._lens = dict(zip(self._starts, (ends - starts).tolist()))
        self._num_free = int(free.sum())

    def _give(self, start: int, length: int) -> None:
        """Add the free run start .. start + length - 1, merged with its neighbours."""
        i = bisect.bisect_left(self._starts, start)
        end = start + length
        self._num_free += length
        if i > 0 and self._starts[i - 1] + self._lens[self._starts[i - 1]] == start:  # join the run before
            i -= 1
            start = self._starts[i]
            length += self._lens.pop(start)
            del self._starts[i]
        if i < len(self._starts) and self._starts[i] == end:  # and the run after
            length += self._lens.pop(end)
            del self._starts[i]
        self._starts.insert(i, start)
        self._lens[start] = length


_FEW_RUNS = 64  # above this many runs an allocation or a free rebuilds the runs in one numpy pass
_NUMPY_SORT = 4096  # a free of more pages than this sorts them with numpy


def _as_runs(ordered) -> tuple[list[tuple[int, int]] | None, bool]:
    """Sorted page ids (a list or an int64 array) as (start, length) runs of consecutive ids,
    and whether an id repeats; None for the runs when there are more than _FEW_RUNS of them
    (the caller then works on the ids in one numpy pass: a Python tuple a run cost ~0.5 us, 100 ms
    for a scattered request of 190k pages). One comparison in C when a list is one run (the
    usual case), else a numpy pass."""
    n = len(ordered)
    if not n:
        return [], False
    first = int(ordered[0])
    if int(ordered[-1]) - first + 1 == n and (
            isinstance(ordered, np.ndarray) or ordered == list(range(first, first + n))):
        if not isinstance(ordered, np.ndarray) or bool((np.diff(ordered) == 1).all()):
            return [(first, n)], False
    arr = np.asarray(ordered, dtype=np.int64)
    step = np.diff(arr)
    cuts = np.flatnonzero(step != 1) + 1
    repeated = bool((step == 0).any())
    if cuts.size >= _FEW_RUNS:
        return None, repeated
    bounds = [0, *cuts.tolist(), n]
    runs = [(int(arr[a]), int(arr[b - 1] - arr[a]) + 1) for a, b in zip(bounds[:-1], bounds[1:])]
    return runs, repeated


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
        kv_cache_dtype: str = "auto",
        v_dim: int | None = None,
        dcp: int = 1,
    ):
        """dim values a row in `dtype` (the model's); kv_cache_dtype "auto" stores them so,
        "fp8_e4m3" (needs v_dim = kv_lora_rank) in `kvcache.format`'s rows: kv is then
        [num_layers, num_pages, page_size, row_bytes] uint8."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if dcp < 1:
            raise ValueError(f"dcp must be >= 1, got {dcp}")
        from treeflash.kvcache.coarse import coarse_factor

        self.page_size = page_size
        self.format = kv_format(kv_cache_dtype, dim, dim if v_dim is None else v_dim, dtype)
        if self.format.fp8 and v_dim is None:
            raise ValueError("an fp8_e4m3 KV cache needs v_dim (kv_lora_rank: the quantised part of a row)")
        self.kv = torch.zeros(num_layers, num_pages, page_size, self.format.row_elems,
                              dtype=self.format.storage_dtype, device=device)
        # pages a 64-row coarse page holds (None: pages hold a tile already, or cannot be grouped)
        self.coarse_factor = None if scattered else coarse_factor(page_size, num_pages)
        self.allocator = PageAllocator(num_pages, scattered=scattered, align=self.coarse_factor or 1)
        self.version = 0  # bumped whenever any request's pages change (page-table caches key on it)
        # decode context parallelism (`models/dcp.py`): a page id is a page on each of the dcp
        # ranks of a group, each holding page_size of the request's positions
        self.dcp = dcp
        # called as on_move(src, dst) after pages are moved here (`kvcache.defrag`): a distributed
        # executor moves its followers' pages the same way
        self.on_move = None

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the values a row holds (the model's), whatever the storage."""
        return self.format.dtype

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's KV takes over all layers (`KVFormat.row_bytes` x layers)."""
        return self.kv.shape[0] * self.format.row_bytes

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def tokens_per_page(self) -> int:
        """A request's positions one page id holds: page_size, x dcp under DCP."""
        return self.page_size * self.dcp

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_page)

    def scratch_tokens(self, rows: int) -> int:
        """Extra tokens to reserve a request under DCP, so that every rank has room for a
        forward's `rows` new rows after its share (they are written there before they settle on
        their owners); 0 without DCP."""
        return scratch_tokens(rows, self.page_size, self.dcp)


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


def scratch_tokens(rows: int, page_size: int, dcp: int) -> int:
    """`KVPool.scratch_tokens` for a pool of `page_size` and `dcp` not built yet."""
    if dcp == 1:
        return 0
    span = page_size * dcp
    return span * (1 + -(-rows * dcp // span))
