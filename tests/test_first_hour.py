"""A new user's first hour (issue 43): edge cases end in one line, never a traceback; long work
shows progress on a terminal and nothing in a pipe; prompts from stdin and files; bench sweep
writes where it says and checks its needs first; presets too big for the machine are refused
with their size; doctor checks at the model's limit, explains itself and suggests only what
runs here."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
import tomllib
import torch

import treeflash
from helpers.drafter import write_drafter
from helpers.hf_checkpoints import add_tokenizer, write_checkpoint
from treeflash.cli import main

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(treeflash.__file__).resolve().parents[1]  # the treeflash these tests import, for the processes too
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
RESULTS = ROOT / "benchmarks/results/h100-20261206-sweep-long-context"  # two committed sweep results
LONG_PROMPT = "def f(x): return x + 1\n" * 40  # ~600 tokens of the test tokenizer: two prefill chunks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 256-position target with a tokenizer and a drafter for it."""
    root = tmp_path_factory.mktemp("first_hour")
    target = write_checkpoint(root / "m", initializer_range=0.3, max_position_embeddings=1024)
    add_tokenizer(target)
    drafter = write_drafter(root / "d", hidden_size=64, vocab_size=96, num_target_layers=3,
                            target_layer_ids=(0, 2), block_size=4, mask_token_id=95)
    return target, drafter


def model_flags(tiny) -> list[str]:
    return ["--model", str(tiny[0]), "--drafter", str(tiny[1]), "--device", "cpu"]


def cli(*argv: str, tty: bool = False, cwd: Path | None = None):
    """(exit code, stdout, stderr) of `treeflash ARGV` in a process; stderr a 120-column terminal if tty."""
    cmd = [sys.executable, "-m", "treeflash.cli", *argv]
    if not tty:
        run = subprocess.run(cmd, capture_output=True, env=ENV, cwd=cwd, timeout=300)
        return run.returncode, run.stdout.decode(), run.stderr.decode()
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, env=ENV, cwd=cwd)
    os.close(slave)
    chunks = []

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    out, _ = proc.communicate(timeout=300)
    reader.join(10)
    os.close(master)
    return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


# ---- item 2: edge cases and pipes -----------------------------------------------------------
def test_summary_line_counts_auto_steps_by_budget_and_plain():
    from treeflash.cli import summary_line

    def line(spec: dict) -> str:
        return summary_line({"num_tokens": 9, "seconds": 1.0, "device": "cpu", "num_prompt_tokens": 3,
                             "finish_reason": "length", "metrics": {"speculative_decoding": spec}})

    mixed = {"spec_mode": "ddtree", "num_spec_steps": 3, "mean_acceptance_length": 2.0, "tree_budget": "auto",
             "steps_by_budget": {"3": 2, "7": 1}, "num_plain_steps": 2}
    assert "mean acceptance length 2.00 over 3 steps, budget auto ({'3': 2, '7': 1}, 2 plain)" in line(mixed)
    plain = {**mixed, "num_spec_steps": 0, "mean_acceptance_length": None, "steps_by_budget": {}, "num_plain_steps": 8}
    assert "ddtree: no tree paid, 8 plain steps, budget auto, finish: length]" in line(plain)
    fixed = {**mixed, "tree_budget": 7, "steps_by_budget": {"7": 3}, "num_plain_steps": 0}
    assert line(fixed).endswith("over 3 steps, budget 7, finish: length]")


def test_one_token_has_no_speculative_step_and_no_traceback(tiny, capsys):
    assert main(["generate", *model_flags(tiny), "--max-tokens", "1", "x"]) == 0
    err = capsys.readouterr().err
    assert "[1 tokens in" in err and "no speculative step ran" in err


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["generate", "--spec", "off", "--max-tokens", "2", "--json", "x"],
    ["bench", "diff", *(str(RESULTS / f"sweep-kimi-k2-tp8-{layout}-graphs-20261206-221516.json")
                        for layout in ("contiguous", "scattered"))],
])
def test_a_reader_that_left_gets_no_traceback(tiny, argv):
    """`treeflash generate --json | head`, with the reader gone before anything is written."""
    if argv[0] == "generate":
        argv = [*argv[:1], "--model", str(tiny[0]), "--device", "cpu", *argv[1:]]
    read, write = os.pipe()
    os.close(read)  # the reader has left: every write is EPIPE
    proc = subprocess.run([sys.executable, "-m", "treeflash.cli", *argv], stdout=write, stderr=subprocess.PIPE,
                          env=ENV, timeout=300)
    os.close(write)
    err = proc.stderr.decode()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 141


