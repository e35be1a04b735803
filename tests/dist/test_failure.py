"""A rank that dies or hangs ends the run with a clear error on rank 0, never a hang; no
follower outlives its group, and none outlives rank 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from tp_helpers import prompts

from treeflash import LLM, SamplingParams
from treeflash.dist.launch import DistributedError


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
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 2 \(pid \d+\) exited with code -9"):
        llm.generate(prompts(1), SamplingParams(max_tokens=3, ignore_eos=True))
    assert time.monotonic() - t0 < 10
    assert_all_gone(llm)
    with pytest.raises(DistributedError, match="rank 2"):  # and it stays failed
        llm.score([3, 4, 5])


def test_follower_killed_mid_run(target):
    llm = tp_llm(target)
    victim = followers(llm)[0]
    threading.Timer(0.5, os.kill, (victim.pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        for _ in range(1000):  # about a thousand one-row forwards: the kill lands inside them
            llm.score(list(range(2, 90)), chunk_size=1)
    assert time.monotonic() - t0 < 20
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
