"""The TREEFLASH_* environment variables: one registry, checked values, reported by the CLI and doctor."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from treeflash import cli, doctor, knobs

SRC = Path(knobs.__file__).parent


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in [k for k in os.environ if k.startswith(knobs.PREFIX)]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    monkeypatch.delenv("PYTORCH_NO_CUDA_MEMORY_CACHING", raising=False)


def test_every_variable_the_code_reads_is_registered_and_every_knob_is_read():
    used = {}
    for path in SRC.rglob("*.py"):
        if path.name != "knobs.py":
            for name in re.findall(r"TREEFLASH_[A-Z0-9_]+", path.read_text()):
                used.setdefault(name, path.relative_to(SRC))
    assert not {n: str(p) for n, p in used.items() if n not in knobs.KNOBS}, "unregistered"
    assert set(knobs.KNOBS) <= set(used), set(knobs.KNOBS) - set(used)


def test_every_variable_is_documented_in_the_readme():
    """An environment variable is for a user or an operator: each one is in the README."""
    readme = (SRC.parents[1] / "README.md").read_text()
    assert not [name for name in knobs.KNOBS if name not in readme]


def test_get_gives_the_default_when_unset_or_empty_and_rejects_other_values(monkeypatch):
    assert knobs.get("TREEFLASH_VERIFY_KERNEL") == "auto" and knobs.get("TREEFLASH_W4A16_MMA") is None
    monkeypatch.setenv("TREEFLASH_VERIFY_KERNEL", "")
    assert knobs.get("TREEFLASH_VERIFY_KERNEL") == "auto" and not knobs.is_set("TREEFLASH_VERIFY_KERNEL", "portable")
    monkeypatch.setenv("TREEFLASH_VERIFY_KERNEL", "portable")
    assert knobs.is_set("TREEFLASH_VERIFY_KERNEL", "portable")
    monkeypatch.setenv("TREEFLASH_W4A16_HUMMING", "off")  # a typo is an error, not a silent default
    with pytest.raises(ValueError, match=r"TREEFLASH_W4A16_HUMMING='off': expected one of auto, 0, 1 \(default auto\)"):
        knobs.get("TREEFLASH_W4A16_HUMMING")
    monkeypatch.delenv("TREEFLASH_W4A16_HUMMING")
    monkeypatch.setenv("TREEFLASH_VERIFY_KERNEL", "v9")
    with pytest.raises(ValueError, match="expected one of auto, portable"):
        knobs.get("TREEFLASH_VERIFY_KERNEL")
    assert knobs.check_environment()[1][-1].startswith("TREEFLASH_VERIFY_KERNEL='v9': expected one of auto, portable")
    with pytest.raises(KeyError):
        knobs.get("TREEFLASH_NOT_A_KNOB")


@pytest.mark.parametrize("name, says", [
    ("TREEFLASH_FUSED_NORM", "--runtime-option fused_norm=0"),
    ("TREEFLASH_MLA_PREP", "--runtime-option mla_prep=0"),
    ("TREEFLASH_MOE_TILES", "--runtime-option moe_tiles=VALUE"),
    ("TREEFLASH_DRAFTER_ATTN", "--runtime-option drafter_attention=VALUE"),
    ("TREEFLASH_OVERLAP", "--runtime-option overlap=VALUE"),
    ("TREEFLASH_FUSED_TREE", "--runtime-option fused_tree=0"),
    ("TREEFLASH_TREE_INTO_VERIFY", "--runtime-option tree_into_verify=0"),
    ("TREEFLASH_FUSED_WALK", "--runtime-option fused_walk=0"),
    ("TREEFLASH_FUSED_TOPK", "--runtime-option fused_topk=0"),
    ("TREEFLASH_ADD_IN_NORM", "removed: the alternative measured slower"),
    ("TREEFLASH_FUSED_ROUTE", "removed: the alternative measured slower"),
])
def test_a_variable_that_became_a_runtime_option_stops_the_run(name, says):
    """Setting one of the old A/B variables is an error naming what replaced it, not a silent
    run of the defaults that an A/B measurement would mislabel."""
    notes, errors = knobs.check_environment({name: "0"})
    assert not notes and len(errors) == 1 and errors[0].startswith(f"{name} is no longer read: ")
    assert says in errors[0]
    assert name not in knobs.KNOBS


def test_check_environment_notes_switches_typos_and_hides_secrets():
    env = {"TREEFLASH_W4A16_IMPL": "portable", "TREEFLASH_W4A16_IMLP": "portable", "TREEFLASH_VERIFY_KERNEL": "auto",
           "TREEFLASH_API_KEY": "sk-secret", "TREEFLASH_COMMIT": "abc", "TREEFLASH_W4A16_MMA": "",
           "TREEFLASH_W4A16_HUMMING": "no", "PATH": "/bin"}
    notes, errors = knobs.check_environment(env)
    assert errors == ["TREEFLASH_W4A16_HUMMING='no': expected one of auto, 0, 1"]
    assert len(notes) == 2, notes  # the default value, the key, the commit and the empty one say nothing
    assert any(n.startswith("TREEFLASH_W4A16_IMPL=portable (default auto): pins the INT4 MoE kernel") for n in notes)
    assert "TREEFLASH_W4A16_IMLP is not a treeflash variable (ignored); did you mean TREEFLASH_W4A16_IMPL?" in notes
    env = {"TREEFLASH_API_KEY": "sk-secret", "TREEFLASH_DIST_TIMEOUT": "30"}
    assert knobs.check_environment(env) == ([], [])
    assert knobs.shown(knobs.KNOBS["TREEFLASH_API_KEY"], "sk-secret") == "<hidden>"


def test_debugging_variables_that_slow_every_step_are_noted():
    env = {"CUDA_LAUNCH_BLOCKING": "1", "TRITON_INTERPRET": "1", "PYTORCH_NO_CUDA_MEMORY_CACHING": "0"}
    notes, errors = knobs.check_environment(env, cuda=True)
    assert not errors and len(notes) == 2, notes
    assert notes[0].startswith("CUDA_LAUNCH_BLOCKING=1: every CUDA launch waits")
    assert notes[1].startswith("TRITON_INTERPRET=1: every Triton kernel runs in the CPU interpreter")
    # without CUDA the interpreter is how the kernels run at all (the package sets it itself)
    assert knobs.check_environment({"TRITON_INTERPRET": "1"}, cuda=False) == ([], [])


def test_benchmark_results_record_the_switches(monkeypatch):
    assert knobs.switched() == {}
    monkeypatch.setenv("TREEFLASH_VERIFY_KERNEL", "portable")
    monkeypatch.setenv("TREEFLASH_W4A16_HUMMING", "auto")  # its default: not a switch away from it
    monkeypatch.setenv("TREEFLASH_API_KEY", "sk-secret")
    assert knobs.switched() == {"TREEFLASH_VERIFY_KERNEL": "portable"}


def test_doctor_reports_the_environment(monkeypatch):
    assert doctor.check_environment().status == "PASS"
    monkeypatch.setenv("TREEFLASH_W4A16_IMPL", "portable")
    c = doctor.check_environment()
    assert c.status == "WARN" and "TREEFLASH_W4A16_IMPL=portable (default auto)" in c.evidence
    monkeypatch.setenv("TREEFLASH_VERIFY_KERNEL", "maybe")
    c = doctor.check_environment()
    assert c.status == "FAIL" and "TREEFLASH_VERIFY_KERNEL='maybe'" in c.evidence


def test_the_cli_refuses_a_bad_value_before_loading_and_notes_switches(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TREEFLASH_W4A16_HUMMING", "false")
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--model", str(tmp_path / "missing")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "treeflash generate: error: TREEFLASH_W4A16_HUMMING='false': expected one of auto, 0, 1" in err
    assert "missing" not in err  # refused before the model path was looked at
    monkeypatch.setenv("TREEFLASH_W4A16_HUMMING", "0")
    with pytest.raises(SystemExit):
        cli.main(["generate", "hi", "--model", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert "treeflash: note: TREEFLASH_W4A16_HUMMING=0 (default auto)" in err and "missing" in err
    monkeypatch.delenv("TREEFLASH_W4A16_HUMMING")
    monkeypatch.setenv("TREEFLASH_HEAD_MATMUL", "0")  # now a runtime option: refused, with the flag to use
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--model", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--runtime-option head_matmul=0" in err and "missing" not in err
