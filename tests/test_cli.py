"""The `treeflash generate` command: output, JSON figures, and exit code 2 for bad input."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.drafter import write_drafter
from helpers.hf_checkpoints import add_tokenizer, write_checkpoint
from treeflash.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("cli") / "m")
    add_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    return write_drafter(tmp_path_factory.mktemp("cli") / "d", hidden_size=64, vocab_size=96,
                         num_target_layers=3, target_layer_ids=(0, 2), block_size=4, mask_token_id=95)


def test_generate_prints_prompt_and_completion(ckpt, capsys):
    assert main(["generate", "--model", str(ckpt), "--device", "cpu", "--max-tokens", "5", "def f"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def f")
    assert "5 tokens" in err or "finish: stop" in err


def test_generate_json_with_speculation(ckpt, drafter, capsys):
    rc = main(["generate", "--model", str(ckpt), "--drafter", str(drafter), "--spec", "ddtree",
               "--tree-budget", "8", "--device", "cpu", "--max-tokens", "12", "--json", "hello"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    spec = report["metrics"]["speculative_decoding"]
    assert spec["spec_mode"] == "ddtree" and spec["tree_budget"] == 8
    assert spec["num_spec_steps"] >= 1
    assert report["num_tokens"] == len(report["token_ids"]) <= 12


def test_a_tree_budget_dflash_ignores_is_noted(ckpt, drafter, capsys):
    rc = main(["generate", "--model", str(ckpt), "--drafter", str(drafter), "--spec", "dflash",
               "--tree-budget", "8", "--device", "cpu", "--max-tokens", "4", "--json", "hello"])
    assert rc == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["metrics"]["speculative_decoding"]["spec_mode"] == "dflash"
    assert "note: --tree-budget applies to --spec ddtree; dflash ignores it" in out.err


@pytest.mark.parametrize("argv, words", [
    (["--max-tokens", "0"], "must be >= 1"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--device", "tpu"], "device"),
    (["--spec", "ddtree"], "needs a drafter"),
    (["--tree-budget", "x"], "integer"),
])
def test_bad_arguments_exit_2(ckpt, capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(ckpt), *argv, "hi"])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_missing_model_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tmp_path / "nope"), "hi"])
    assert e.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_prompt_too_long_exit_2(ckpt, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(ckpt), "--device", "cpu", "--max-model-len", "8", "def f(x): return x"])
    assert e.value.code == 2
    assert "max_model_len" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_with_no_model_uses_the_shipped_pair(capsys):
    assert main(["generate", "--device", "cpu", "--max-tokens", "16", "def quicksort(xs):"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def quicksort(xs):") and len(out) > len("def quicksort(xs):")
    assert "ddtree: mean acceptance length" in err


_NO_TRITON = """
import sys
class _NoTriton:  # a base install (pip install -e .): no Triton on a CPU machine
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoTriton())
from treeflash.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_readme_first_command_runs_without_triton(tmp_path):
    # The README's first line installs no extra, then runs `treeflash generate` with the shipped
    # pair (DDTree on): the CPU path must not import Triton (it used to, through speculative/decoder.py
    # and speculative/build.py, and the command died in a traceback before parsing its arguments).
    import os
    import subprocess
    import sys

    import treeflash

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(treeflash.__file__)),
                                         env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _NO_TRITON, "generate", "--device", "cpu", "--max-tokens", "8",
                          "def quicksort(xs):"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("def quicksort(xs):")
    assert "ddtree: mean acceptance length" in run.stderr
    run = subprocess.run([sys.executable, "-c", _NO_TRITON, "bench", "kernel", "--compile-report"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "pip install 'treeflash[triton]'" in run.stderr, run.stderr


def test_non_utf8_prompt_exit_2(ckpt, capsys):
    # argv bytes that are not UTF-8 reach Python as lone surrogates; tokenizers raised a TypeError
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(ckpt), "--device", "cpu", "--max-tokens", "2", "def \udcff(x):"])
    assert e.value.code == 2
    assert "not valid UTF-8" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without a GPU")
def test_bench_kernel_without_a_gpu_exit_2(capsys):
    # was an AssertionError traceback from bench/kernel.py
    with pytest.raises(SystemExit) as e:
        main(["bench", "kernel"])
    assert e.value.code == 2
    assert "on a CUDA GPU and none is available here" in capsys.readouterr().err


def test_a_file_where_a_folder_is_wanted_exit_2(tmp_path, capsys):
    # bench export --out FILE was a NotADirectoryError traceback
    (tmp_path / "out.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        main(["bench", "export", "--preset", "tiny", "--device", "cpu", "--out", str(tmp_path / "out.json")])
    assert e.value.code == 2
    assert "Not a directory" in capsys.readouterr().err
