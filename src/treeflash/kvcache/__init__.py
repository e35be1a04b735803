"""Paged latent KV cache: the page pool, its allocator and per-request page tables."""

from treeflash.kvcache.pool import KVPool, OutOfPages, PageAllocator

__all__ = ["KVPool", "OutOfPages", "PageAllocator"]
