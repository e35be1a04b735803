"""`bench sweep --dcp-model N`: a single-device preset models one rank of a decode-context-parallel
group (its 1/N share of the cache, N x its heads, the LSE merge, plus a declared collective latency
a layer), and the DCP flags are checked before anything runs."""

from __future__ import annotations

import json

import pytest

from helpers.scripts import load_benchmark_script
from treeflash.cli import main

SWEEP = ["bench", "sweep", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--contexts", "1k,3k",
         "--speculative-algorithm", "NONE,DDTREE", "--max-tokens", "8", "--acceptance", "oracle", "--no-progress",
         "--page-size", "16"]


def sweep(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    assert main([*SWEEP, "--out", str(out), "--plot", str(tmp_path / f"{name}.png"), *extra]) == 0
    return json.loads(out.read_text())


def test_modelled_dcp_rank_reads_its_share_and_pays_the_declared_collectives(tmp_path):
    one = sweep(tmp_path, "one")
    four = sweep(tmp_path, "four", "--dcp-model", "4", "--dcp-collective-us", "25")
    assert (one["dcp"], four["dcp"], four["dcp_modelled"]) == (1, 4, True)
    # benchmarks/dcp_model_table.py composes the DCP N step from a DCP 1 sweep's
    table = load_benchmark_script("dcp_model_table")
    assert set(table.SWEEP_FIELDS) <= one.keys() and all(set(table.SWEEP_RUN_FIELDS) <= r.keys() for r in one["runs"])
    for a, b in zip(one["runs"], four["runs"], strict=True):
        assert (a["context"], a["mode"]) == (b["context"], b["mode"])
        assert "dcp" not in a
        d = b["dcp"]
        assert d["size"] == 4 and d["collectives_ms"] == pytest.approx(b["layers_reported"] * 25e-3)
        # the rank's attention floor: a quarter of the latent bytes, the same flops (4x heads, 1/4 keys)
        att1, att4 = a["floors"]["attention"], b["floors"]["attention"]
        assert att4["bytes"] == pytest.approx(att1["bytes"] / 4, rel=1e-3)
        assert att4["flops"] == pytest.approx(att1["flops"], rel=1e-3)
        assert b["ms_per_step"] >= b["ms_per_step_measured"] + d["collectives_ms"] - 1e-9
        assert d["attention_floor_us_per_layer"] > 0
        if b["mode"] == "off":  # (plain decode's later steps are instrumented; a short oracle tree run has none)
            assert d["attention_us_per_layer"] > 0


@pytest.mark.parametrize("argv, words", [
    (["--preset", "tiny", "--dcp-model", "2"], "--dcp-collective-us"),
    (["--dcp-model", "2", "--dcp-collective-us", "5"], "on a preset"),
    (["--preset", "tiny", "--dcp-collective-us", "5"], "is for --dcp-model"),
    (["--preset", "tiny", "--dcp-model", "2", "--dcp-collective-us", "5", "--cuda-graphs"], "runs eager"),
    (["--tp", "4", "--dcp", "3"], "--dcp 3 must divide --tp 4"),
    (["--preset", "tiny", "--dcp", "2", "--tp", "2"], "need a checkpoint"),
])
def test_dcp_flags_are_refused_with_the_reason(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "sweep", "--device", "cpu", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err