# ---- item 3: progress on a terminal, nothing in a pipe, a summary line --------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@contextlib.contextmanager
def terminal():
    """stderr as a terminal (what a user at a shell has), inside the test body (pytest's capture
    would replace one set up by a fixture); its text afterwards."""
    tty, saved = _Terminal(), sys.stderr
    sys.stderr = tty
    try:
        yield tty
    finally:
        sys.stderr = saved


@pytest.mark.slow
def test_generate_draws_prefill_and_decode_on_a_real_terminal_only(tiny, tmp_path, capsys):
    prompt = tmp_path / "long.txt"
    prompt.write_text(LONG_PROMPT)
    rc, out, err = cli("generate", *model_flags(tiny), "--max-tokens", "8", f"@{prompt}", tty=True)
    assert rc == 0, err
    assert "prefill: " in err and "decode: " in err and "tok/s" in err
    assert "loading" in err  # the model loading spinner
    assert "[8 tokens in" in err and "prefill 560 tokens" in err  # the summary line
    assert main(["generate", *model_flags(tiny), "--max-tokens", "4", f"@{prompt}"]) == 0
    err = capsys.readouterr().err  # not a terminal: the results alone
    assert "prefill: " not in err and "decode: " not in err and "loading" not in err, err
    assert "[4 tokens in" in err


@pytest.mark.parametrize("quiet", ["-q", "--json"])
def test_quiet_and_json_draw_nothing_on_a_terminal(tiny, quiet):
    with terminal() as tty:
        assert main(["generate", *model_flags(tiny), "--max-tokens", "4", quiet, LONG_PROMPT]) == 0
    err = tty.getvalue()
    assert "prefill: " not in err and "decode: " not in err and "loading" not in err, err


@pytest.mark.slow
def test_doctor_and_sweep_show_their_stages_and_a_summary(tiny, tmp_path, monkeypatch):
    with terminal() as tty:
        assert main(["doctor", *model_flags(tiny), "--context", "128", "--max-tokens", "8"]) == 0
    err = tty.getvalue()
    assert "doctor: kv_fragmentation" in err and "doctor: gpu_busy" in err  # the bar names each stage
    assert "loading" in err and "prefill 128" in err  # loading; the probe runs' prefill
    assert "treeflash doctor: " in err and " PASS" in err and "(exit 0)" in err
    monkeypatch.chdir(tmp_path)
    with terminal() as tty:
        assert main(["bench", "sweep", *model_flags(tiny), "--contexts", "64,128", "--spec", "off",
                     "--max-tokens", "8"]) == 0
    err = tty.getvalue()
    assert "sweep: " in err and ("run/s" in err or "s/run" in err)
    assert "bench sweep: 2 context(s) x 1 mode(s) in" in err


# ---- item 4: the default install runs every command; needs are checked before the work --------
def test_the_default_install_holds_the_server_and_the_plots():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {d.split(">")[0].split("=")[0].split("[")[0].lower() for d in project["dependencies"]}
    for extra in ("server", "bench"):
        needs = {d.split(">")[0].split("=")[0].lower() for d in project["optional-dependencies"][extra]}
        assert needs <= base, (extra, needs - base)


