"""Defragmentation: make each request's KV pages one contiguous run again after churn.

Contiguous pages let the verify kernel stream a request's latents at full bandwidth (and
with page_size 1, turn one gather per token back into sequential rows). Moves are copies
of whole pages across all layers of the pool tensor [num_layers, num_pages, page_size, D],
enqueued on the current stream: kernels enqueued later on that stream see the moved rows,
and a freed page is reused only by work enqueued after the copy, so no data is lost.
`defragment_request` touches only one request's pages and free pages, so other requests
may keep running between (and around) its moves; `compact` moves many requests at once and
is meant for a pause between steps.
"""

from __future__ import annotations

import torch

from treeflash.kvcache.coarse import coarsen
from treeflash.kvcache.pool import KVPool, OutOfPages


def num_runs(pages: list[int]) -> int:
    """How many contiguous runs `pages` (in logical order) forms; 1 = fully contiguous."""
    return sum(1 for i, p in enumerate(pages) if i == 0 or p != pages[i - 1] + 1)


def is_contiguous(pages: list[int]) -> bool:
    return num_runs(pages) <= 1


def is_laid_out(pool: KVPool, pages: list[int]) -> bool:
    """Whether the verify kernel reads `pages` at contiguous speed: one run, and where the pool's
    pages are smaller than a tile (pool.coarse_factor), a run the coarse view can read as 64-row
    pages (it starts at a multiple of the factor; `kvcache.coarse`)."""
    if not is_contiguous(pages):
        return False
    if pool.coarse_factor is None or not pages:
        return True
    return coarsen([pages], pool.page_size, pool.num_pages) is not None


def move_pages(kv: torch.Tensor, src: list[int] | torch.Tensor, dst: list[int] | torch.Tensor) -> None:
    """kv[:, dst[i]] = kv[:, src[i]] for all i, as if every source were read first.

    kv [num_layers, num_pages, page_size, D]. dst entries must be distinct; src and dst may
    overlap (a permutation), because each layer's sources are gathered before the scatter.
    Peak extra memory: one layer's worth of the moved pages.
    """
    src_t = torch.as_tensor(src, dtype=torch.long, device=kv.device)
    dst_t = torch.as_tensor(dst, dtype=torch.long, device=kv.device)
    assert src_t.shape == dst_t.shape and src_t.dim() == 1
    keep = src_t != dst_t
    src_t, dst_t = src_t[keep], dst_t[keep]
    if src_t.numel() == 0:
        return
    for layer in kv:  # [num_pages, page_size, D]
        layer.index_copy_(0, dst_t, layer.index_select(0, src_t))


def _move(pool: KVPool, src: list[int], dst: list[int]) -> None:
    """Move pages in the pool, and wherever else it is mirrored (`KVPool.on_move`: the followers
    of a distributed executor, whose pools hold the same pages, or their DCP shares)."""
    move_pages(pool.kv, src, dst)
    if pool.on_move is not None:
        moved = [(s, d) for s, d in zip(src, dst) if s != d]
        if moved:
            pool.on_move([s for s, _ in moved], [d for _, d in moved])


def _allocate_run(pool: KVPool, n: int) -> list[int] | None:
    """n fresh pages as one run, or None (nothing is taken then)."""
    allocator = pool.allocator
    scattered, allocator.scattered = allocator.scattered, False
    try:
        pages = allocator.allocate(n)
    except OutOfPages:
        return None
    finally:
        allocator.scattered = scattered
    if not is_contiguous(pages):
        allocator.free(pages)
        return None
    return pages


def defragment_request(pool: KVPool, pages: list[int]) -> bool:
    """Move one request into a free contiguous run; `pages` is updated in place.

    Returns True when the request is laid out for the kernel afterwards (`is_laid_out`: one
    run, aligned for the coarse view where pages are small). Needs a free run as long as the
    request (the old pages are freed after the move); otherwise leaves it as it is and returns
    False (then `compact` can help). A split request moves into an unaligned run if no aligned
    one is free (one run is still better) and returns False: a later call may align it. A
    contiguous one moves only into an aligned run. Rebuild the page table from `pages` afterwards.
    """
    if is_laid_out(pool, pages):
        return True
    new = _allocate_run(pool, len(pages))
    if new is None:
        return False
    if is_contiguous(pages) and not is_laid_out(pool, new):
        pool.allocator.free(new)  # one unaligned run for another: no gain
        return False
    _move(pool, list(pages), new)
    pool.allocator.free(list(pages))
    pages[:] = new
    pool.version += 1  # page tables built from the old layout are stale
    return is_laid_out(pool, pages)


def compact(pool: KVPool, page_lists: list[list[int]]) -> int:
    """Re-lay out the listed requests as consecutive runs, in the given order.

    All their pages are released and re-allocated one request at a time (the allocator's
    best fit: the shortest free run that holds the request, from its low end; with no other
    request in the way that is one run from the pool's low pages), then every moved page is
    copied in one gather/scatter per layer, so overlapping moves are safe. Pages of requests
    not listed stay where they are. Lists are updated in place; returns the number of pages
    moved. Run it between steps: the listed requests must not be read while it runs.
    """
    allocator = pool.allocator
    for pages in page_lists:
        allocator.free(list(pages))
    scattered, allocator.scattered = allocator.scattered, False
    try:
        new_lists = [allocator.allocate(len(pages)) for pages in page_lists]
    finally:
        allocator.scattered = scattered
    src = [p for pages in page_lists for p in pages]
    dst = [p for pages in new_lists for p in pages]
    _move(pool, src, dst)
    for pages, new in zip(page_lists, new_lists):
        pages[:] = new
    pool.version += 1  # page tables built from the old layout are stale
    return sum(s != d for s, d in zip(src, dst))
