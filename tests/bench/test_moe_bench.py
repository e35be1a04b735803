"""`treeflash bench moe` end to end on the CPU (Triton interpreter, tiny geometry): the JSON holds
every figure beside its floor, the checks pass, humming is reported as unavailable here; the
floor arithmetic at Kimi K2 TP8 geometry."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from treeflash.bench.moe import Geometry  # noqa: E402
from treeflash.cli import main  # noqa: E402


@pytest.mark.slow
def test_bench_moe_runs_on_cpu_and_writes_its_json(tmp_path, capsys):
    out = tmp_path / "moe.json"
    rc = main(["bench", "moe", "--device", "cpu", "--experts", "8", "--top-k", "2", "--hidden", "64", "--inter", "32",
               "--shared-inter", "32", "--rows", "2", "--layers", "2", "--bf16-layers", "1", "--calls", "1",
               "--replays", "1", "--mma-tiles", "8:16:16:1:1:1", "--splits", "2", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "check: all ok" in text and "us per MoE layer" in text
    res = json.loads(out.read_text())
    for key in ("gpu", "date", "commit", "torch", "triton", "switches", "geometry", "expert_bytes", "floor"):
        assert key in res, key
    assert res["ceilings"]["bytes_per_s"] > 0 and res["ceilings"]["flops_per_s"] > 0
    assert "unavailable" in res["humming"]
    (row,) = res["rows"]
    assert row["rows"] == 2 and row["pairs"] == 4 and 2 <= row["touched"] <= 4
    for key in ("bytes_int4", "bytes_bf16", "flops", "byte_floor_int4_us", "byte_floor_bf16_us", "matmul_floor_us"):
        assert row[key] > 0, key
    assert row["floor_int4_us"] == max(row["byte_floor_int4_us"], row["matmul_floor_us"])
    assert set(row["variants"]) == {"bf16", "portable", "mma", "mma 8:16:16:1:1:1", "mma split 2"}
    for name, v in row["variants"].items():
        assert v["ok"] and v["check"]["ok"] and v["check_after"]["ok"], name
        assert v["us"] > 0 and abs(v["frac_floor"] - (row["floor_bf16_us"] if name == "bf16" else
                                                      row["floor_int4_us"]) / v["us"]) < 1e-9
    assert row["variants"]["mma split 2"]["split"] == 2
    assert row["best_w4a16"].startswith(("portable", "mma")) and row["best_w4a16_us"] > 0


def test_kimi_tp8_floor_arithmetic():
    """An INT4 expert at Kimi K2 TP8 is 3 x 256 x 7168 weights at half a byte plus one bf16 scale a
    32 (3,096,576 bytes, 0.5625 a weight); bf16 is 11,010,048 bytes; one decode row's flops are
    2 x (8 + 1) x 3 x 256 x 7168."""
    geo = Geometry(384, 8, 7168, 256, 256, 32)
    assert geo.int4_expert_bytes() == 3096576 == 0.5625 * 3 * 256 * 7168
    assert geo.bf16_expert_bytes() == geo.shared_bytes() == 11010048
    assert geo.flops(1) == 2 * 9 * 3 * 256 * 7168
