"""`treeflash bench diff`: two results side by side, point by point (bench/diff.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treeflash.bench import diff
from treeflash.cli import main

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _sweep(path: Path, gpu: str, ms: dict, page_size: int = 64) -> Path:
    runs = [{"context": c, "mode": m, "ms_per_step": v, "tok_s": 16e3 / v, "x_floor": v / 10.0}
            for (c, m), v in ms.items()]
    path.write_text(json.dumps({"meta": {"device": gpu, "commit": "abc", "date": "d"}, "preset": "kimi-k2-tp8",
                                "page_size": page_size, "scattered": False, "cuda_graphs": True,
                                "tree_budget": 31, "acceptance": "oracle", "runs": runs}))
    return path


def test_sweep_points_are_matched_and_divided(tmp_path):
    old = _sweep(tmp_path / "a.json", "H100", {(1024, "off"): 8.0, (1024, "ddtree"): 30.0, (8192, "off"): 9.0})
    new = _sweep(tmp_path / "b.json", "H100", {(1024, "off"): 6.0, (1024, "ddtree"): 33.0, (262144, "off"): 14.0})
    a, b = diff.load(old), diff.load(new)
    rows = {r["key"]: r for r in diff.rows(a, b)}
    assert set(rows) == {(1024, "off"), (1024, "ddtree")}
    assert rows[(1024, "off")]["ms_per_step"] == pytest.approx((8.0, 6.0, 0.75))
    assert rows[(1024, "ddtree")]["ms_per_step"][2] == pytest.approx(1.1)
    text = diff.report(a, b)
    assert "0.750" in text and "1.100" in text
    assert "2 points in both; 1 only in old, 1 only in new" in text
    assert "settings differ" not in text  # same GPU, preset and layout


def test_a_different_gpu_or_layout_is_said_first(tmp_path):
    old = _sweep(tmp_path / "a.json", "NVIDIA H100", {(1024, "off"): 8.0})
    new = _sweep(tmp_path / "b.json", "NVIDIA H200", {(1024, "off"): 6.0}, page_size=1)
    text = diff.report(diff.load(old), diff.load(new))
    assert "settings differ" in text
    assert "gpu: 'NVIDIA H100' -> 'NVIDIA H200'" in text and "page_size: 64 -> 1" in text


def test_kernel_grid_compare_and_prefill_rows(tmp_path):
    def kernel(path, grid_ms, cmp_ms, prefill_ms):
        shape = {"context": 65536, "n": 16, "h": 8, "tree": "chain", "page_size": 64}
        path.write_text(json.dumps({
            "gpu": "H200", "commit": "x", "date": "d",
            "grid": [dict(shape, step_ms=grid_ms, frac_floor=0.02 / grid_ms),
                     dict(shape, n=1, error="OutOfResources")],  # no figure: not a point
            "compare": [{"mode": "contiguous", "context": 32768, "n": 1, "h": 8, "tree": "chain",
                         "variants": {"v3": {"step_ms": cmp_ms, "frac_floor": 0.5},
                                      "v5": {"error": "boom"}}}],
            "prefill": [{"context": 32768, "n": 1024, "h": 64, "single_ms": prefill_ms, "frac_peak": 0.7}],
        }))
        return path

    a = diff.load(kernel(tmp_path / "a.json", 0.040, 0.030, 2.0))
    b = diff.load(kernel(tmp_path / "b.json", 0.036, 0.024, 2.5))
    assert a.kind == b.kind == "kernel" and len(a.points) == 3
    rows = {r["key"][0]: r for r in diff.rows(a, b)}
    assert rows["grid"]["step_ms"] == pytest.approx((0.040, 0.036, 0.9))
    assert rows["compare"]["key"][-1] == "v3" and rows["compare"]["step_ms"][2] == pytest.approx(0.8)
    assert rows["prefill"]["step_ms"][2] == pytest.approx(1.25)
    assert "3 points in both" in diff.report(a, b)


def test_committed_results_still_parse():
    """The format the benchmarks write today: two committed H100 sweeps of the same preset."""
    old = RESULTS / "h100-20261206-rope-in-absorb-sweep/apart1/sweep-kimi-k2-tp8-contiguous-graphs-20261206-200546.json"
    new = RESULTS / "h100-20261206-sweep-long-context/sweep-kimi-k2-tp8-contiguous-graphs-20261206-221516.json"
    a, b = diff.load(old), diff.load(new)
    keys = {r["key"] for r in diff.rows(a, b)}
    assert {(1024, "ddtree"), (131072, "off")} <= keys
    assert all(0.5 < r["ms_per_step"][2] < 2 for r in diff.rows(a, b))


def test_cli_refuses_what_it_cannot_compare(tmp_path, capsys):
    sweep = _sweep(tmp_path / "a.json", "H100", {(1024, "off"): 8.0})
    kern = tmp_path / "k.json"
    kern.write_text(json.dumps({"gpu": "H200", "grid": []}))
    text = tmp_path / "notes.md"
    text.write_text("# not json")
    for args, said in (([str(sweep), str(kern)], "is a sweep result"),
                       ([str(sweep), str(text)], "not a readable JSON file"),
                       ([str(sweep), str(tmp_path / "missing.json")], "not a readable JSON file")):
        with pytest.raises(SystemExit) as e:
            main(["bench", "diff", *args])
        assert e.value.code == 2 and said in capsys.readouterr().err
    assert main(["bench", "diff", str(sweep), str(sweep)]) == 0
    assert "1 point in both" in capsys.readouterr().out
