"""Follower ranks: load this rank's shard, then run every step rank 0 announces, until SHUTDOWN.

A follower owns a KV pool of the same geometry as rank 0's (rank 0's allocator decides
the page ids, which arrive in each message) and runs the same forward and commit on it;
its hidden states are dropped (rank 0 holds the same values after the all-reduces).
Any error (a malformed message, a lost peer, its own failure) ends the process with a
message on stderr and a non-zero exit code, which rank 0 reports.
"""

from __future__ import annotations

import os
import threading
import time
import traceback

import torch
import torch.distributed as dist

from treeflash import kernels
from treeflash.dist import protocol
from treeflash.dist.launch import DistContext, WorkerSpec, join_spawned, log
from treeflash.dist.protocol import CommitSizes, ForwardSizes, Header, Op, ProtocolError
from treeflash.kvcache import KVPool
from treeflash.models.loader import load_target
from treeflash.models.mla import AttnBatch


def follower_main(spec: WorkerSpec, rank: int, port: int, parent_pid: int) -> None:
    """Entry point of a spawned follower process."""
    torch.set_num_threads(spec.num_threads)
    _watch_parent(parent_pid, rank)
    try:
        ctx = join_spawned(spec, rank, port)
    except Exception as e:
        log(rank, f"could not join the group: {e}")
        os._exit(1)
    code = run_follower(ctx, spec)
    ctx.destroy()
    os._exit(code)  # skip interpreter teardown: nothing left to flush, and it cannot hang


def _watch_parent(parent_pid: int, rank: int) -> None:
    """Exit if rank 0's process disappears (an orphan would wait for steps forever)."""

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                log(rank, f"rank 0 (pid {parent_pid}) is gone; exiting")
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="treeflash-parent-watch").start()


def run_follower(ctx: DistContext, spec: WorkerSpec) -> int:
    """Serve rank 0's steps; returns the process exit code (0 after SHUTDOWN)."""
    try:
        follower = Follower(ctx, spec)
        while follower.serve_one():
            pass
        return 0
    except ProtocolError as e:
        log(ctx.rank, f"protocol error, leaving the group: {e}")
    except RuntimeError as e:  # the usual form of a lost peer (gloo / NCCL)
        log(ctx.rank, f"lost the group ({type(e).__name__}: {e}); exiting")
    except Exception:
        log(ctx.rank, "failed:\n" + traceback.format_exc())
    return 1


class Follower:
    def __init__(self, ctx: DistContext, spec: WorkerSpec):
        self.ctx, self.impl = ctx, spec.attention_impl
        dtype = getattr(torch, spec.dtype)
        self.model = load_target(spec.model_path, ctx.device, dtype, ctx.parallel)
        self.pool: KVPool | None = None
        self.seq = 0

    def _recv_header(self) -> Header:
        t = torch.empty(protocol.HEADER_LEN, dtype=torch.int64)
        dist.broadcast(t, 0, group=self.ctx.ctrl_group)
        header = Header.decode(t, self.seq)
        self.seq += 1
        return header

    def _recv(self, n: int, dtype=torch.int64) -> torch.Tensor:
        t = torch.empty(n, dtype=dtype, device=self.ctx.comm_device)
        dist.broadcast(t, 0, group=self.ctx.parallel.group)
        return t

    def serve_one(self) -> bool:
        header = self._recv_header()
        if header.op is Op.SHUTDOWN:
            return False
        if header.op is Op.INIT:
            self._init(header.args)
        elif self.pool is None:
            raise ProtocolError(f"{header.op.name} before INIT")
        elif header.op is Op.FORWARD:
            self._forward(ForwardSizes.from_args(header.args, self.pool.num_pages))
        elif header.op is Op.COMMIT:
            self._commit(CommitSizes.from_args(header.args, self.pool.num_pages))
        return True

    def _init(self, args: tuple[int, ...]) -> None:
        from treeflash.dist.executor import check_fingerprints, fingerprint

        num_pages, page_size, dim, layers, dtype_code = args[:5]
        if dtype_code not in protocol.DTYPES or min(num_pages, page_size, dim, layers) < 1:
            raise ProtocolError(f"INIT: bad pool geometry {args[:5]}")
        self.pool = KVPool(layers, num_pages, page_size, dim, protocol.DTYPES[dtype_code], self.ctx.device)
        check_fingerprints(self.ctx, fingerprint(self.model, self.pool))

    def _forward(self, s: ForwardSizes) -> None:
        ints = self._recv(s.num_ints)
        mask = self._recv(s.batch * s.rows * s.rows, torch.uint8) if s.has_mask else None
        ids, positions, table, prefix = protocol.unpack_forward(ints, s)
        protocol.check_pages(table, self.pool.num_pages)
        dev = self.ctx.device
        batch = AttnBatch(
            page_table=table.to(dev), prefix_lens=prefix.to(dev),
            tree_mask=None if mask is None else mask.view(s.batch, s.rows, s.rows).to(dev, torch.bool),
            impl=self.impl,
        )
        with torch.inference_mode():
            self.model(ids.to(dev), positions.to(dev), self.pool.kv, batch)

    def _commit(self, s: CommitSizes) -> None:
        table, prefix, accept, rows = protocol.unpack_commit(self._recv(s.num_ints), s)
        protocol.check_pages(table, self.pool.num_pages)
        dev = self.ctx.device
        kernels.kv_commit(self.pool.kv, table.to(dev), prefix.to(dev, torch.int32), accept.to(dev),
                          rows.to(dev), impl=self.impl)
