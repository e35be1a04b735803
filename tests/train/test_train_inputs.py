"""`treeflash train drafter` on bad inputs: each is one line on stderr and exit code 2, found
before the training it would waste, and never leaves a broken file behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from train_helpers import tiny_tokenized
from treeflash.train.cli import main

ASSETS = Path(__file__).resolve().parents[2] / "src" / "treeflash" / "assets"
TINY_D = ["--preset", "tiny", "--seq-len", "96", "--batch-size", "2", "--anchors", "8", "--no-progress",
          "--device", "cpu", "--eval-batches", "1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    tiny_tokenized(root)
    assert main(["target", "--data", str(root / "tok"), "--out", str(root / "target"), "--preset", "tiny",
                 "--seq-len", "96", "--batch-size", "2", "--no-progress", "--device", "cpu", "--steps", "1",
                 "--eval-batches", "1"]) == 0
    return root


def _drafter(run: Path, out: Path, *extra: str, target: Path | None = None, data: Path | None = None) -> list[str]:
    return ["drafter", "--data", str(data or run / "tok"), "--target", str(target or run / "target"),
            "--out", str(out), *TINY_D, "--steps", "1", *extra]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def _not_a_target(run: Path, tmp: Path, kind: str) -> Path:
    if kind == "drafter folder":
        return ASSETS / "drafter"
    d = tmp / kind.replace(" ", "_")
    d.mkdir()
    if kind == "bad json":
        (d / "config.json").write_text("{")
        return d
    shutil.copy(run / "target" / "config.json", d / "config.json")
    if kind == "truncated weights":
        (d / "model.safetensors").write_bytes((run / "target" / "model.safetensors").read_bytes()[:5000])
    elif kind == "weights of another model":
        shutil.copy(ASSETS / "target" / "model.safetensors", d / "model.safetensors")
    return d


@pytest.mark.parametrize("kind, message", [
    ("drafter folder", "model_type 'qwen3', expected a DeepSeek-V3 target"),
    ("bad json", "cannot read config.json"),
    ("config only", "cannot load the model"),
    ("truncated weights", "cannot load the model"),
    ("weights of another model", "cannot load the model"),
])
def test_target_that_is_not_a_model(run, tmp_path, capsys, kind, message):
    target = _not_a_target(run, tmp_path, kind)
    assert main(_drafter(run, tmp_path / "d", target=target)) == 2
    line = _one_line_error(capsys)
    assert line.startswith("treeflash train drafter: error: target ") and message in line
