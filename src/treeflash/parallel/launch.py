"""Start or join the tensor-parallel process group: rank 0 is the caller, the rest follow.

Two ways in, one result (`DistContext`):
- spawn: `LLM(..., tp=N)` in a plain process starts N-1 followers itself
  (torch.multiprocessing, spawn), rendezvous over a TCPStore on 127.0.0.1 that rank 0
  hosts; while it waits it watches the children, so one that dies on start-up is
  reported at once instead of after the timeout.
- torchrun: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT are set; every
  process runs the same script, rank 0 returns from `LLM(...)`, the others serve as
  followers inside it and exit the process when rank 0 shuts down (torchrun's agent
  tears the group down when any rank dies).

Two groups: the compute group (NCCL on CUDA, gloo on CPU; the all-reduces and step
payloads) has `TREEFLASH_DIST_TIMEOUT` seconds (default 600), so a stuck rank ends in an
error; the control group (gloo, CPU) carries only step headers and may wait as long as
rank 0 is idle. A dead peer closes its sockets, so a gloo collective fails at once; an NCCL
one would wait for the timeout, so rank 0 of a spawned group watches its followers'
processes (`watch.FollowerWatch`) and aborts the groups when one exits (`break_group`).

A follower's own exception (out of memory, a bug, a bad message) breaks the collectives
too, and to rank 0 that looks like any lost peer. So before it exits the follower leaves
its exception and traceback in the group's TCPStore (`Raised`), which does not depend on
the collectives, and rank 0 looks there first when a collective fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from treeflash import knobs
from treeflash.parallel.parallel import Parallel
from treeflash.parallel.watch import FollowerWatch

IDLE_TIMEOUT = timedelta(days=365)  # a follower waits this long for rank 0's next step


class DistributedError(RuntimeError):
    """A rank of the tensor-parallel group died, hung or fell out of step."""


def dist_timeout() -> timedelta:
    raw = knobs.get("TREEFLASH_DIST_TIMEOUT")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    # 0 or less made every rendezvous time out at once; inf and 1e30 overflow timedelta.
    if not 0 < seconds <= IDLE_TIMEOUT.total_seconds():
        raise ValueError(f"TREEFLASH_DIST_TIMEOUT must be a number of seconds in (0, "
                         f"{IDLE_TIMEOUT.total_seconds():.0f}], got {raw!r}")
    return timedelta(seconds=seconds)


@dataclass(frozen=True)
class WorkerSpec:
    """What a follower needs to build its shard (sent once, at process start)."""

    model_path: str
    tp: int
    ep: int
    device: str  # "cpu" or "cuda:<base index>"; rank r uses cuda:<base + r>
    dtype: str  # a key of protocol.DTYPES' names: "float32" | "bfloat16" | "float16"
    attention_impl: str | None
    timeout_s: float
    num_threads: int
    dcp: int = 1  # decode context parallelism: ranks a request's latent cache is dealt across


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


@dataclass
class DistContext:
    rank: int
    world_size: int
    parallel: Parallel  # this rank's shard; parallel.group is the compute group
    ctrl_group: object  # gloo group for step headers
    device: torch.device  # where this rank's model and KV pool live
    comm_device: torch.device  # where step payloads travel (the compute backend's device)
    launcher: str  # "spawn" | "torchrun"
    timeout: timedelta  # for every collective rank 0 waits on
    followers: list = field(default_factory=list)  # spawned processes (rank 0, spawn only)
    seq: int = 0  # rank 0: the next step header's number (shared by every executor on the group)
    store: object | None = None  # the group's TCPStore: followers leave `Raised` reports there
    watch: FollowerWatch | None = None  # rank 0, spawn only: fires when a follower exits

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def dead_followers(self, wait_s: float = 0.0) -> list[str]:
        """`how_it_ended` for each spawned follower that is gone."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [how_it_ended(r, p) for r, p in enumerate(self.followers, 1) if p.exitcode is not None]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def raised(self) -> list[Raised]:
        """The followers that reported an exception of their own, lowest rank first."""
        found = [self.raised_by(rank) for rank in range(1, self.world_size)]
        return [r for r in found if r is not None]

    def raised_by(self, rank: int) -> Raised | None:
        with contextlib.suppress(Exception):  # no store, or it is gone: nothing to read
            if self.store.check([Raised.key(rank)]):
                return Raised.decode(self.store.get(Raised.key(rank)))
        return None

    def why_ended(self, rank: int, pid: int, code: int) -> str:
        """A follower that exited: its own exception if it left one in the store, else `ended`."""
        raised = self.raised_by(rank)
        return raised.line() if raised is not None else ended(rank, pid, code)

    def start_watch(self) -> None:
        """Rank 0 of a spawned group: abort the group as soon as a follower exits."""
        self.watch = FollowerWatch(self.followers, self.break_group, self.why_ended).start()

    def break_group(self) -> None:
        """End the collectives in flight on this rank (the watch's abort, from its thread).

        NCCL: abort the communicators, so kernels waiting for a dead peer return instead of
        waiting for the watchdog's timeout; then kill the other followers, which wait in their
        own kernels for the dead one and would not receive a control header that rank 0 may be
        sending (a gloo op that would wait for them). gloo has no abort that ends an operation
        in flight (torch 2.13: ProcessGroup.abort() leaves it waiting), but there the dead
        peer's closed sockets end it, and the others live on to log that they lost the group.
        Either way the groups are unregistered, so `destroy` has nothing left to do."""
        if dist.is_initialized():
            abort_all = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort_all is not None:
                abort_all()  # every group, inside one NCCL group call (one at a time can deadlock)
            else:
                for group in (self.ctrl_group, self.parallel.group):
                    group.abort()
        if self.comm_device.type == "cuda":
            for p in self.followers:
                p.kill()  # no-op for the dead one

    def stop_watch(self) -> None:
        if self.watch is not None:
            self.watch.stop()

    def abort(self) -> None:
        """Kill the followers this rank spawned and leave the group (after a failure)."""
        self.stop_watch()  # before the kills: they are not a follower dying on its own
        for p in self.followers:
            if p.exitcode is None:
                p.kill()
        for p in self.followers:
            p.join(timeout=5)
        self.destroy()

    def destroy(self) -> None:
        self.stop_watch()  # its abort and destroy_process_group must not run at once
        if dist.is_initialized():
            dist.destroy_process_group()


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


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, index: int) -> torch.device:
    if device.type != "cuda":
        return device
    dev = torch.device("cuda", (device.index or 0) + index)
    torch.cuda.set_device(dev)
    return dev


