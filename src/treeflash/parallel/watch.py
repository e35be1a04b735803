"""Rank 0 watches the followers it spawned: one that exits while the group is up has broken it.

With gloo a dead peer closes its sockets and the collective rank 0 is inside fails at once.
With NCCL it does not: rank 0's kernels wait for data that will never come, until the NCCL
watchdog's timeout (TREEFLASH_DIST_TIMEOUT), and the watchdog then ends the process without
saying which rank died. So a daemon thread waits on the followers' processes; the first one
to exit is recorded as the cause (`DistContext.why_ended`: its own exception if it left one in
the store, else its exit code or signal) and `abort` is called, which on NCCL aborts the
communicators so that the blocked collective returns; the executor then raises
`DistributedError` with the recorded cause. The executor stops the watch before it sends
SHUTDOWN, so followers leaving at the end are not a failure.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait


def exit_code(proc) -> int | None:
    """The exit code of a child process (negative: the signal that ended it), or None while it
    runs. It does not reap the child (WNOWAIT), so the thread that joins it later sees the same
    code. Unlike the sentinel, it sees a follower exit while a grandchild still holds its pipe."""
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already (another thread joined it): it kept the code
        return proc.exitcode
    if info is None or info.si_pid == 0:
        return None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return -info.si_status
    return info.si_status


class FollowerWatch:
    """Wait, in a daemon thread, for any of `followers` (rank 1, 2, ...: processes with `pid` and
    `exitcode`, and a `sentinel` to wake on at once) to exit; then record
    `describe(rank, pid, code)` as `cause`, set `fired` and call `abort()` once.

    `stop()` ends the watch without firing (before an orderly shutdown, or before rank 0 kills
    the followers itself); it is idempotent and waits for an abort in progress to finish."""

    def __init__(self, followers: Sequence, abort: Callable[[], None],
                 describe: Callable[[int, int, int], str], poll_s: float = 0.2):
        self.followers = list(enumerate(followers, 1))
        self.abort = abort
        self.describe = describe
        self.poll_s = poll_s  # the sentinels wake it at once; polling covers a pipe still held
        self.cause: str | None = None
        self.fired = threading.Event()
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="treeflash-follower-watch", daemon=True)

    def start(self) -> FollowerWatch:
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        os.write(self._wake_w, b"x")
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        # Closed here, once the thread is gone: closed by the thread, a later write here could
        # land in whatever file reused the number.
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _run(self) -> None:
        exited = self._wait_for_exit()
        if exited:
            self._fire(exited)

    def _wait_for_exit(self) -> list[tuple[int, object, int]]:
        """(rank, process, code) of each follower found exited; [] once stop() was called."""
        sentinels = {getattr(p, "sentinel", None) for _, p in self.followers} - {None}
        while not self._stopping.is_set():
            ready = wait([self._wake_r, *sentinels], timeout=self.poll_s)
            if self._stopping.is_set():
                return []
            exited = [(r, p, c) for r, p in self.followers if (c := exit_code(p)) is not None]
            if exited:
                return exited
            # A sentinel ready while its process runs (a reap in another thread that has not
            # stored the code yet, or a closed pipe): poll that one instead of spinning on it.
            sentinels -= set(ready)
        return []

    def _fire(self, exited: list[tuple[int, object, int]]) -> None:
        # Several found at once: the one a signal ended first (the others most likely exited
        # because they lost it), then the lowest rank.
        rank, proc, code = min(exited, key=lambda e: (e[2] >= 0, e[0]))
        try:
            self.cause = self.describe(rank, proc.pid, code)
        except Exception as e:  # noqa: BLE001 - the watch must still abort
            self.cause = f"rank {rank} (pid {proc.pid}) ended with code {code} ({type(e).__name__}: {e})"
        self.fired.set()  # quietly: the executor raises the cause, or logs it at shutdown
        try:
            self.abort()
        except Exception as e:  # noqa: BLE001 - the cause is recorded; a later collective fails
            from treeflash.parallel.errors import log

            log(0, f"aborting the group after {self.cause} failed: {type(e).__name__}: {e}")
