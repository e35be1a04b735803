"""A rank that dies or hangs ends the run with a clear error on rank 0, never a hang; no
follower outlives its group, and none outlives rank 0."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers.tp import dying_follower, prompts, raising_follower
from treeflash import LLM, SamplingParams
from treeflash.parallel import group, worker
from treeflash.parallel.errors import DistributedError

pytestmark = pytest.mark.slow


def tp_llm(target, tp=2, **kw):
    return LLM(target, device="cpu", dtype="float32", page_size=8, tp=tp, **kw)


def followers(llm):
    return llm.engine.executor.ctx.followers


def assert_all_gone(llm):
    for p in followers(llm):
        p.join(timeout=10)
        assert p.exitcode is not None, f"follower {p.pid} still running"


def test_follower_killed_between_steps(target):
    llm = tp_llm(target, tp=4)
    llm.generate(prompts(1), SamplingParams(max_tokens=3, ignore_eos=True))
    victim = followers(llm)[1]  # rank 2
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=10)
    assert llm.engine.executor.ctx.watch.fired.wait(5)
    with pytest.raises(DistributedError, match=r"rank 2 \(pid \d+\) was killed by SIGKILL"):
        llm.engine.executor.check()  # what the engine can ask after waiting for a step's results
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 2 \(pid \d+\) was killed by SIGKILL") as e:
        llm.generate(prompts(1), SamplingParams(max_tokens=3, ignore_eos=True))
    assert time.monotonic() - t0 < 10
    assert "rank 1" not in str(e.value) and "rank 3" not in str(e.value), e.value  # only the cause
    assert_all_gone(llm)
    with pytest.raises(DistributedError, match="rank 2"):  # and it stays failed
        llm.score([3, 4, 5])


def test_follower_killed_mid_run(target):
    llm = tp_llm(target)
    victim = followers(llm)[0]
    threading.Timer(0.5, os.kill, (victim.pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        for _ in range(1000):  # about a thousand one-row forwards: the kill lands inside them
            llm.score(list(range(2, 90)), chunk_size=1)
    assert time.monotonic() - t0 < 20
    assert_all_gone(llm)


def test_death_the_transport_does_not_see_is_reported_promptly(target, monkeypatch, tmp_path):
    """As under NCCL, where a peer's death does not fail the collective rank 0 is inside: the
    killed follower's sockets stay open (a grandchild holds them), so rank 0's all-reduce would
    wait for TREEFLASH_DIST_TIMEOUT. The watch sees the process exit, records it as the cause and
    aborts the group; the abort here also ends the grandchild, which ends the wait as aborting
    the NCCL communicator does."""
    monkeypatch.setenv("TREEFLASH_DIST_TIMEOUT", "60")
    pidfile = tmp_path / "grandchild.pid"
    monkeypatch.setattr(worker, "follower_main", functools.partial(dying_follower, 1, 2, str(pidfile)))
    real, aborts = group.DistContext.break_group, []

    def break_group(ctx):
        aborts.append(time.monotonic())
        real(ctx)
        os.kill(int(pidfile.read_text()), signal.SIGKILL)

    monkeypatch.setattr(group.DistContext, "break_group", break_group)
    llm = tp_llm(target)
    try:
        t0 = time.monotonic()
        with pytest.raises(DistributedError, match=r"^tensor-parallel group failed during forward: "
                           r"rank 1 \(pid \d+\) was killed by SIGKILL$"):
            llm.generate(prompts(1), SamplingParams(max_tokens=3, ignore_eos=True))
        assert time.monotonic() - t0 < 10
        assert len(aborts) == 1
    finally:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
    assert not followers(llm)[0].is_alive()
    assert not llm.engine.executor.ctx.watch.running
    assert_all_gone(llm)


def test_orderly_shutdown_is_no_failure(target, capfd):
    """Followers that exit on SHUTDOWN are not reported, and the watch ends with the group."""
    llm = tp_llm(target)
    watch = llm.engine.executor.ctx.watch
    assert watch.running and watch._thread.daemon
    llm.generate(prompts(1), SamplingParams(max_tokens=3, ignore_eos=True))
    llm.close()
    assert not watch.running and not watch.fired.is_set() and watch.cause is None
    assert [p.exitcode for p in followers(llm)] == [0]
    err = capfd.readouterr().err
    assert "failed" not in err and "rank 1 (pid" not in err, err


def test_death_while_idle_is_logged_at_close(target, capfd):
    """A follower that dies while rank 0 runs no step: close() says so, and does not raise."""
    llm = tp_llm(target)
    victim = followers(llm)[0]
    os.kill(victim.pid, signal.SIGKILL)
    assert llm.engine.executor.ctx.watch.fired.wait(5)
    llm.close()
    err = capfd.readouterr().err
    assert re.search(r"treeflash tp rank 0: tensor-parallel group failed between steps: rank 1 \(pid \d+\) "
                     r"was killed by SIGKILL\n", err), err
    assert_all_gone(llm)


def test_hung_follower_times_out(target, monkeypatch):
    monkeypatch.setenv("TREEFLASH_DIST_TIMEOUT", "3")
    llm = tp_llm(target)
    victim = followers(llm)[0]
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(DistributedError, match="tensor-parallel group failed during forward"):
            llm.score([3, 4, 5])
        assert 2 < time.monotonic() - t0 < 20
    finally:
        if victim.exitcode is None:
            os.kill(victim.pid, signal.SIGKILL)
    assert_all_gone(llm)


RANK0 = """
import sys, time
from treeflash import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", page_size=8, tp=2)
    print(" ".join(str(p.pid) for p in llm.engine.executor.ctx.followers), flush=True)
    time.sleep(120)
