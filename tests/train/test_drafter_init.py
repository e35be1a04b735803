"""The drafter-retraining path (scripts/retrain_drafter.sh) on tiny CPU runs:

- `treeflash train tokenizer --tokenizer PATH` reuses a tokenizer byte for byte and encodes
  the same corpus with the same train/held-out split (token ids match the shipped target);
- `treeflash train drafter --init DIR` starts from DIR's weights (fresh optimizer and LR
  schedule), refuses a drafter of another shape with a clear error, and leaves --resume alone.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from helpers.train import TINY_D as TINY_D_BASE
from helpers.train import tiny_target
from treeflash.train.cli import main

pytestmark = pytest.mark.slow

STDLIB = Path(sysconfig.get_paths()["stdlib"])
ASSETS = Path(__file__).resolve().parents[2] / "src" / "treeflash" / "assets"
TINY_D = [*TINY_D_BASE, "--eval-batches", "1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("init")
    tiny_target(root, steps=2)
    # drafter A: trained from scratch with a large lr, so its weights are far from a fresh init
    assert main(["drafter", "--data", str(root / "tok"), "--target", str(root / "target"), "--out",
                 str(root / "a"), *TINY_D, "--steps", "40", "--lr", "1e-2", "--warmup-steps", "1",
                 "--eval-every", "40"]) == 0
    # drafter B: starts from A's weights
    assert main(["drafter", "--data", str(root / "tok"), "--target", str(root / "target"), "--out",
                 str(root / "b"), *TINY_D, "--steps", "2", "--eval-every", "2", "--seed", "1",
                 "--init", str(root / "a")]) == 0
    return root


def test_reused_tokenizer_gives_the_same_ids_and_split(run, tmp_path):
    corpus = run / "corpus"
    assert main(["tokenizer", "--out", str(tmp_path / "tok2"), "--corpus", str(corpus), "--heldout-percent", "20",
                 "--tokenizer", str(run / "tok"), "--sample-bytes", "1k"]) == 0
    a, b = run / "tok", tmp_path / "tok2"
    for name in ("tokenizer.json", "tokenizer_config.json", "data/train.bin", "data/heldout.bin",
                 "data/heldout_files.jsonl"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ma, mb = (json.loads((d / "data" / "manifest.json").read_text()) for d in (a, b))
    assert mb["tokenizer_source"] == str((a / "tokenizer.json").resolve()) and ma["tokenizer_source"] is None
    assert ma["tokenizer_sha256"] == mb["tokenizer_sha256"] and mb["sample_bytes"] is None
    assert ma["tokens"] == mb["tokens"] and ma["heldout_files"] == mb["heldout_files"]


def test_reused_tokenizer_errors(run, tmp_path, capsys):
    corpus = str(run / "corpus")
    assert main(["tokenizer", "--out", str(tmp_path / "x"), "--corpus", corpus, "--tokenizer", str(run / "tok"),
                 "--vocab-size", "4096"]) == 2
    assert "--vocab-size 4096 but --tokenizer" in capsys.readouterr().err
    assert main(["tokenizer", "--out", str(tmp_path / "y"), "--corpus", corpus, "--tokenizer",
                 str(tmp_path / "none.json")]) == 2
    assert "not found" in capsys.readouterr().err
    # the shipped target's tokenizer can be reused (what scripts/retrain_drafter.sh does)
    assert main(["tokenizer", "--out", str(tmp_path / "z"), "--corpus", corpus, "--heldout-percent", "20",
                 "--tokenizer", str(ASSETS / "target"), "--max-bytes", "50k"]) == 0
    assert (tmp_path / "z" / "tokenizer.json").read_bytes() == (ASSETS / "target" / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "z" / "data" / "manifest.json").read_text())["vocab_size"] == 4096


def test_init_starts_from_the_saved_weights(run):
    from treeflash.train.corpus import TokenData, fixed_windows
    from treeflash.train.drafter import (
        DRAFTER_PRESETS,
        DrafterTrainArgs,
        build_drafter,
        drafter_eval,
        load_drafter,
        load_init_weights,
    )
    from treeflash.train.target import load_target

    target = load_target(run / "target")
    saved = load_drafter(run / "a")
    fresh = build_drafter(DRAFTER_PRESETS["tiny"], target, 3)
    assert any(not torch.equal(p, saved.state_dict()[k]) for k, p in fresh.state_dict().items())
    load_init_weights(fresh, run / "a", "tiny")
    for k, p in fresh.state_dict().items():
        assert p.dtype == torch.float32 and torch.equal(p, saved.state_dict()[k]), k

    # the --init run's step-0 held-out eval is the saved drafter's, not a fresh one's
    mb = json.loads((run / "b" / "train_metrics.json").read_text())
    assert mb["init"] == str(run / "a") and mb["steps"] == 2
    args = DrafterTrainArgs(data=str(run / "tok"), target=str(run / "target"), out="-", preset="tiny",
                            seq_len=96, anchors=8, eval_batches=1)
    windows = fixed_windows(TokenData.load(run / "tok").heldout, 1, 96)
    ev_saved = drafter_eval(saved, target, windows, saved.target_layer_ids, args, torch.device("cpu"))
    ev_fresh = drafter_eval(build_drafter(DRAFTER_PRESETS["tiny"], target, 3), target, windows,
                            saved.target_layer_ids, args, torch.device("cpu"))
    assert mb["init_heldout"]["loss"] == pytest.approx(ev_saved["loss"], abs=2e-4)
    assert abs(ev_fresh["loss"] - ev_saved["loss"]) > 0.01  # the check above tells them apart (~0.06 here)
    ck = torch.load(run / "b" / "checkpoint.pt", weights_only=True)
    assert ck["step"] == 2 and ck["args"]["init"] == str(run / "a")
    assert len(ck["optimizer"]["state"]) > 0 and all(s["step"] == 2 for s in ck["optimizer"]["state"].values())


def test_init_with_resume_continues_the_checkpoint(run):
    before = torch.load(run / "b" / "checkpoint.pt", weights_only=True)["model"]
    assert main(["drafter", "--data", str(run / "tok"), "--target", str(run / "target"), "--out",
                 str(run / "b"), *TINY_D, "--steps", "3", "--eval-every", "3", "--seed", "1",
                 "--init", str(run / "a"), "--resume"]) == 0
    ck = torch.load(run / "b" / "checkpoint.pt", weights_only=True)
    assert ck["step"] == 3 and [h["step"] for h in ck["history"]] == [2, 3]
    assert any(not torch.equal(before[k], v) for k, v in ck["model"].items())


def test_init_shape_mismatch_is_a_clear_error(run, tmp_path, capsys):
    common = ["drafter", "--data", str(run / "tok"), "--target", str(run / "target"), *TINY_D, "--steps", "1"]
    # the shipped (small) drafter cannot seed a tiny one
    assert main([*common, "--out", str(tmp_path / "c"), "--init", str(ASSETS / "drafter")]) == 2
    err = capsys.readouterr().err
    assert "does not match --preset tiny" in err and "hidden_size: 256 vs 32" in err
    assert "dflash_config.block_size: 16 vs 4" in err
    assert not (tmp_path / "c" / "checkpoint.pt").exists()
    # same config, weights of another shape
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(run / "a" / "config.json", bad / "config.json")
    shutil.copy(ASSETS / "drafter" / "model.safetensors", bad / "model.safetensors")
    assert main([*common, "--out", str(tmp_path / "d"), "--init", str(bad)]) == 2
    assert "weights do not fit the model" in capsys.readouterr().err
    # not a drafter folder at all
    assert main([*common, "--out", str(tmp_path / "e"), "--init", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "--init" in err and "no config.json" in err
