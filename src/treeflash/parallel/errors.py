"""How a failure of the tensor-parallel group is told: `DistributedError` (what rank 0 raises),
`Raised` (a follower's own exception, left in the group's store), how a process ended, and the
line every rank writes to stderr."""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import asdict, dataclass


class DistributedError(RuntimeError):
    """A rank of the tensor-parallel group died, hung or fell out of step."""


@dataclass(frozen=True)
class Raised:
    """A follower's own exception, as it leaves it in the store for rank 0."""

    rank: int
    pid: int
    type: str  # the exception's class name
    message: str
    traceback: str  # traceback.format_exc() on the follower

    @staticmethod
    def key(rank: int) -> str:
        return f"treeflash/raised/{rank}"

    @classmethod
    def of(cls, rank: int, exc: BaseException, tb: str) -> Raised:
        return cls(rank, os.getpid(), type(exc).__name__, str(exc), tb)

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> Raised:
        return cls(**json.loads(raw))

    def what(self) -> str:
        """'Type: the first line of the message'."""
        lines = self.message.strip().splitlines() or [""]
        msg = lines[0] + (" ..." if len(lines) > 1 else "")
        return self.type + (f": {msg}" if msg else "")

    def line(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) raised {self.what()}"


def how_it_ended(rank: int, proc) -> str:
    return ended(rank, proc.pid, proc.exitcode)


def ended(rank: int, pid: int, code: int | None) -> str:
    """'rank r (pid p) exited with code c (its stderr says why)', or 'was killed by SIGKILL'
    when a signal ended it: then it wrote nothing (the OOM killer, or someone's kill -9)."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} (pid {pid}) was killed by {name}"
    return f"rank {rank} (pid {pid}) exited with code {code} (its stderr says why)"


def log(rank: int, msg: str) -> None:
    print(f"treeflash tp rank {rank}: {msg}", file=sys.stderr, flush=True)
