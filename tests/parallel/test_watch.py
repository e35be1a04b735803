"""`FollowerWatch` on its own: real child processes, a fake blocking collective and a fake
abort. What it must do: fire once, promptly, with the cause of the first follower to exit;
never for a follower that exits after stop(); never keep a process alive."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from treeflash.parallel.errors import Raised, ended
from treeflash.parallel.group import DistContext
from treeflash.parallel.watch import FollowerWatch, exit_code
from treeflash.sharding import Parallel

pytestmark = pytest.mark.slow

SPAWN = mp.get_context("spawn")


def child(target, *args):
    p = SPAWN.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def sleeper():
    return child(time.sleep, 60)


def wait_exited(p, timeout=20.0):
    deadline = time.monotonic() + timeout
    while exit_code(p) is None:
        assert time.monotonic() < deadline, f"child {p.pid} did not exit"
        time.sleep(0.02)


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.exitcode is None:
            p.kill()
        p.join(timeout=10)


class FakeCollective:
    """A collective blocked on a dead peer: it returns only when aborted (or after 60 s)."""

    def __init__(self):
        self.released = threading.Event()
        self.aborts = 0

    def abort(self):
        self.aborts += 1
        self.released.set()

    def run(self) -> float:
        t0 = time.monotonic()
        assert self.released.wait(60), "the blocked collective was never aborted"
        return time.monotonic() - t0


def test_exit_code_does_not_reap(procs):
    procs.append(p := child(os._exit, 3))
    wait_exited(p)
    assert exit_code(p) == 3 and exit_code(p) == 3  # still there to be read again
    p.join(timeout=10)  # reaps it: exitcode is what the peek said
    assert p.exitcode == 3 and exit_code(p) == 3
    procs.append(q := sleeper())
    assert exit_code(q) is None
    q.kill()
    wait_exited(q)
    assert exit_code(q) == -9


def test_a_follower_that_exits_aborts_the_blocked_collective(procs):
    procs.extend([sleeper(), sleeper()])
    coll = FakeCollective()
    watch = FollowerWatch(procs, coll.abort, ended).start()
    assert watch.running and watch._thread.daemon
    victim = procs[1]
    threading.Timer(0.3, victim.kill).start()
    waited = coll.run()
    assert waited < 5
    assert watch.fired.is_set() and coll.aborts == 1
    assert watch.cause == f"rank 2 (pid {victim.pid}) was killed by SIGKILL"
    watch._thread.join(timeout=5)
    assert not watch.running
    watch.stop()  # after firing: nothing left to do
    assert coll.aborts == 1


def test_the_cause_is_the_exception_the_follower_left_in_the_store(procs):
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    procs.append(p := sleeper())
    ctx = DistContext(0, 2, Parallel(), None, torch.device("cpu"), torch.device("cpu"), "spawn",
                      timedelta(seconds=10), procs, store=store)
    raised = Raised(1, p.pid, "OutOfMemoryError", "CUDA out of memory.\nmore", "Traceback ...")
    store.set(Raised.key(1), raised.encode())
    coll = FakeCollective()
    watch = FollowerWatch(procs, coll.abort, ctx.why_ended).start()
    p.terminate()  # it reported, then exited (with code 1 in real life)
    assert coll.run() < 5
    assert watch.cause == f"rank 1 (pid {p.pid}) raised OutOfMemoryError: CUDA out of memory. ..."


def test_a_signal_is_the_cause_when_several_exited_at_once(procs):
    """Those that only lost the group exit with code 1; the one killed is named."""
    procs.extend([child(os._exit, 1), sleeper(), child(os._exit, 1)])
    procs[1].kill()
    for p in procs:
        wait_exited(p)
    coll = FakeCollective()
    watch = FollowerWatch(procs, coll.abort, ended).start()
    coll.run()
    assert watch.cause == f"rank 2 (pid {procs[1].pid}) was killed by SIGKILL"


def test_followers_exiting_after_stop_are_no_failure(procs):
    procs.append(p := sleeper())
    coll = FakeCollective()
    watch = FollowerWatch(procs, coll.abort, ended, poll_s=30.0).start()
    t0 = time.monotonic()
    watch.stop()
    assert time.monotonic() - t0 < 2  # woken at once, not at its next poll
    assert not watch.running
    p.terminate()
    wait_exited(p)
    time.sleep(0.3)
    assert not watch.fired.is_set() and watch.cause is None and coll.aborts == 0
    watch.stop()  # idempotent


def test_an_abort_that_raises_keeps_the_cause(procs, capfd):
    procs.append(p := child(os._exit, 7))

    def abort():
        raise RuntimeError("no group")

    watch = FollowerWatch(procs, abort, ended).start()
    assert watch.fired.wait(10)
    watch._thread.join(timeout=5)
    assert watch.cause == f"rank 1 (pid {p.pid}) exited with code 7 (its stderr says why)"
    assert "aborting the group after rank 1" in capfd.readouterr().err


@pytest.mark.parametrize("comm", ["cpu", "cuda"])
def test_break_group_kills_the_other_followers_only_under_nccl(procs, comm):
    """NCCL: the others wait in their kernels for the dead one, and would never receive the
    next control header; gloo: they see the loss themselves, and live to log it."""
    assert not dist.is_initialized()  # no group here: only the kills are under test
    procs.extend([sleeper(), sleeper()])
    ctx = DistContext(0, 3, Parallel(), None, torch.device("cpu"), torch.device(comm), "spawn",
                      timedelta(seconds=10), procs)
    ctx.break_group()
    if comm == "cuda":
        for p in procs:
            wait_exited(p)
    else:
        time.sleep(0.3)
    assert [exit_code(p) for p in procs] == ([-9, -9] if comm == "cuda" else [None, None])


KEEPS_RUNNING = """
import multiprocessing as mp, time
from treeflash.parallel.errors import ended
from treeflash.parallel.watch import FollowerWatch
if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=time.sleep, args=(60,), daemon=True)
    p.start()
    FollowerWatch([p], lambda: None, ended).start()
    print("started", flush=True)
"""


def test_the_watch_does_not_keep_the_process_alive(tmp_path):
    """Never stopped, watching a follower that runs on: the interpreter still exits."""
    script = tmp_path / "keeps.py"
    script.write_text(KEEPS_RUNNING)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 0 and done.stdout == "started\n", done.stderr
