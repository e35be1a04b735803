"""Every command the README shows runs and exits 0, its words as bash makes them (braces, quotes)
given to the CLI's entry point, at CI sizes: contexts and token counts made small, the GPU preset
replaced by the tiny one, `path/to/...` and `/models/...` replaced by a tiny checkpoint pair written here
(the `hf download` lines that fetch the real ones are not treeflash's and not run), comma lists of
budgets, acceptances and concurrencies cut to two, `bench moe` at a toy MoE geometry. `serve`
commands run as processes, answer one request through the openai client and stop on SIGINT
with exit 0. The one command a CPU cannot run, `bench kernel`, must be refused in one line
naming the GPU it needs."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import treeflash
from helpers.drafter import write_drafter
from helpers.hf_checkpoints import add_tokenizer, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SRC = Path(treeflash.__file__).resolve().parents[1]  # the treeflash these tests import, for the server too

SMALL = [  # (pattern, replacement): the README's sizes -> CI's
    (r"--contexts [\w,]+", "--contexts 64,128"),
    (r"--context \w+", "--context 128"),
    (r"--max-tokens \d+", "--max-tokens 8"),
    (r"max_tokens=\d+", "max_tokens=8"),
    (r"--preset kimi-k2-tp8", "--preset tiny"),
    (r"--preset kimi-k2\.6-tp8", "--preset tiny-int4"),
    (r"(--speculative-ddtree-budget|--tree-budget) ((?:off,)?)\d+(,\d+)*,auto", r"\1 \g<2>3,auto"),
    (r"--acceptance \w+(,\w+)+", "--acceptance 0,oracle"),
    (r"--concurrency [\d,]+", "--concurrency 1,2"),
    (r"--tp 8", "--tp 2"),
    (r"(?<![\w/.-])(benchmarks|examples)/", str(ROOT) + r"/\1/"),
]


def readme_commands() -> tuple[list[str], list[str]]:
    """(shell commands from the README's bash blocks that call treeflash, its python blocks)."""
    text = README.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            commands += [part.strip() for part in line.split("&&") if part.strip().startswith("treeflash ")]
    return commands, re.findall(r"```python\n(.*?)```", text, re.S)


MAP_HEADING = "## Map of `src/treeflash/`"


def map_rows() -> list[tuple[list[str], str]]:
    """The README map's rows: (the paths of the first column, relative to src/treeflash; the row's text)."""
    text = README.read_text().split(MAP_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) < 4 or not cells[1].strip().startswith("`"):
            continue
        paths, folder = [], ""
        for name in re.findall(r"`([^`]+)`", cells[1]):
            path = name if "/" in name or not folder else folder + name
            folder = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
            paths.append(path)
        rows.append((paths, line))
    return rows


def test_the_map_of_modules_matches_the_layout():
    """Every path the README's map names exists; every top-level module and package of
    src/treeflash has a row; every module of a package is named in its package's rows."""
    pkg = SRC / "treeflash"
    rows = map_rows()
    named = [p for paths, _ in rows for p in paths]
    assert not [p for p in named if not (pkg / p).exists()], "the map names what is not there"
    top = {p.name for p in pkg.glob("*.py")} | {p.name + "/" for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    top.add("assets/")
    listed = {p.split("/")[0] + ("/" if "/" in p else "") for p in named}
    assert top <= listed, sorted(top - listed)
    for sub in sorted(p for p in top if p.endswith("/") and p != "assets/"):
        text = " ".join(line for paths, line in rows if any(p.startswith(sub) for p in paths))
        modules = [m for m in sorted((pkg / sub).rglob("*.py")) if m.name != "__init__.py"]
        unnamed = [m.relative_to(pkg / sub).as_posix() for m in modules
                   if m.name not in text and m.relative_to(pkg / sub).as_posix() not in text]
        assert not unnamed, f"{sub}: {unnamed} not in the map"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target with a tokenizer and a drafter for it: what `path/to/...` stands for."""
    root = tmp_path_factory.mktemp("readme")
    target = write_checkpoint(root / "target", initializer_range=0.3, max_position_embeddings=2048)
    add_tokenizer(target)
    drafter = write_drafter(root / "drafter", hidden_size=64, vocab_size=96, num_target_layers=3,
                            target_layer_ids=(0, 2), block_size=6, mask_token_id=95)
    return target, drafter


def ci_sized(command: str, target: Path, drafter: Path) -> str:
    for pattern, replacement in SMALL:
        command = re.sub(pattern, replacement, command)
    command = re.sub(r"(path/to|/models)/[\w.-]*(DFlash|drafter)[\w.-]*", str(drafter), command)
    command = re.sub(r"(path/to|/models)/[\w.-]+", str(target), command)
    for verb in ("generate", "doctor", "bench sweep", "bench serve"):
        if command.startswith(f"treeflash {verb}") and "--max-tokens" not in command:
            command = command.replace(f"treeflash {verb}", f"treeflash {verb} --max-tokens 8", 1)
    if command.startswith("treeflash bench serve") and "--prompt-len" not in command:
        command += " --prompt-len 16"
    if command.startswith("treeflash bench moe"):  # tests/bench/test_moe_bench.py's geometry
        command += (" --experts 8 --top-k 2 --hidden 64 --inter 32 --shared-inter 32 --rows 2 --layers 2"
                    " --bf16-layers 1 --calls 1 --replays 1")
    return command


def words(command: str) -> list[str]:
    """The argv bash makes of `command` (brace expansion, quotes), less the leading `treeflash`."""
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, text=True, check=True)
    argv = out.stdout.split("\0")[:-1]
    assert argv[0] == "treeflash", argv
    return argv[1:]


def run_cli(argv: list[str], cwd: Path, capfd) -> tuple[int, str]:
    """(exit code, stderr) of `treeflash ARGV` through the entry point, in `cwd`."""
    from treeflash.cli import main

    old = os.getcwd()
    os.chdir(cwd)
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    finally:
        os.chdir(old)
    return rc, capfd.readouterr().err


def shell(command: str, cwd: Path, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    script = f'treeflash() {{ exec "{sys.executable}" -m treeflash.cli "$@"; }}\n{command}\n'
    return subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_one_request(command: str, cwd: Path) -> None:
    import openai

    port = free_port()
    proc = shell(f"{command} --port {port}", cwd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = client.completions.create(model=client.models.list().data[0].id, prompt="def f", max_tokens=4)
        assert out.choices[0].finish_reason in ("length", "stop")
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"{command}\n{err}"
    assert re.search(r"serving .* KV cache \d+ tokens .* at http://127\.0\.0\.1:\d+", err), err


def _wait_healthy(proc: subprocess.Popen, url: str) -> None:
    import httpx

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited {proc.returncode}: {proc.communicate()[1]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not come up within 180 s")


def test_every_benchmark_script_is_in_the_benchmarks_table():
    """benchmarks/README.md names every script under benchmarks/ and benchmarks/lab/ (issue 46:
    a suite, not a notebook): a new script comes with its row (what it measures, its command)."""
    bench = ROOT / "benchmarks"
    text = (bench / "README.md").read_text()
    scripts = sorted(p.name for pattern in ("*.py", "*.sh", "lab/*.py") for p in bench.glob(pattern))
    assert len(scripts) > 20
    assert [name for name in scripts if name not in text] == []


def test_readme_shows_each_command():
    commands, python = readme_commands()
    shown = {" ".join(c.split()[1:3 if c.split()[1] == "bench" else 2]) for c in commands}
    assert shown == {"generate", "serve", "bench sweep", "bench serve", "bench diff", "bench kernel", "bench moe",
                     "doctor", "train"}, shown
    assert len(python) == 1 and len(commands) >= 10


@pytest.mark.slow
def test_every_readme_command_runs(pair, tmp_path, capfd):
    target, drafter = pair
    commands, python = readme_commands()
    failures = []
    for raw in commands:
        command = ci_sized(raw, target, drafter)
        if command.startswith("treeflash serve"):
            serve_one_request(command, tmp_path)
            continue
        rc, err = run_cli(words(command), tmp_path, capfd)
        if command.startswith("treeflash bench kernel") and not torch.cuda.is_available():
            if rc != 2 or "CUDA GPU" not in err:
                failures.append((raw, rc, err[-2000:]))
        elif rc != 0:
            failures.append((raw, rc, err[-2000:]))
    assert not failures, "\n\n".join(f"{c}\n-> exit {rc}\n{e}" for c, rc, e in failures)
    sweeps = list(tmp_path.glob("sweep-*.json"))  # bench sweep writes into the current directory
    assert sweeps and all(json.loads(p.read_text())["runs"] for p in sweeps)
    assert any("comparison" in json.loads(p.read_text()) for p in sweeps)  # the budget table's
    serves = list(tmp_path.glob("serve-*.json"))  # so does bench serve
    assert serves and json.loads(serves[0].read_text())["rows"]
    exec(compile(ci_sized(python[0], target, drafter), "README.md", "exec"), {})
