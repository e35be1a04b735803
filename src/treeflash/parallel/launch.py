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
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from treeflash.parallel.errors import DistributedError, how_it_ended
from treeflash.parallel.group import DistContext, WorkerSpec, backend_for, dist_timeout, make_context, rank_device
from treeflash.runtime import DEFAULT, RuntimeOptions


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


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
    return make_context(spec, rank, device, "torchrun", [], store)


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
        ctx = make_context(spec, 0, device, "spawn", procs, store)
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


def make_spec(model_path: Path, tp: int, ep: int, device: torch.device, dtype: torch.dtype,
              attention_impl: str | None, options: RuntimeOptions = DEFAULT, dcp: int = 1) -> WorkerSpec:
    from treeflash.parallel.protocol import DTYPE_CODES

    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype} is not supported under tensor parallelism")
    return WorkerSpec(str(model_path), tp, ep, str(device), str(dtype).removeprefix("torch."),
                      attention_impl, dist_timeout().total_seconds(), torch.get_num_threads(), options, dcp)


