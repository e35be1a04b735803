"""`bench sweep --tp N`: the bench rig runs its engines through a tensor-parallel group
(each run builds a new pool, so each builds a new executor on the same group) and decodes
what one process decodes."""

from __future__ import annotations

import pytest
import torch

from treeflash.bench.presets import load_rig
from treeflash.bench.sweep import RunConfig, decode_run
from treeflash.cli import main

pytestmark = pytest.mark.slow


def decode_all(rig, context=24, tokens=12):
    rc = RunConfig([context], ["off", "ddtree"], max_tokens=tokens, fill="prefill", acceptance="drafter",
                   progress=False)
    return [decode_run(rig, context, mode, rc).token_ids for mode in ("off", "ddtree", "off")]


def test_bench_rig_under_tp2_decodes_like_one_process(target, drafter_path):
    outs = {}
    for tp, ep in ((1, 1), (2, 1), (2, 2)):
        rig = load_rig(str(target), str(drafter_path), None, torch.device("cpu"), torch.float32,
                       page_size=8, tree_budget=8, tp=tp, ep=ep)
        followers = list(rig.dist.followers) if rig.dist is not None else []
        try:
            outs[tp, ep] = decode_all(rig)
            if ep == 2:  # per-rank MoE load under expert parallelism reaches the samples
                run = decode_run(rig, 24, "off", RunConfig([24], ["off"], max_tokens=4, fill="prefill", progress=False))
                assert all(s.rank_max_over_mean >= 1.0 for s in run.samples)
        finally:
            rig.close()
        assert all(p.exitcode == 0 for p in followers)
    assert outs[2, 1] == outs[1, 1] and outs[2, 2] == outs[1, 1]
    assert outs[1, 1][0] == outs[1, 1][1] == outs[1, 1][2]  # speculation is lossless here too


def test_bench_sweep_refuses_tp_on_presets_and_graphs(capsys):
    for argv, words in [(["--preset", "tiny", "--tp", "2"], "need a checkpoint"),
                        (["--tp", "2", "--cuda-graphs"], "--tp 1")]:
        with pytest.raises(SystemExit) as e:
            main(["bench", "sweep", "--device", "cpu", *argv])
        assert e.value.code == 2 and words in capsys.readouterr().err


def test_doctor_runs_its_checks_over_a_tp2_group(target, drafter_path, capsys):
    rc = main(["doctor", "--model", str(target), "--drafter", str(drafter_path), "--tp", "2", "--device", "cpu",
               "--dtype", "float32", "--context", "40", "--page-size", "8", "--tree-budget", "8"])
    out = capsys.readouterr().out
    assert "(tp 2, ep 1)" in out and "crashed" not in out, out
    assert "PASS  metric_invariants" in out and "PASS  acceptance_oracle" in out, out
    assert rc in (0, 1)


def test_sweep_over_tp2_on_an_exported_preset_times_the_all_reduces(tmp_path, capsys):
    assert main(["bench", "export", "--preset", "tiny", "--out", str(tmp_path / "x"), "--device", "cpu",
                 "--dtype", "float32", "--no-progress"]) == 0
    out = tmp_path / "s.json"
    assert main(["bench", "sweep", "--model", str(tmp_path / "x" / "target"), "--drafter",
                 str(tmp_path / "x" / "drafter"), "--acceptance", "oracle", "--contexts", "64", "--tp", "2",
                 "--spec", "off", "--max-tokens", "12", "--device", "cpu", "--dtype", "float32",
                 "--no-progress", "--out", str(out)]) == 0
    import json

    res = json.loads(out.read_text())
    assert res["tp"] == 2 and res["runs"][0]["parts"]["all_reduce"]["ms_measured"] > 0
    assert "all-reduce per step" in capsys.readouterr().out
