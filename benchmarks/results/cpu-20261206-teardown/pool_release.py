"""Host ms of KVPool.grow / release for one 190k-token request: page 1 scattered against page 64."""
import time

import torch

from treeflash.kvcache.pool import KVPool

for scattered, page, tokens in ((True, 1, 190000), (False, 64, 190000)):
    pool = KVPool(1, 400000 // page, page, 8, torch.float32, "cpu", scattered=scattered)
    pages: list[int] = []
    t = time.perf_counter()
    pool.grow(pages, tokens)
    grow = time.perf_counter() - t
    n = len(pages)
    t = time.perf_counter()
    pool.release(pages)
    release = time.perf_counter() - t
    print(f"{'scattered' if scattered else 'runs':9s} page {page:2d}: {n:6d} pages, grow {grow * 1e3:6.1f} ms, "
          f"release {release * 1e3:6.1f} ms")
