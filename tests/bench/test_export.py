"""`bench export` writes a preset as checkpoints that load back to the same weights."""

from __future__ import annotations

import json

import pytest
import torch

from treeflash.bench.export import export_preset
from treeflash.bench.presets import build_preset, load_rig
from treeflash.cli import main


def test_export_round_trips_the_preset(tmp_path):
    cpu = torch.device("cpu")
    target, drafter = export_preset("tiny", tmp_path / "x", cpu, torch.float32, seed=3, shard_bytes=1 << 16,
                                    progress=False)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in index["weight_map"])  # HF layout
    model, draft, _ = build_preset("tiny", cpu, torch.float32, seed=3)
    rig = load_rig(str(target), str(drafter), None, cpu, torch.float32)
    for ours, theirs in ((model, rig.model), (draft, rig.drafter)):
        a, b = ours.state_dict(), theirs.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    with pytest.raises(ValueError, match="not empty"):
        export_preset("tiny", tmp_path / "x", cpu, torch.float32, progress=False)


@pytest.mark.slow
def test_exported_preset_keeps_the_planted_chain_for_oracle_runs(tmp_path, capsys):
    assert main(["bench", "export", "--preset", "tiny", "--out", str(tmp_path / "x"), "--device", "cpu",
                 "--dtype", "float32", "--no-progress"]) == 0
    out = tmp_path / "s.json"
    assert main(["bench", "sweep", "--model", str(tmp_path / "x" / "target"), "--drafter",
                 str(tmp_path / "x" / "drafter"), "--acceptance", "oracle", "--contexts", "64",
                 "--spec", "ddtree", "--max-tokens", "20", "--device", "cpu", "--dtype", "float32",
                 "--no-progress", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["mean_acceptance_length"] == pytest.approx(6.0)  # the tiny drafter's full block


@pytest.mark.slow
def test_an_int4_preset_exports_in_the_published_layout_and_loads_back(tmp_path):
    """tiny-int4's experts as compressed-tensors stores them (weight_packed, weight_scale, weight_shape),
    read back by the loader into the same packed words and scales."""
    cpu = torch.device("cpu")
    target, drafter = export_preset("tiny-int4", tmp_path / "x", cpu, torch.float32, seed=2, progress=False)
    names = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    proj = "model.layers.1.mlp.experts.3.down_proj"
    assert {f"{proj}.{f}" for f in ("weight_packed", "weight_scale", "weight_shape")} <= names.keys()
    assert f"{proj}.weight" not in names
    model, _, _ = build_preset("tiny-int4", cpu, torch.float32, seed=2)
    rig = load_rig(str(target), str(drafter), None, cpu, torch.float32)
    a, b = model.state_dict(), rig.model.state_dict()
    assert a.keys() == b.keys() and any(k.endswith("experts_down_packed") for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