_NO_MATPLOTLIB = """
import sys
class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Missing())
from treeflash.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sweep_without_matplotlib_stops_before_the_work(tmp_path):
    run = subprocess.run([sys.executable, "-c", _NO_MATPLOTLIB, "bench", "sweep", "--preset", "tiny",
                          "--device", "cpu", "--contexts", "64", "--spec", "off", "--max-tokens", "4"],
                         capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
    assert run.returncode == 2 and "matplotlib is not installed" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert not list(tmp_path.rglob("*.json")), "the sweep ran (and wrote its JSON) before failing"


# ---- item 5: where bench sweep writes -----------------------------------------------------------
@pytest.mark.slow
def test_sweep_writes_in_the_current_directory_and_says_where(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "sweep", "--preset", "tiny", "--device", "cpu", "--contexts", "64",
                 "--spec", "off", "--max-tokens", "4", "-q"]) == 0
    out = capsys.readouterr().out
    written = list(tmp_path.glob("sweep-tiny-*.json"))
    assert len(written) == 1 and not (tmp_path / "benchmarks").exists()
    assert f"wrote {written[0].resolve()} and {written[0].with_suffix('.png').resolve()}" in out


@pytest.mark.slow
def test_bench_serve_writes_in_the_current_directory_and_says_where(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "serve", *model_flags(tiny), "--concurrency", "1", "--tree-budget", "off,auto",
                 "--max-tokens", "4", "--prompt-len", "8", "-q"]) == 0
    out = capsys.readouterr().out
    written = list(tmp_path.glob("serve-m-*.json"))
    assert len(written) == 1 and not (tmp_path / "benchmarks").exists()
    assert f"wrote {written[0].resolve()}" in out and json.loads(written[0].read_text())["rows"]


def test_sweep_refuses_an_unwritable_out_before_the_work(tmp_path, capsys, monkeypatch):
    import treeflash.bench.presets as presets

    monkeypatch.setattr(presets, "build_preset", lambda *a, **k: pytest.fail("built before checking --out"))
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["bench", "sweep", "--preset", "tiny", "--device", "cpu", "--out", str(tmp_path / "file" / "r.json")])
    assert e.value.code == 2


# ---- item 6: memory, before building -------------------------------------------------------------
@pytest.mark.slow
def test_a_preset_too_big_for_this_machine_is_refused_with_its_size(monkeypatch, capsys):
    import treeflash.bench.presets as presets
    from treeflash import memory

    monkeypatch.setattr(memory, "device_memory", lambda device: (1 << 20, 1 << 20, "available CPU RAM"))
    monkeypatch.setattr(presets, "build_preset", lambda *a, **k: pytest.fail("the preset was built"))
    for argv in (["bench", "sweep", "--preset", "tiny", "--contexts", "1k"],
                 ["doctor", "--preset", "tiny"], ["bench", "export", "--preset", "tiny", "--out", "/tmp/x"],
                 ["bench", "serve", "--preset", "tiny", "--out", "/tmp/x.json"]):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--device", "cpu"])
        err = capsys.readouterr().err
        assert e.value.code == 2, err
        assert "preset tiny" in err and "needs about" in err and "more than the 0.0 GB available CPU RAM" in err
        assert "Instead: a GPU with more than" in err


def test_kimi_preset_on_this_cpu_is_refused_before_allocating(capsys):
    """The README's GPU sweep on a CPU: ~27 GB of float32 weights alone; refused (or, on a machine
    that has the memory, it would run: then there is nothing to check here)."""
    from treeflash.bench.presets import preset_memory
    from treeflash.memory import device_memory

    need = preset_memory("kimi-k2-tp8", torch.device("cpu"), torch.float32, 262144)
    assert need.weights > 25e9
    if need.total <= device_memory(torch.device("cpu"))[0]:
        pytest.skip("this machine has the memory for kimi-k2-tp8 in float32")
    with pytest.raises(SystemExit) as e:
        main(["bench", "sweep", "--preset", "kimi-k2-tp8", "--device", "cpu"])
    assert e.value.code == 2
    assert "preset kimi-k2-tp8 at 262272 tokens needs about" in capsys.readouterr().err


# ---- item 8: prompts longer than a shell allows ----------------------------------------------------
def test_prompt_from_a_file_and_from_stdin(tiny, tmp_path, capsys, monkeypatch):
    text = "def f(x): return x"
    (tmp_path / "p.txt").write_text(text)
    base = ["generate", *model_flags(tiny), "--max-tokens", "6", "--json"]
    assert main([*base, text]) == 0
    inline = json.loads(capsys.readouterr().out)
    assert main([*base, f"@{tmp_path / 'p.txt'}"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == inline["token_ids"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert main([*base, "-"]) == 0
    piped = json.loads(capsys.readouterr().out)
    assert piped["token_ids"] == inline["token_ids"] and piped["prompt"] == text
    assert main([*base, "@@x"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt"] == "@x"
    with pytest.raises(SystemExit) as e:
        main([*base, f"@{tmp_path / 'missing.txt'}"])
    assert e.value.code == 2 and "no such file" in capsys.readouterr().err


@pytest.mark.slow
def test_a_prompt_larger_than_argv_allows(tiny, tmp_path, capsys):
    big = tmp_path / "big.txt"
    big.write_text("x" * (os.sysconf("SC_ARG_MAX") + 1))  # too long for any command line
    with pytest.raises(SystemExit) as e:
        main(["generate", *model_flags(tiny), "--max-tokens", "2", f"@{big}"])
    assert e.value.code == 2 and "max_model_len=1024" in capsys.readouterr().err  # read, then refused


# ---- items 1, 6, 9: doctor ---------------------------------------------------------------------------
@pytest.mark.slow
def test_doctor_at_the_models_limit_checks_the_largest_context_it_can(tiny, capsys):
    assert main(["doctor", *model_flags(tiny), "--context", "1k", "--max-tokens", "8", "-q"]) == 0
    out, err = capsys.readouterr()
    assert "checking at context 952" in err  # 1024 positions less 8 decoded tokens and a tree's rows
    assert "context 952" in out
    with pytest.raises(SystemExit) as e:
        main(["doctor", *model_flags(tiny), "--context", "2k"])
    assert e.value.code == 2 and "exceeds the model's max_position_embeddings (1024)" in capsys.readouterr().err


def test_probe_prefill_keeps_no_autograd_graph(tiny):
    """The README's `doctor --context 32k` on the shipped pair was OOM-killed at 23.6 GB on a CPU:
    the probe's prefill ran with autograd on, and writing its latents into the KV pool hung every
    chunk's graph off the pool (0.39 / 0.79 / 2.7 GB at 1k / 2k / 4k tokens; 0.08-0.11 GB without)."""
    from treeflash.bench.presets import load_rig
    from treeflash.bench.sweep import place_request

    rig = load_rig(str(tiny[0]), str(tiny[1]), None, torch.device("cpu"), torch.float32, 16)
    engine = rig.engine("ddtree", 600)
    place_request(engine, rig, 520, 4, "prefill", seed=0, progress=False)
    assert not engine.pool.kv.requires_grad and engine.pool.kv.grad_fn is None


