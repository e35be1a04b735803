"""Does a graph pool survive its graphs? (the draft-graph capture failure of 2026-12-02)

    python benchmarks/check_graph_pool.py      (CUDA)

Captures a graph into a shared pool, destroys it, captures another into the same pool:
first with a bare `graph_pool_handle()`, then with `engine.graphs.GraphPool` (anchored).
Prints what each did; exits 1 if the anchored pool fails.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from treeflash.engine.graphs import GraphPool  # noqa: E402


def churn(handle, dev) -> str:
    x = torch.randn(1 << 20, device=dev)
    try:
        for i in range(3):
            g = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(g, pool=handle):
                y = (x * (i + 2)).sin()
            g.replay()
            del g, y
            gc.collect()
        return "ok"
    except RuntimeError as e:
        return f"failed: {str(e).splitlines()[0][:160]}"


def main() -> int:
    dev = torch.device("cuda")
    bare = churn(torch.cuda.graph_pool_handle(), dev)
    anchored = churn(GraphPool(dev).handle, dev)
    print(f"bare pool: {bare}\nanchored pool: {anchored}")
    return 0 if anchored == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
