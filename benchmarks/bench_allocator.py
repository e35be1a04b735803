"""Host cost of the KV page allocator: one admission (allocate) and one finish (free) of a
request on a pool already holding others, for pool sizes up to a page-1 pool of 2M tokens.

    python benchmarks/bench_allocator.py [--src DIR]   # DIR: another tree's src/ (A/B)

Prints a table and writes benchmarks/results/allocator-<date>.json. The engine runs these on
its thread between two steps of every running request, so each is a stall of every stream.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    sys.path.insert(0, args.src)
    pool = importlib.import_module("treeflash.kvcache.pool")
    rows = []
    print(f"{'pool pages':>10} {'request':>8} {'mode':>9} {'allocate ms':>11} {'free ms':>8}")
    for num_pages in (1 << 14, 1 << 17, 1 << 20, 1 << 21):
        for n in (100, 8192, 131072):
            for scattered in (False, True):
                if n * 2 > num_pages or (scattered and num_pages > 1 << 20):
                    continue
                a = pool.PageAllocator(num_pages, align=64, scattered=scattered)
                others = [a.allocate(97) for _ in range(50)]  # other requests: runs in the free list
                for o in others[::2]:
                    a.free(o)
                alloc, free = [], []
                for _ in range(3):
                    t0 = time.perf_counter()
                    pages = a.allocate(n)
                    t1 = time.perf_counter()
                    a.free(pages)
                    alloc.append(t1 - t0)
                    free.append(time.perf_counter() - t1)
                row = {"num_pages": num_pages, "request_pages": n, "scattered": scattered,
                       "allocate_ms": 1e3 * statistics.median(alloc), "free_ms": 1e3 * statistics.median(free)}
                rows.append(row)
                print(f"{num_pages:>10} {n:>8} {'scattered' if scattered else 'runs':>9} "
                      f"{row['allocate_ms']:>11.3f} {row['free_ms']:>8.3f}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit, "src": args.src, "host": platform.processor() or platform.machine(),
           "python": platform.python_version(), "rows": rows,
           "note": "median of 3 allocate + free pairs a row; 50 requests of 97 pages placed first, every "
                   "other one freed (holes). No floor: the figure is host time the engine's thread "
                   "spends between two steps."}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"allocator-{datetime.date.today():%Y%m%d}{('-' + args.tag) if args.tag else ''}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