def test_doctor_help_says_what_the_incident_was(capsys):
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    out = capsys.readouterr().out
    told = out.index("118.6 tok/s at 1.4k context to 0.7 tok/s at 185k")
    assert "incident" not in out[:told], "speaks of the incident before saying what it was"


@pytest.mark.slow
def test_doctor_on_one_process_speaks_of_no_ranks_and_suggests_what_runs_here(tiny, capsys, monkeypatch):
    from treeflash.cli import make_parser

    # a machine where no preset fits (kimi-k2.6-tp8 in fp32, ~21 GB, fits a CPU with that much free RAM)
    monkeypatch.setattr("treeflash.bench.presets.preset_fits", lambda *a, **k: False)
    assert main(["doctor", *model_flags(tiny), "--context", "128", "--max-tokens", "8", "-q",
                 "--scattered", "--page-size", "1"]) == 1
    out = capsys.readouterr().out
    assert "rank" not in out.split("moe_balance_batch1", 1)[1].splitlines()[0]
    suggestions = [line.split("next: ", 1)[1] for line in out.splitlines() if "next: " in line]
    commands = [s[s.index("treeflash "):] for s in suggestions if "treeflash " in s]
    assert commands, out
    for command in commands:
        if "on a machine with a CUDA GPU" in command or command.startswith("treeflash bench kernel"):
            continue
        words = command.split()[1:]
        make_parser().parse_args(words)  # a command this CLI accepts
        assert "--model" in words and str(tiny[0]) in words, command  # about the pair diagnosed
        assert "kimi-k2.6-tp8" not in words and "kimi-k2-tp8" not in words


def test_doctor_suggestions_fit_the_machine():
    from treeflash.doctor_cli import Here

    here = Here(cuda=False, source=["--model", "/m"], max_context=1000, fits=lambda name: False)
    assert here.runnable("treeflash bench sweep --preset kimi-k2-tp8 --contexts 8k") == \
        "treeflash bench sweep --model /m --contexts 1000"
    assert here.runnable("compare: treeflash bench sweep --contexts 256,8k,32k --spec off") == \
        "compare: treeflash bench sweep --model /m --contexts 256,1000 --spec off"
    assert here.runnable("treeflash bench kernel --defrag") == \
        "on a machine with a CUDA GPU: treeflash bench kernel --defrag"
    assert here.runnable("pytest tests/speculative -q") == "pytest tests/speculative -q"
    gpu = Here(cuda=True, source=[], max_context=300000, fits=lambda name: True)
    assert gpu.runnable("treeflash bench sweep --preset kimi-k2-tp8 --contexts 8k") == \
        "treeflash bench sweep --preset kimi-k2-tp8 --contexts 8k"
