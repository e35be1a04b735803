"""The acceptance-0 plain-step bar of the budget table (bench/compare.py) and its line in
benchmarks/spec_cost_summary.py: auto's untapped plain step against spec off's step, medians by
forward, extrapolated as the tok/s figures are, at most 1 / 0.95."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from treeflash.bench import compare
from treeflash.bench.sweep import StepSample

SUMMARY = Path(__file__).resolve().parents[2] / "benchmarks" / "spec_cost_summary.py"


def _sample(wall_ms: float, forward: str | None, graph_ms: float = 0.0, hooked: bool = False) -> StepSample:
    return StepSample(wall_ms / 1e3, 1, 0, 0, None, graph_s=graph_ms / 1e3, plain_forward=forward, hooked=hooked)


def test_plain_step_ms_is_the_median_by_forward_extrapolated():
    samples = [_sample(1.0, "untapped", 0.5), _sample(3.0, "untapped", 0.5), _sample(2.0, "untapped", 0.5),
               _sample(9.0, "untapped", 0.5, hooked=True), _sample(4.0, "tapped", 1.0), _sample(7.0, None)]
    got = compare.plain_step_ms(samples, scale=4.0)
    assert set(got) == {"untapped", "tapped"}
    assert got["untapped"] == {"steps": 3, "measured": pytest.approx(2.0), "full": pytest.approx(2.0 + 3 * 0.5)}
    assert got["tapped"]["full"] == pytest.approx(4.0 + 3 * 1.0)


def _runs(untapped_full: float, acceptance: str = "0") -> dict:
    off = {"mode": "off", "context": 1024, "tok_s_mean": 100.0,
           "plain_step_ms": {"off": {"steps": 60, "measured": 1.0, "full": 10.0}}}
    auto = {"mode": "ddtree-auto", "spec": "ddtree", "tree_budget": "auto", "acceptance": acceptance,
            "context": 1024, "tok_s_mean": 96.0, "captures_timed": 0,
            "plain_step_ms": {"untapped": {"steps": 50, "measured": 1.3, "full": untapped_full},
                              "tapped": {"steps": 16, "measured": 1.6, "full": 11.0}}}
    return {"runs": [off, auto]}


@pytest.mark.parametrize("untapped_full, ok", [(10.2, True), (10.6, False)])
def test_acceptance_0_has_the_plain_step_bar(untapped_full, ok):
    row, = compare.comparison(_runs(untapped_full))
    bar = row["bar"]["plain_step"]
    assert bar["op"] == "<=" and bar["bar"] == compare.BAR_PLAIN_STEP_AT_ZERO == 1.05
    assert bar["ratio"] == pytest.approx(untapped_full / 10.0) and bar["pass"] is ok
    assert row["plain_step_over_off"]["tapped"]["measured"] == pytest.approx(1.6)
    assert row["bar"]["off"]["op"] == ">=" and row["bar"]["off"]["pass"]  # 96 / 100
    assert "plain_step" not in compare.comparison(_runs(untapped_full, "3"))[0]["bar"]
    assert "untapped plain step <= 1.05" in compare.table([row])


def test_the_summary_prints_the_plain_step_row(tmp_path):
    spec = importlib.util.spec_from_file_location("spec_cost_summary", SUMMARY)
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    path = tmp_path / "4-kimi-k2-tp8-spells.json"
    path.write_text(json.dumps(_runs(10.6)))
    rows = summary.sweep_rows(path, "kimi-k2-tp8-spells")
    line = next(r for r in rows if r[2].startswith("auto's untapped plain step"))
    assert line[3:5] == ["1.06", "<= 1.05"] and line[5].startswith("FAIL")
    assert "untapped 1.060 (measured 1.300, 50 steps)" in line[5] and "tapped 1.100" in line[5]