def start_group(spec: WorkerSpec) -> DistContext:
    """Rank 0: spawn followers or join torchrun's group. A torchrun follower serves here and
    exits the process when rank 0 shuts the group down."""
    if dist.is_initialized():
        raise DistributedError("a torch.distributed group already exists in this process")
    if launched_by_torchrun():
        ctx = _join_torchrun(spec)
        if not ctx.is_leader:
            from treeflash.parallel.worker import run_follower

            code = run_follower(ctx, spec)
            ctx.destroy()
            raise SystemExit(code)
        return ctx
    return _spawn(spec)


def _join_torchrun(spec: WorkerSpec) -> DistContext:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != spec.tp:
        raise ValueError(f"torchrun started {world} processes but tp={spec.tp}: they must be equal")
    device = rank_device(torch.device(spec.device), int(os.environ.get("LOCAL_RANK", rank)))
    timeout = timedelta(seconds=spec.timeout_s)
    dist.init_process_group(backend_for(device), rank=rank, world_size=world, timeout=timeout)
    store = None
    with contextlib.suppress(Exception):  # private API; without it followers cannot report
        store = dist.distributed_c10d._get_default_store()
    return _context(spec, rank, device, "torchrun", [], store)


def _spawn(spec: WorkerSpec) -> DistContext:
    import torch.multiprocessing as mp

    # Port 0: the store's own listening socket takes a free port and keeps it. Finding one by
    # binding a probe socket and closing it left a window in which another process could take it.
    store = dist.TCPStore("127.0.0.1", 0, spec.tp, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=spec.timeout_s))
    port = store.port
    ctx = mp.get_context("spawn")
    from treeflash.parallel.worker import follower_main

    procs = []
    for rank in range(1, spec.tp):
        p = ctx.Process(target=follower_main, args=(spec, rank, port, os.getpid()), daemon=True,
                        name=f"treeflash-tp{rank}")
        p.start()
        procs.append(p)
    try:
        _wait_joined(store, procs, spec.timeout_s)
        device = rank_device(torch.device(spec.device), 0)
        dist.init_process_group(backend_for(device), store=store, rank=0, world_size=spec.tp,
                                timeout=timedelta(seconds=spec.timeout_s))
        ctx = _context(spec, 0, device, "spawn", procs, store)
        ctx.start_watch()
        return ctx
    except BaseException:
        for p in procs:
            if p.exitcode is None:
                p.kill()
        raise


