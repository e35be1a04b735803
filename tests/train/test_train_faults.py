"""`treeflash train target|drafter` runs that go wrong midway: a diverging loss stops at its
step with one line on stderr, and checkpoint.pt on disk only ever holds finite weights; Ctrl-C
saves the step reached, and --resume carries on as if nothing had happened."""

from __future__ import annotations

import math
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from helpers.train import TINY_D, TINY_T, tiny_target
from treeflash.train.cli import main

pytestmark = pytest.mark.slow


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


def _ctrl_c(monkeypatch, stage: str, where: str, at_call: int) -> None:
    """Ctrl-C during the `at_call`-th step: raised from its forward pass, or a real SIGINT sent
    from inside its optimizer update (after the weights changed, before the step was counted)."""
    import treeflash.train.drafter as drafter
    import treeflash.train.target as target

    module, name = (target, "lm_loss") if stage == "target" else (drafter, "draft_logits")
    if where == "update":
        module, name = torch.optim.AdamW, "step"
    original = getattr(module, name)
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call and where == "forward":
            raise KeyboardInterrupt
        result = original(*args, **kwargs)
        if len(calls) == at_call:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(module, name, interrupted)


@pytest.mark.parametrize("where, saved_step", [("forward", 2), ("update", 3)])
@pytest.mark.parametrize("stage", ["target", "drafter"])
def test_ctrl_c_saves_the_step_reached_and_resume_continues_it(run, tmp_path, capsys, monkeypatch, stage, where,
                                                                 saved_step):
    # Ctrl-C used to end the run with a traceback and lose every step since the last periodic save
    # (here: all of them, --save-every 100)
    argv = _train(run, stage, tmp_path / "whole", "--steps", "4", "--save-every", "100", "--eval-every", "100")
    assert main(argv) == 0
    whole = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)
    out = tmp_path / "cut"
    argv = _train(run, stage, out, "--steps", "4", "--save-every", "100", "--eval-every", "100")
    capsys.readouterr()
    with monkeypatch.context() as m:
        _ctrl_c(m, stage, where, at_call=3)
        try:
            code = main(argv)
        except KeyboardInterrupt:
            pytest.fail("KeyboardInterrupt escaped `treeflash train`: nothing saved, no exit code")
    assert code == 130
    assert _one_line_error(capsys) == (
        f"treeflash train {stage}: interrupted at step {saved_step}: saved {out / 'checkpoint.pt'}; to continue, "
        "run the same command with --resume")
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == saved_step
    assert not (out / "model.safetensors").exists()
    assert main([*argv, "--resume"]) == 0
    assert f"at step {saved_step}" in capsys.readouterr().out
    resumed = torch.load(out / "checkpoint.pt", weights_only=True)
    assert resumed["step"] == 4
    # the same weights as the run never interrupted: same batches (the interrupted step's is drawn
    # again), and an update is never half-counted
    assert resumed["model"].keys() == whole["model"].keys()
    for k, v in whole["model"].items():
        assert torch.equal(resumed["model"][k], v), k
