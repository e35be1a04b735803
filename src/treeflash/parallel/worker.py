"""Follower ranks: load this rank's shard, then run every step rank 0 announces, until SHUTDOWN.

A follower owns a KV pool of the same geometry as rank 0's (rank 0's allocator decides
the page ids, which arrive in each message) and runs the same forward and commit on it;
its hidden states are dropped (rank 0 holds the same values after the all-reduces).
Any error ends the process with a non-zero exit code. A lost peer (a collective failed)
is only logged; an exception of its own (a malformed message, out of memory, a bug) is
first left in the group's store with its traceback (`errors.Raised`), where rank 0 finds
it when its own collective fails, and names this rank and the exception.
"""

from __future__ import annotations

import os
import threading
import time
import traceback

import torch
import torch.distributed as dist

from treeflash.kvcache import KVPool
from treeflash.kvcache.defrag import move_pages
from treeflash.models.dcp import commit_rows
from treeflash.models.loader import load_target
from treeflash.models.mla import AttnBatch
from treeflash.parallel import protocol
from treeflash.parallel.errors import Raised, log
from treeflash.parallel.group import DistContext, WorkerSpec, join_spawned
from treeflash.parallel.protocol import CommitSizes, ForwardSizes, Header, Op, ProtocolError
from treeflash.sharding import CollectiveError, collective


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
    except CollectiveError as e:  # a peer is gone or hung: whoever failed reports it, not this rank
        log(ctx.rank, f"lost the group ({e}); exiting")
    except Exception as e:
        raised = Raised.of(ctx.rank, e, traceback.format_exc())
        if report(ctx, raised):
            log(ctx.rank, f"raised {raised.what()}; exiting (rank 0 shows the traceback)")
        else:
            log(ctx.rank, f"raised {raised.what()}; exiting\n{raised.traceback}")
    return 1


def report(ctx: DistContext, raised: Raised) -> bool:
    """Leave `raised` in the store before this process exits and breaks the collectives, so it
    is there when rank 0 looks; False if the store cannot be reached (rank 0 is gone)."""
    try:
        ctx.store.set(Raised.key(ctx.rank), raised.encode())
        # set() does not wait for the store; check() is a round trip behind it on this connection.
        return bool(ctx.store.check([Raised.key(ctx.rank)]))
    except Exception:
        return False


class Follower:
    def __init__(self, ctx: DistContext, spec: WorkerSpec):
        self.ctx, self.impl = ctx, spec.attention_impl
        dtype = getattr(torch, spec.dtype)
        self.model = load_target(spec.model_path, ctx.device, dtype, ctx.parallel, spec.runtime_options)
        self.pool: KVPool | None = None
        self.seq = 0

    def _recv_header(self) -> Header:
        t = torch.empty(protocol.HEADER_LEN, dtype=torch.int64)
        with collective():
            dist.broadcast(t, 0, group=self.ctx.ctrl_group)
        header = Header.decode(t, self.seq)
        self.seq += 1
        return header

    def _recv(self, n: int, dtype=torch.int64) -> torch.Tensor:
        t = torch.empty(n, dtype=dtype, device=self.ctx.comm_device)
        with collective():
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
        elif header.op is Op.MOVE:
            self._move(protocol.move_size(header.args, self.pool.num_pages))
        return True

    def _init(self, args: tuple[int, ...]) -> None:
        from treeflash.parallel.executor import check_fingerprints, fingerprint

        num_pages, page_size, dim, layers, dtype_code, fmt = args[:6]
        if (dtype_code not in protocol.DTYPES or fmt not in protocol.KV_FORMATS
                or min(num_pages, page_size, dim, layers) < 1):
            raise ProtocolError(f"INIT: bad pool geometry {args[:6]}")
        self.pool = KVPool(layers, num_pages, page_size, dim, protocol.DTYPES[dtype_code], self.ctx.device,
                           kv_cache_dtype=protocol.KV_FORMATS[fmt], v_dim=self.model.cfg.kv_lora_rank,
                           dcp=self.ctx.parallel.dcp_size)
        check_fingerprints(self.ctx, fingerprint(self.model, self.pool))

    def _forward(self, s: ForwardSizes) -> None:
        ints = self._recv(s.num_ints)
        mask = self._recv(s.batch * s.rows * s.rows, torch.uint8) if s.has_mask else None
        ids, positions, table, prefix = protocol.unpack_forward(ints, s)
        kv = self._kv(s.factor)
        protocol.check_pages(table, kv.shape[1])
        dev = self.ctx.device
        batch = AttnBatch(
            page_table=table.to(dev), prefix_lens=prefix.to(dev),
            tree_mask=None if mask is None else mask.view(s.batch, s.rows, s.rows).to(dev, torch.bool),
            impl=self.impl, deal_unit=self.pool.page_size, commit_later=s.commit_later,
        )
        with torch.inference_mode():
            self.model(ids.to(dev), positions.to(dev), kv, batch)

    def _kv(self, factor: int) -> torch.Tensor:
        """The pool as rank 0's table addresses it (its coarse view when factor > 1)."""
        try:
            return self.pool.kv_as(factor)
        except ValueError as e:
            raise ProtocolError(f"page tables of {factor} pages a page: {e}") from None

    def _commit(self, s: CommitSizes) -> None:
        table, prefix, accept, rows = protocol.unpack_commit(self._recv(s.num_ints), s)
        kv = self._kv(s.factor)
        protocol.check_pages(table, kv.shape[1])
        dev = self.ctx.device
        commit_rows(self.model, kv, table.to(dev), prefix.to(dev, torch.int32), accept.to(dev), rows.to(dev),
                    self.pool.page_size, self.impl)

    def _move(self, k: int) -> None:
        src, dst = self._recv(2 * k).split([k, k])
        protocol.check_pages(torch.stack([src, dst]), self.pool.num_pages - 1)
        move_pages(self.pool.kv, src.to(self.ctx.device), dst.to(self.ctx.device))