"""


def test_followers_exit_when_rank0_dies(target, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    proc = subprocess.Popen([sys.executable, str(script), str(target)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 15
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.1)
    assert not pids, f"followers {pids} outlived rank 0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@contextlib.contextmanager
def tp_server(target):
    from treeflash.server.app import ServerConfig, create_app, make_server

    llm = tp_llm(target)
    app = create_app(llm, ServerConfig(model_name="tiny", log_interval=0))
    server = make_server(app, "127.0.0.1", 0, log_level="critical")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the test server did not start"
            time.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        yield llm, app, thread, url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        llm.close()
    assert_all_gone(llm)


def test_idle_server_exits_when_a_follower_dies(target):
    """A dead rank breaks the group for good: an idle server notices by itself (no request
    needed), says which rank, and shuts down instead of answering 200 to /health."""
    import httpx

    with tp_server(target) as (llm, app, thread, url):
        body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        victim = followers(llm)[0]
        t0 = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server kept running over a dead tensor-parallel group"
        assert time.monotonic() - t0 < 10
        dead = app.state.treeflash.async_engine.dead
        assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL", dead), dead
        with pytest.raises(httpx.TransportError):  # nobody listens any more
            httpx.get(url + "/health", timeout=5)


def test_server_fails_the_running_stream_when_a_follower_dies(target, tmp_path):
    """A rank killed while a request streams: the stream ends with an error frame naming the
    rank (no garbage tokens after the death), and the server exits."""
    import httpx

    from helpers.hf_checkpoints import add_tokenizer

    with_text = tmp_path / "m"  # a tokenizer, so that every token streams a frame
    shutil.copytree(target, with_text)
    add_tokenizer(with_text)
    with tp_server(with_text) as (llm, app, thread, url):
        body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        victim = followers(llm)[0]
        frames = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                frames.append(line)
                if len(frames) == 3:
                    os.kill(victim.pid, signal.SIGKILL)
        errors = [f for f in frames if '"error"' in f]
        # The error, then the choice's end (as every stream that fails ends): nothing after it.
        assert len(errors) == 1 and "rank 1" in errors[0] and frames[-2] == errors[0], frames[-3:]
        assert '"finish_reason": "abort"' in frames[-1], frames[-1]
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server kept running over a dead tensor-parallel group"


def test_generate_cli_names_the_dead_rank_in_one_line(monkeypatch, capsys):
    """`treeflash generate --tp 2` whose follower dies: exit 1 with the rank and its exit code
    on one line, not a rank-0 traceback of every frame."""
    from treeflash import cli

    real = cli.build_llm

    def build_then_kill(args, **kw):
        llm = real(args, **kw)
        victim = followers(llm)[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        return llm

    monkeypatch.setattr(cli, "build_llm", build_then_kill)
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hello", "--tp", "2", "--spec", "off", "--max-tokens", "4", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 1, err
    assert err.startswith("treeflash generate: error: tensor-parallel group failed during ")
    assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL", err), err
    assert "Traceback" not in err and "stderr" not in err, err


RAISED = r"rank 2 \(pid \d+\) raised OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"


def test_follower_exception_is_named_with_its_traceback(target, monkeypatch, capfd):
    """A follower that raises (here: out of memory in its 2nd forward) is named by rank 0 with the
    exception and its traceback, not as a lost connection or a bare exit code."""
    monkeypatch.setattr(worker, "follower_main", functools.partial(raising_follower, 2, 2))
    llm = tp_llm(target, tp=4)
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match="tensor-parallel group failed during forward: " + RAISED) as e:
        llm.generate(prompts(1), SamplingParams(max_tokens=3, ignore_eos=True))
    assert time.monotonic() - t0 < 20
    assert "lost" not in str(e.value) and "exited with code" not in str(e.value), e.value
    err = capfd.readouterr().err
    shown = re.search(r"treeflash tp rank 0: " + RAISED + r".*; its traceback:\nTraceback \(most recent call last\):\n"
                      r"(.*\n)*.* in forward\n(.*\n)*torch.OutOfMemoryError: CUDA out of memory", err)
    assert shown, err
    # The other followers only lost the group: they say so and do not claim the error.
    assert re.search(r"treeflash tp rank 1: lost the group", err) and "rank 1 (pid" not in err, err
    assert_all_gone(llm)


def test_generate_cli_names_the_rank_that_raised(monkeypatch, capfd):
    """`treeflash generate --tp 2` whose follower raises: exit 1 with one line naming the rank
    and its exception; its traceback is on stderr above it, printed by rank 0."""
    from treeflash import cli

    monkeypatch.setattr(worker, "follower_main", functools.partial(raising_follower, 1, 1))
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hello", "--tp", "2", "--spec", "off", "--max-tokens", "4", "--device", "cpu"])
    err = capfd.readouterr().err
    assert e.value.code == 1, err
    last = err.rstrip("\n").split("\n")[-1]
    assert re.fullmatch(r"treeflash generate: error: tensor-parallel group failed during forward: "
                        + RAISED.replace("rank 2", "rank 1") + r" \(planted by the test\)", last), err
    assert "treeflash tp rank 0: rank 1 (pid" in err and "Traceback (most recent call last)" in err, err


def test_rendezvous_port_cannot_be_taken_before_the_store_listens(target, monkeypatch):
    """Another process that binds a port the moment a probe socket releases it (the race of
    'bind to 0, close, reopen') does not break the start-up: the store listens on its own port."""
    import socket

    real, squatters = socket.socket, []

    class Squatting(real):
        def close(self):
            port = self.getsockname()[1] if self.fileno() != -1 else 0
            super().close()
            if port:  # the other process wins the race for the port just released
                squatter = real()
                squatter.bind(("127.0.0.1", port))
                squatter.listen()
                squatters.append(squatter)

    monkeypatch.setattr(socket, "socket", Squatting)
    try:
        llm = tp_llm(target)
    finally:
        for s in squatters:
            s.close()
    out = llm.generate(prompts(1), SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2
    llm.close()
    assert_all_gone(llm)
