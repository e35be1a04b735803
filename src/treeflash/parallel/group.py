"""The tensor-parallel group once joined: what a follower is started with (`WorkerSpec`), each
rank's view of the group (`DistContext`: its shard, the two process groups, the spawned
followers and their watch) and the follower's side of a spawned start (`join_spawned`).
`launch.py` starts the group; `worker.py` runs a follower in it."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from treeflash import knobs
from treeflash.parallel.errors import Raised, ended, how_it_ended
from treeflash.parallel.watch import FollowerWatch
from treeflash.runtime import DEFAULT, RuntimeOptions
from treeflash.sharding import Parallel

IDLE_TIMEOUT = timedelta(days=365)  # a follower waits this long for rank 0's next step



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
    runtime_options: RuntimeOptions = DEFAULT  # as rank 0's: every rank runs the same kernels
    dcp: int = 1  # decode context parallelism: ranks a request's latent cache is dealt across


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


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, index: int) -> torch.device:
    if device.type != "cuda":
        return device
    dev = torch.device("cuda", (device.index or 0) + index)
    torch.cuda.set_device(dev)
    return dev


def join_spawned(spec: WorkerSpec, rank: int, port: int) -> DistContext:
    """Follower side of `_spawn`."""
    store = dist.TCPStore("127.0.0.1", port, spec.tp, is_master=False,
                          timeout=timedelta(seconds=spec.timeout_s))
    store.set(f"treeflash/joined/{rank}", "1")
    device = rank_device(torch.device(spec.device), rank)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=spec.tp,
                            timeout=timedelta(seconds=spec.timeout_s))
    return make_context(spec, rank, device, "spawn", [], store)


def make_context(spec: WorkerSpec, rank: int, device: torch.device, launcher: str, procs,
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
