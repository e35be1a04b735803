"""Paged latent KV cache: the page pool, its allocator, per-request page tables and the row format."""

from treeflash.kvcache.format import KVFormat, kv_format
from treeflash.kvcache.pool import KVPool, OutOfPages, PageAllocator

__all__ = ["KVFormat", "KVPool", "OutOfPages", "PageAllocator", "kv_format"]
