"""benchmarks/lab/edges_v5.py's per-call figures from synthetic %globaltimer stamps."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _edges_module():
    spec = importlib.util.spec_from_file_location("edges_v5", ROOT / "benchmarks" / "lab" / "edges_v5.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stats_from_synthetic_stamps():
    """5 calls of 4 CTAs, 10 us apart: entries 0 / 100 / 200 / 300 ns after the call's start,
    partitions 500 ns after entry, bodies 6 / 6 / 6 / 7 us; the figures follow exactly."""
    stats = _edges_module()._stats
    layers, ctas = 5, 4
    ed = torch.zeros(layers, ctas, 4, dtype=torch.int64)
    for k in range(layers):
        t0 = 1_000_000 + k * 10_000
        for c in range(ctas):
            entry = t0 + 100 * c
            body = 7_000 if c == 3 else 6_000
            ed[k, c] = torch.tensor([entry, entry + 500, entry + 500 + body, c])
    s = stats(ed, layers)
    assert s["period"] == pytest.approx(10.0)
    assert s["entry_spread"] == pytest.approx(0.3)
    assert s["prologue"] == pytest.approx(0.5)
    assert s["body_med"] == pytest.approx(6.0)  # torch's median: the lower of the middle two
    assert s["body_max"] == pytest.approx(7.0)
    assert s["span"] == pytest.approx(0.3 + 0.5 + 7.0)
    assert s["between"] == pytest.approx(10.0 - 7.8)
    assert s["late_exit_entry_offset"] == pytest.approx(0.3)
    # the latest exit (CTA 3: 7.8 us) less the median exit (torch's lower middle: CTA 1, 6.6 us)
    assert s["exit_spread"] == pytest.approx(7.8 - 6.6)