def _wait_joined(store, procs, timeout_s: float) -> None:
    """Block until every follower has checked in; fail fast if one of them died."""
    keys = [f"treeflash/joined/{r}" for r in range(1, len(procs) + 1)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        dead = [how_it_ended(r, p) for r, p in enumerate(procs, 1) if p.exitcode is not None]
        if dead:
            raise DistributedError(f"tensor-parallel follower died while starting: {'; '.join(dead)}")
        if time.monotonic() > deadline:
            raise DistributedError(f"tensor-parallel followers did not start within {timeout_s:.0f}s")
        time.sleep(0.02)


def join_spawned(spec: WorkerSpec, rank: int, port: int) -> DistContext:
    """Follower side of `_spawn`."""
    store = dist.TCPStore("127.0.0.1", port, spec.tp, is_master=False,
                          timeout=timedelta(seconds=spec.timeout_s))
    store.set(f"treeflash/joined/{rank}", "1")
    device = rank_device(torch.device(spec.device), rank)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=spec.tp,
                            timeout=timedelta(seconds=spec.timeout_s))
    return _context(spec, rank, device, "spawn", [], store)


def _context(spec: WorkerSpec, rank: int, device: torch.device, launcher: str, procs,
             store) -> DistContext:
    ctrl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    dcp_group = None
    for first in range(0, spec.tp, spec.dcp) if spec.dcp > 1 else ():  # every rank creates every group
        group = dist.new_group(list(range(first, first + spec.dcp)), timeout=timedelta(seconds=spec.timeout_s))
        if first <= rank < first + spec.dcp:
            dcp_group = group
    par = Parallel(tp_size=spec.tp, tp_rank=rank, ep_size=spec.ep, group=dist.group.WORLD,
                   dcp_size=spec.dcp, dcp_group=dcp_group)
    comm = device if backend_for(device) == "nccl" else torch.device("cpu")
    return DistContext(rank, spec.tp, par, ctrl, device, comm, launcher,
                       timedelta(seconds=spec.timeout_s), procs, store=store)


def make_spec(model_path: Path, tp: int, ep: int, device: torch.device, dtype: torch.dtype,
              attention_impl: str | None, dcp: int = 1) -> WorkerSpec:
    from treeflash.parallel.protocol import DTYPE_CODES

    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype} is not supported under tensor parallelism")
    return WorkerSpec(str(model_path), tp, ep, str(device), str(dtype).removeprefix("torch."),
                      attention_impl, dist_timeout().total_seconds(), torch.get_num_threads(), dcp)


def log(rank: int, msg: str) -> None:
    print(f"treeflash tp rank {rank}: {msg}", file=sys.stderr, flush=True)
