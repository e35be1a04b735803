"""The auto budget on a preset whose steps the sweep extrapolates to the real layer count (the
kimi presets on CUDA), run as `bench sweep` runs it: warm-up of every plan, an untimed request,
then the timed one with the warm sizer, under declared acceptance (`DeclaredDrafter`).

The H100 run of 2026-12-07 (results/h100-20261207-spec-cost-3) had auto verify the drafter's
depth (15 on kimi-k2-tp8, 7 on kimi-k2.6-tp8) every step at acceptance 0, 1 and 3: the
extrapolation added every CUDA-graph replay since the sweep's last mark to each warm-up step,
so the plain plans, warmed last, were priced at tens of steps' device time and every tree was
clamped up to that price. CUDA graphs are stood in for by a runner whose replays "take" a
declared device time per forward, A x (1 + D + R x (rows per request - 1)) with a tree (D: the
drafter's share), A without, made 63x by the extrapolation: a minute a step, so that the
rule's choices follow that cost curve and not this shared CPU's wall-time swings (0.05-0.6 s a
step under load). D = 0.16, R = 0.12: the kimi-k2-tp8 preset's steps at 1k on the H100
(extrapolated, over spec off's: budget 1 1.28x, 3 1.60x, 15 3.36x; this model: 1.28x, 1.52x,
2.96x). On 94c3807 (main before the fix) acceptance 0 and 1 ran budget 7 every step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from treeflash.bench import sweep
from treeflash.bench.presets import DeclaredDrafter, load_rig
from treeflash.speculative import overlap

A_S, D, R = 1.0, 0.16, 0.12  # declared seconds of a one-row forward; a tree's drafter, each further row: x A_S
SCALE = 64  # the real model's layers over the built ones


class DeclaredReplays:
    """The engine's CUDA-graph runner as the sweep reads it (`mode`, `time_replays`,
    `mark_replays`, `replays_s`): each target forward since the mark counts its declared seconds."""

    mode = "cuda"

    def __init__(self, model: torch.nn.Module):
        self.time_replays, self.s = False, 0.0
        model.register_forward_pre_hook(self._forward)

    def _forward(self, module, args) -> None:
        rows = args[0].shape[1]
        self.s += A_S * (1 + (D + R * (rows - 1) if rows > 1 else 0.0))

    def mark_replays(self) -> None:
        self.s = 0.0

    def replays_s(self) -> float:
        return self.s


@pytest.fixture(scope="module")
def rig():
    r = load_rig(None, None, "tiny", torch.device("cpu"), torch.float32)
    r.cuda_graphs = True
    r.preset = dataclasses.replace(r.preset, full_layers=r.preset.full_layers * SCALE)
    return r


def _auto_steps(rig, monkeypatch, acceptance: str, overlapped: bool) -> tuple[dict, int]:
    """bench sweep's auto run at context 128: (steps by budget, plain steps) of the timed request."""
    replays = DeclaredReplays(rig.model)
    monkeypatch.setattr(sweep, "_cuda_graphs", lambda engine: replays)
    monkeypatch.setattr(overlap, "OVERLAP", overlapped)
    rc = sweep.RunConfig([128], ["off", "ddtree"], 40, "random", acceptance, 0, False, budgets=["auto"],
                         acceptances=[acceptance])
    reference = sweep.decode_run(rig, 128, "off", rc, tokens=40 + rig.drafter.block_size + 1).token_ids
    drafter = DeclaredDrafter(rig.drafter, reference, 128, None if acceptance == "oracle" else int(acceptance))
    warm = sweep.decode_run(rig, 128, "ddtree", rc, drafter=drafter, budget="auto", tokens=16,
                            acceptance=acceptance)
    run = sweep.decode_run(rig, 128, "ddtree", rc, drafter=drafter, budget="auto", sizer=warm.spec.sizer,
                           acceptance=acceptance)
    assert run.spec.step_clock is not None  # the extrapolation is on
    return {int(k): v for k, v in run.metrics.steps_by_budget.items()}, run.metrics.num_plain_steps


def test_always_wrong_drafter_decodes_plainly(rig, monkeypatch):
    steps, plain = _auto_steps(rig, monkeypatch, "0", overlapped=True)
    trees = sum(steps.values())
    assert plain >= 30 and trees <= 3 and set(steps) <= {1}, (steps, plain)


@pytest.mark.parametrize("acceptance, budgets", [("1", (1, 3)), ("3", (3,))])
def test_a_few_right_depths_verify_small_trees(rig, monkeypatch, acceptance, budgets):
    steps, plain = _auto_steps(rig, monkeypatch, acceptance, overlapped=False)
    small = sum(v for b, v in steps.items() if b in budgets)
    assert small >= 0.75 * (sum(steps.values()) + plain), (steps, plain)


def test_full_acceptance_verifies_the_drafters_depth(rig, monkeypatch):
    steps, plain = _auto_steps(rig, monkeypatch, "oracle", overlapped=True)
    depth = rig.drafter.block_size - 1  # 5: bucket 7 holds a chain of every depth
    deep = sum(v for b, v in steps.items() if b >= depth)
    assert plain <= 2 and deep >= 0.75 * sum(steps.values()), (steps, plain)
