"""`treeflash train drafter` on bad inputs: each is one line on stderr and exit code 2, found
before the training it would waste, and never leaves a broken file behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.train import TINY_D as TINY_D_BASE
from helpers.train import TINY_T, tiny_target
from treeflash.train.cli import main

pytestmark = pytest.mark.slow

ASSETS = Path(__file__).resolve().parents[2] / "src" / "treeflash" / "assets"
TINY_D = [*TINY_D_BASE, "--eval-batches", "1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    tiny_target(root, steps=1)
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


@pytest.mark.parametrize("vocab", ["300", "600"])  # fewer ids (silently wrong), more ids (IndexError)
def test_data_tokenized_for_another_model(run, tmp_path, capsys, vocab):
    other = tmp_path / "tok"
    assert main(["tokenizer", "--out", str(other), "--corpus", str(run / "corpus"), "--vocab-size", vocab,
                 "--heldout-percent", "20"]) == 0
    capsys.readouterr()
    assert main(_drafter(run, tmp_path / "d", data=other)) == 2
    assert "was tokenized with another tokenizer than --target" in _one_line_error(capsys)
    assert not (tmp_path / "d" / "checkpoint.pt").exists()


def test_data_ids_past_the_target_vocabulary(run, tmp_path, capsys):
    target = tmp_path / "target"  # a target folder without tokenizer.json: only the ids can be checked
    shutil.copytree(run / "target", target, ignore=shutil.ignore_patterns("tokenizer*"))
    data = tmp_path / "tok"
    shutil.copytree(run / "tok", data)
    stream = data / "data" / "heldout.bin"
    stream.write_bytes(stream.read_bytes() + np.array([500], dtype=np.uint16).tobytes())
    assert main(_drafter(run, tmp_path / "d", target=target, data=data)) == 2
    assert "has token id 500, past --target" in _one_line_error(capsys)


def test_out_is_a_file(run, tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("keep me")
    assert main(_drafter(run, out)) == 2
    assert _one_line_error(capsys).endswith(f"--out {out}: is a file, expected a folder")
    assert out.read_text() == "keep me"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs procfs: a folder no one can write in")
def test_out_not_writable_fails_before_training(run, capsys):
    assert main(_drafter(run, Path("/proc/self"))) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "--out /proc/self: cannot write there" in captured.err
    assert "parameters" not in captured.out  # refused before the model was built, not after training


@pytest.fixture(scope="module")
def drafted(run):
    assert main(_drafter(run, run / "drafter")) == 0
    return run / "drafter" / "checkpoint.pt"


def _resume_with(run, tmp_path, checkpoint: bytes) -> list[str]:
    out = tmp_path / "d"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(checkpoint)
    return _drafter(run, out, "--resume")


@pytest.mark.parametrize("damage, message", [
    ("truncated", "it is damaged or not a training checkpoint (RuntimeError: PytorchStreamReader"),
    ("empty", "it is damaged or not a training checkpoint (EOFError)"),
    ("other model", "trained with another model shape (another --target or --data?): size mismatch for fc.weight"),
    ("target's", "is not a drafter checkpoint (a target's?)"),
    ("not a checkpoint", "is not a treeflash training checkpoint"),
])
def test_resume_from_a_bad_checkpoint(run, drafted, tmp_path, capsys, damage, message):
    good = drafted.read_bytes()
    if damage == "truncated":
        bad = good[: len(good) // 2]
    elif damage == "empty":
        bad = b""
    elif damage == "target's":
        bad = (run / "target" / "checkpoint.pt").read_bytes()
    else:
        state = torch.load(drafted, weights_only=True)
        if damage == "other model":  # a drafter for a target of another hidden size
            state["model"]["fc.weight"] = torch.zeros(8, 16)
        else:
            state = [state["model"]]
        torch.save(state, tmp_path / "bad.pt")
        bad = (tmp_path / "bad.pt").read_bytes()
    assert main(_resume_with(run, tmp_path, bad)) == 2
    assert message in _one_line_error(capsys)
    assert (tmp_path / "d" / "checkpoint.pt").read_bytes() == bad  # left as it was


@pytest.mark.parametrize("flag, value, message", [
    ("--lr", "inf", "--lr must be finite and > 0"),  # was a 'drafter loss is nan' traceback after a step
    ("--lr", "1e38", "--lr 1e+38 is too large: AdamW's first step"),  # was accepted: an overflow error in opt.step()
    ("--time-budget", "nan", "--time-budget must be > 0 seconds, got nan"),  # was ignored: no time limit
    ("--seed", "-1", "--seed must be in [0, 2**64), got -1"),  # was numpy's 'expected non-negative integer'
    ("--seed", str(2**64), "--seed must be in [0, 2**64)"),  # was torch's 'Overflow when unpacking long long'
])
@pytest.mark.parametrize("stage", ["target", "drafter"])
def test_bad_numbers_are_refused_before_loading(run, tmp_path, capsys, stage, flag, value, message):
    if stage == "drafter":
        argv = _drafter(run, tmp_path / "d", flag, value)
    else:
        argv = ["target", "--data", str(run / "tok"), "--out", str(tmp_path / "t"), "--preset", "tiny",
                "--seq-len", "96", "--batch-size", "2", "--no-progress", "--device", "cpu", "--steps", "1",
                flag, value]
    assert main(argv) == 2
    assert message in _one_line_error(capsys)
    assert not any(tmp_path.iterdir())  # nothing built, nothing written


def _eval(run: Path, out: Path, *extra: str) -> list[str]:
    return ["eval", "--data", str(run / "tok"), "--target", str(run / "target"), "--out", str(out),
            "--prompts", "1", "--prompt-len", "32", "--new-tokens", "4", "--seq-len", "64", "--loss-windows", "1",
            "--long-len", "0", "--context-lengths", "48", "--context-prompts", "1", "--budgets", "4",
            "--reference-prompts", "0", "--device", "cpu", *extra]


@pytest.mark.parametrize("stage", ["target", "drafter", "eval"])
def test_seq_len_past_the_models_positions_is_refused(run, tmp_path, capsys, stage):
    # the tiny target has max_position_embeddings 64 x YaRN factor 4 = 256; 257 was trained and
    # evaluated on positions the model was never built for, without a word
    argv = {"target": ["target", "--data", str(run / "tok"), "--out", str(tmp_path / "t"), *TINY_T, "--steps", "1"],
            "drafter": _drafter(run, tmp_path / "d"),
            "eval": _eval(run, tmp_path / "metrics.json")}[stage]
    assert main([*argv, "--seq-len", "257"]) == 2
    line = _one_line_error(capsys)
    assert line.startswith(f"treeflash train {stage}: error: --seq-len 257 is more than ") and \
        "max_position_embeddings 256" in line
    assert not [f for f in tmp_path.rglob("*") if f.is_file()]  # no checkpoint, model or metrics written
    if stage == "target":  # the last position itself is fine
        assert main([*argv, "--seq-len", "256"]) == 0


@pytest.mark.parametrize("extra, message", [
    (["--long-len", "300"], "--long-len 300 is more than --target {t}'s max_position_embeddings 256: pass "
                            "--long-len 256 or less"),
    (["--prompt-len", "240"], "--prompt-len 240 + --new-tokens 4 + 16 (a margin) = 260 positions, more than "
                              "--target {t}'s max_position_embeddings 256"),
    (["--drafter", "D", "--prompt-len", "P"], "--prompt-len P + --new-tokens 4 + B (the draft block) = 257"),
    (["--drafter", "D", "--context-lengths", "48,200"],
     "--context-lengths 200 + 64 new tokens + 4 (the draft block) = 268 positions, more than --target {t}'s "
     "max_position_embeddings 256: drop the context lengths above 188"),
])
def test_eval_positions_past_the_model_are_refused_before_loading_data(run, drafted, tmp_path, capsys, extra,
                                                                       message):
    # only --seq-len was checked: the loss by position, the prompts + new tokens and the acceptance
    # sweep's contexts ran the target past max_position_embeddings without a word
    block = json.loads((drafted.parent / "config.json").read_text())["dflash_config"]["block_size"]
    subst = {"D": str(drafted.parent), "P": str(257 - 4 - block)}  # one past the end with the draft block
    extra = [subst.get(a, a) for a in extra]
    message = message.replace("P", subst["P"]).replace("B", str(block))
    out = tmp_path / "metrics.json"
    assert main(_eval(run, out, *extra)) == 2
    line = _one_line_error(capsys)
    assert line.startswith("treeflash train eval: error: ") and message.format(t=run / "target") in line, line
    assert not out.exists()


def test_eval_default_contexts_stop_where_the_target_does(run, drafted, tmp_path):
    from treeflash.train.evaluate import EvalArgs

    args = EvalArgs(data="", target="t", drafter="d", out="", seq_len=64, long_len=0,
                    prompt_len=32, new_tokens=4)
    args.check_positions(256, 4)  # 1024.. do not fit: the longest that does is 256 - 64 - 4
    assert args.context_lengths == (188,)
    args = EvalArgs(data="", target="t", drafter="d", out="", seq_len=64, long_len=0,
                    prompt_len=32, new_tokens=4)
    args.check_positions(32768, 16)  # the shipped pair: 32768 itself ran 80 positions past the end
    assert args.context_lengths == (1024, 4096, 8192, 16384, 32688)


@pytest.mark.parametrize("where, message", [
    ("under a file", "cannot write there ({tmp}/file is a file, not a folder)"),
    ("a folder", "is a folder, expected the path of a JSON file"),
    pytest.param("not writable", "cannot write there", marks=pytest.mark.skipif(
        not Path("/proc/self").is_dir(), reason="needs procfs: a folder no one can write in")),
])
def test_eval_out_that_cannot_be_written_fails_before_loading(run, tmp_path, capsys, monkeypatch, where, message):
    # --out was only opened after the whole evaluation ran (minutes to hours), then failed with a traceback
    import treeflash.train.evaluate as ev

    def loaded(*args, **kwargs):
        raise AssertionError("the target was loaded before --out was checked")

    monkeypatch.setattr(ev, "load_target", loaded)
    (tmp_path / "file").write_text("keep me")
    out = {"under a file": tmp_path / "file" / "metrics.json", "a folder": tmp_path,
           "not writable": Path("/proc/self/metrics.json")}[where]
    assert main(_eval(run, out)) == 2
    line = _one_line_error(capsys)
    assert line.startswith(f"treeflash train eval: error: --out {out}: ") and message.format(tmp=tmp_path) in line
    assert (tmp_path / "file").read_text() == "keep me"


def test_eval_out_in_missing_folders_is_written(run, tmp_path):
    out = tmp_path / "new" / "folder" / "metrics.json"  # missing folders are made (now up front), as before
    assert main(_eval(run, out)) == 0
    assert json.loads(out.read_text())["target"]["heldout_loss"] > 0


@pytest.mark.parametrize("what", ["drafter", "target"])
def test_interrupted_export_leaves_the_previous_files_whole(run, drafted, tmp_path, monkeypatch, what):
    import transformers.modeling_utils as mu

    from treeflash.train.drafter import export_drafter, load_drafter
    from treeflash.train.target import export_hf, load_target

    src = run / what
    out = tmp_path / what
    shutil.copytree(src, out)
    before = {f.name: f.read_bytes() for f in out.iterdir()}

    def half_then_ctrl_c(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # a write cut short
        raise KeyboardInterrupt

    monkeypatch.setattr(mu, "safe_save_file", half_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        if what == "drafter":
            export_drafter(load_drafter(src), out)
        else:
            export_hf(load_target(src), out, run / "tok")
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # no half file, no scratch folder left


def test_help_explains_every_option_and_states_its_default():
    import argparse

    from treeflash.train.cli import add_arguments

    parser = argparse.ArgumentParser(prog="treeflash train")
    add_arguments(parser)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert sorted(sub.choices) == ["drafter", "eval", "target", "tokenizer"]
    for name, p in sub.choices.items():
        for action in p._actions:
            if not action.option_strings or action.nargs == 0:  # positionals, flags (--resume, --help)
                continue
            fmt = p.formatter_class(prog=p.prog)
            fmt.add_argument(action)
            text = " ".join(fmt.format_help().split())
            assert action.help, (name, action.dest)
            if action.default is not None:
                assert f"(default: {action.default})" in text, (name, text)


def test_tokenizer_shows_progress_while_encoding(run, tmp_path, capsys):
    base = ["tokenizer", "--corpus", str(run / "corpus"), "--vocab-size", "300", "--heldout-percent", "20"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "encode train" in err and "encode heldout" in err and "file/s" in err
    assert main([*base, "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert "encode" not in capsys.readouterr().err
    assert (tmp_path / "a" / "data" / "train.bin").read_bytes() == (tmp_path / "b" / "data" / "train.bin").read_bytes()
