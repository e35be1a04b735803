"""`treeflash train target|drafter` runs that go wrong midway: a diverging loss stops at its
step with one line on stderr, and checkpoint.pt on disk only ever holds finite weights."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from train_helpers import TINY_D, TINY_T, tiny_target
from treeflash.train.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    tiny_target(root, steps=1)
    return root


def _train(run: Path, stage: str, out: Path, *extra: str) -> list[str]:
    if stage == "target":
        return ["target", "--data", str(run / "tok"), "--out", str(out), *TINY_T, "--eval-batches", "1", *extra]
    return ["drafter", "--data", str(run / "tok"), "--target", str(run / "target"), "--out", str(out), *TINY_D,
            "--eval-batches", "1", *extra]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]  # after transformers' "Loading weights" bar, if any


def _finite(state: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())


@pytest.mark.parametrize("stage", ["target", "drafter"])
def test_diverging_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint(run, tmp_path, capsys, stage):
    # --lr 1e6 is finite, so it passes validate(); after 2-3 steps the gradient norm is NaN (the
    # loss still finite). That update used to make every weight NaN, the periodic save wrote them over
    # the good checkpoint, and the next step ended in a RuntimeError traceback.
    out = tmp_path / stage
    argv = _train(run, stage, out, "--lr", "1e6", "--warmup-steps", "0", "--steps", "20", "--save-every", "1",
                  "--eval-every", "100")
    assert main(argv) == 1
    line = _one_line_error(capsys)
    m = re.fullmatch(rf"treeflash train {stage}: error: training diverged at step (\d+): loss (\S+), gradient norm "
                     rf"(\S+) at lr \S+; the step was not applied and {out / 'checkpoint.pt'} is left as it "
                     r"was: lower --lr, or check --data", line)
    assert m, line
    step, loss, gnorm = int(m[1]), float(m[2]), float(m[3])
    assert step > 1 and not (math.isfinite(loss) and math.isfinite(gnorm))
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["step"] == step - 1 and _finite(state["model"]) and _finite(state["optimizer"]["state"][0])
    assert not (out / "model.safetensors").exists()  # nothing exported from a diverged run


@pytest.mark.parametrize("stage", ["target", "drafter"])
def test_non_finite_weights_are_never_saved(run, tmp_path, capsys, monkeypatch, stage):
    # the last resort behind the loss and gradient-norm check: an update from finite gradients that
    # still leaves a weight non-finite (here injected after the second step) is not written to disk
    adamw_step = torch.optim.AdamW.step
    calls = []

    def step_then_poison(self, *args, **kwargs):
        result = adamw_step(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = math.inf
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_poison)
    out = tmp_path / stage
    assert main(_train(run, stage, out, "--steps", "4", "--save-every", "1", "--eval-every", "100")) == 1
    assert _one_line_error(capsys) == (
        f"treeflash train {stage}: error: training diverged at step 2: its update left non-finite weights, "
        f"so {out / 'checkpoint.pt'} was not written: lower --lr, or check --data")
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["step"] == 1 and _finite(state["model"])
