"""Helpers the benchmark scripts in this folder share (run as scripts, so this folder is on
sys.path): a CUDA-graph timer and the JSON result file every script writes."""

from __future__ import annotations

import datetime
import json
import statistics
import sys
from pathlib import Path

import torch


def graph_us(fn, calls: int = 50, reps: int = 7) -> float:
    """Median us per call of `fn` replayed `calls` times inside one CUDA graph (`reps` replays)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return replay_us(g, reps, calls)


def replay_us(graph, reps: int, calls: int) -> float:
    """Median over `reps` replays of `graph` of its time in us divided by `calls`."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def finish_checks(out: str | None, stem: str, rows: list, fails: list[str], argv, **meta) -> int:
    """A checking script's end: `write_rows` with the failures and the command that ran (the
    script's name and its arguments), the verdict line; the exit status (1 if a check failed)."""
    script = Path(sys.argv[0]).name
    write_rows(out, stem, rows, fails=fails, **meta,
               command=f"python benchmarks/{script} " + " ".join(argv or sys.argv[1:]))
    print("FAILED: " + "; ".join(fails) if fails else "all checks ok")
    return 1 if fails else 0


def write_rows(out: str | None, stem: str, rows: list, **meta) -> Path | None:
    """OUT/<stem>-<date>.json with the GPU, the date, the commit, `meta` and the rows; None and
    nothing written without `out`."""
    from treeflash import knobs
    from treeflash.bench.sweep import git_commit

    if not out:
        return None
    doc = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": git_commit(),
           "switches": knobs.switched(), **meta,
           "rows": rows}
    path = Path(out) / f"{stem}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return path


def busy_and_gaps(intervals) -> tuple[float, list[float]]:
    """intervals: (start, end) pairs sorted by start. The length of their union and the idle
    gaps between its pieces (same units as the input)."""
    busy, gaps = 0.0, []
    cur_s, cur_e = intervals[0]
    for s, t in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    return busy + cur_e - cur_s, gaps
