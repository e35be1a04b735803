"""Coarse views: a request whose small pages form aligned runs is read as big pages.

The verify kernel streams whole 64-row tiles by TMA only when every tile lies in one page
(page_size % 64 == 0, the dispatch table of `kernels/mla_verify`); a pool of page_size 1 (the incident's
layout, the bench's "scattered" mode) runs the gathered-row kernels even after
`kvcache.defrag` has made a request contiguous. But the pool tensor is one contiguous block,
so its layer [num_pages, page_size, D] is also [num_pages // f, f x page_size, D] (the first
num_pages // f x f pages; any after them are in no coarse page), with no copy. If each group of
f consecutive logical pages of a request is f consecutive physical pages starting at a
multiple of f, the request's coarse page table is every f-th entry divided by f, and the
kernel sees page_size f x page_size: contiguous speed. The engine reads batches this way
(`engine.executor.PagedKV`), and its allocator starts runs at such pages (`KVPool`).

`coarsen` answers from the host's page lists (no device sync): the coarse page lists, or None
when some request is not laid out that way (then use the fine table as before).
`coarse_kv` is the matching view of one layer. Defragmentation that allocates runs from the
pool's low pages (`defrag.compact` on an otherwise empty stretch) starts them at page 0 or at
a multiple of f whenever the runs before it are multiples of f.
"""

from __future__ import annotations

import torch

TILE = 64  # rows a verify tile reads in one TMA box (kernels/mla_verify/hopper.py BLOCK_N)


def coarse_factor(page_size: int, num_pages: int, tile: int = TILE) -> int | None:
    """f such that f x page_size = tile, or None (pages already hold a tile, or no such f, or
    the pool is smaller than one coarse page)."""
    if page_size >= tile or tile % page_size:
        return None
    f = tile // page_size
    return f if num_pages >= f else None


def whole_tiles(tokens: int, page_size: int, tile: int = TILE) -> int:
    """`tokens` rounded up to whole coarse pages where pages are smaller than a tile (a pool
    or a reservation sized so is read coarse up to its last page); else `tokens` itself."""
    if page_size >= tile or tile % page_size:
        return tokens
    return -(-tokens // tile) * tile


def coarsen(page_lists: list[list[int]], page_size: int, num_pages: int,
            tile: int = TILE) -> list[list[int]] | None:
    """The requests' pages as coarse pages of `tile` rows, or None if any request (or the pool)
    does not allow it. A request's last group may be short (its tail) but must start aligned;
    the rest of that coarse page belongs to no one the request can see (the kernel reads only
    positions below prefix + N)."""
    f = coarse_factor(page_size, num_pages, tile)
    if f is None:
        return None
    out = []
    for pages in page_lists:
        coarse = []
        for g in range(0, len(pages), f):
            group = pages[g:g + f]
            first = group[0]
            if first % f or first + f > num_pages or group != list(range(first, first + len(group))):
                return None  # (a group must lie in a whole coarse page: the view has no other)
            coarse.append(first // f)
        out.append(coarse)
    return out


def coarse_kv(kv: torch.Tensor, f: int) -> torch.Tensor:
    """[..., num_pages, page_size, D] (a layer, or the pool's layers) as
    [..., num_pages // f, f x page_size, D]: a view, no copy; pages past the last whole coarse
    page are left out."""
    *lead, n, p, d = kv.shape
    m = n // f
    if m < 1:
        raise ValueError(f"{n} pages make no coarse page of {f}")
    return kv[..., : m * f, :, :].view(*lead, m, f * p, d)


__all__ = ["TILE", "coarse_factor", "coarse_kv", "coarsen", "whole_tiles"]
