"""`DistributedExecutor`: the engine's executor seam on rank 0 of a tensor-parallel group.

Same methods as `engine.executor.LocalExecutor`, which it wraps: the engine builds rank 0's
local executor and hands it in, so this package never imports the engine above it. Each
forward or commit first sends the step to the followers (header on the control group, then one int64 payload and, for a
tree, the mask, on the compute group), then runs rank 0's own shard through the local executor; the all-reduces
inside the model line the ranks up. Hidden states, taps and logits exist only here:
embedding and lm_head are replicated, so `logits` is local. Any failure (a follower
gone, a collective timing out, an exception halfway through a step) leaves the ranks out
of step, so the executor kills the followers it spawned, leaves the group and raises
`DistributedError`; later calls raise the same error at once. A follower that exits while
rank 0 is inside a step is seen by the context's watch (`watch.FollowerWatch`), which aborts
the groups so that the step's collective returns; the step then fails with the watch's cause,
even if its collectives returned without an error (an aborted NCCL one does).
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from treeflash.kvcache import KVPool
from treeflash.models.target import TargetModel
from treeflash.parallel import protocol
from treeflash.parallel.errors import DistributedError, Raised, log
from treeflash.parallel.group import IDLE_TIMEOUT, DistContext
from treeflash.parallel.protocol import CommitSizes, ForwardSizes, Header, Op
from treeflash.sharding import collective


def fingerprint(model: TargetModel, pool: KVPool) -> torch.Tensor:
    """What every rank must agree on: versions, parallel layout, model and pool geometry."""
    cfg, par, kv = model.cfg, model.parallel, pool.kv
    return torch.tensor([
        protocol.VERSION, par.tp_size, par.ep_size, par.dcp_size, pool.dcp, cfg.vocab_size, cfg.hidden_size,
        cfg.num_hidden_layers, cfg.num_attention_heads, cfg.n_routed_experts, *kv.shape,
        protocol.DTYPE_CODES[kv.dtype],
    ], dtype=torch.int64)


def check_fingerprints(ctx: DistContext, mine: torch.Tensor) -> None:
    every = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    with collective():
        work = dist.all_gather(every, mine, group=ctx.ctrl_group, async_op=True)
        # Followers may wait on the control group indefinitely; rank 0 never does.
        work.wait(timeout=IDLE_TIMEOUT if not ctx.is_leader else ctx.timeout)
    for rank, theirs in enumerate(every):
        if not torch.equal(theirs, every[0]):
            raise DistributedError(
                f"rank {rank} disagrees with rank 0 on the model or pool: {theirs.tolist()} vs "
                f"{every[0].tolist()} (same checkpoint, tp, ep, dcp and dtype on every rank?)"
            )


class DistributedExecutor:
    """`local`: rank 0's `engine.executor.LocalExecutor` over its shard of the model and its pool."""

    def __init__(self, local, ctx: DistContext):
        if not ctx.is_leader:
            raise DistributedError("DistributedExecutor runs on rank 0 only")
        self.local, self.ctx = local, ctx
        self.model, self.pool, self.attention_impl = local.model, local.pool, local.attention_impl
        self.device = local.device
        self.graphs = None  # CUDA graphs are one process's (`enable_graphs` refuses them)
        self.failure: str | None = None
        self.closed = False
        kv, fmt = self.pool.kv, self.pool.format
        with self._step("INIT"):
            self._send(Op.INIT, (kv.shape[1], kv.shape[2], fmt.dim, kv.shape[0],
                                 protocol.DTYPE_CODES[fmt.dtype], protocol.KV_FORMAT_CODES[fmt.name]))
            check_fingerprints(ctx, fingerprint(self.model, self.pool))
        # Followers must not outlive rank 0's interpreter, even without an explicit shutdown.
        ref = weakref.ref(self)
        atexit.register(lambda: (e := ref()) is not None and e.shutdown())
        # defragmentation's page moves (`kvcache.defrag`) reach the followers' pools as MOVE steps
        self.moves_pages = True
        self.pool.on_move = lambda src, dst: (e := ref()) is not None and e.move(src, dst)

    # ---- the seam ----------------------------------------------------------------
    def enable_graphs(self, mode: str, *, max_rows: int, max_batch: int) -> None:
        raise ValueError("CUDA graphs are not supported with tensor parallelism yet (tp must be 1)")

    @property
    def coarse(self) -> bool:
        return self.local.coarse

    @coarse.setter
    def coarse(self, on: bool) -> None:
        self.local.coarse = on

    def paged(self, page_lists: Sequence[list[int]]):
        return self.local.paged(page_lists)

    def prefix_tensor(self, prefix_lens) -> torch.Tensor:
        return self.local.prefix_tensor(prefix_lens)

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        return self.local.logits(hidden, float32)

    def forward(
        self,
        page_lists: Sequence[list[int]],
        input_ids: torch.Tensor,  # [B, N]
        positions: torch.Tensor,  # [B, N]
        prefix_lens: Sequence[int],
        tree_mask: torch.Tensor | None = None,  # [B, N, N]
        taps: Sequence[int] = (),
        commit_later: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self._step("forward"):
            paged = self.paged(page_lists)
            table = paged.table
            b, n = input_ids.shape
            sizes = ForwardSizes(b, n, table.shape[1], tree_mask is not None, paged.factor, commit_later)
            self._send(Op.FORWARD, sizes.args)
            self._payload(protocol.pack([input_ids, positions, table, torch.tensor(list(prefix_lens))],
                                        self.ctx.comm_device))
            if tree_mask is not None:
                self._payload(tree_mask.reshape(-1).to(self.ctx.comm_device, torch.uint8))
            return self.local.forward(page_lists, input_ids, positions, prefix_lens, tree_mask, taps,
                                      commit_later=commit_later)

    def commit(
        self,
        page_lists: Sequence[list[int]],
        prefix_lens: torch.Tensor,  # [B]
        accept_idx: torch.Tensor,  # [B, M]
        num_rows: torch.Tensor,  # [B]
    ) -> None:
        with self._step("commit"):
            paged = self.paged(page_lists)
            table = paged.table
            sizes = CommitSizes(accept_idx.shape[0], accept_idx.shape[1], table.shape[1], paged.factor)
            self._send(Op.COMMIT, sizes.args)
            self._payload(protocol.pack([table, prefix_lens, accept_idx, num_rows], self.ctx.comm_device))
            self.local.commit(page_lists, prefix_lens, accept_idx, num_rows)

    def move(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Move the followers' pages as rank 0's pool just moved (kv[:, dst[i]] = kv[:, src[i]])."""
        if not len(src):
            return
        with self._step("move"):
            self._send(Op.MOVE, (len(src),))
            self._payload(protocol.pack([torch.as_tensor(src), torch.as_tensor(dst)], self.ctx.comm_device))

    def check(self) -> None:
        """Raise `DistributedError` if the group has failed, the last step included. On NCCL a
        step's collectives may still be running when `forward` returns, and one that the watch
        aborted returns without an error: whoever waits for the step's results (the engine,
        reading the sampled tokens back) can call this after that wait, before using them."""
        if self.failure is not None:
            raise DistributedError(self.failure)
        if self._watch_fired():
            self._fail("the last step", None, [])

    def shutdown(self) -> None:
        """Tell the followers to exit and leave the group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.ctx.stop_watch()  # the followers are about to exit: that is no failure
        if self.failure is None and self._watch_fired():  # one died while rank 0 was idle
            self.failure = f"tensor-parallel group failed between steps: {self.ctx.watch.cause}"
            _show(self.ctx.raised())
            log(0, self.failure)
        if self.failure is None:
            with contextlib.suppress(Exception):
                self._send(Op.SHUTDOWN)
                for p in self.ctx.followers:
                    p.join(timeout=10)
            _show(self.ctx.raised())  # a follower that raised after rank 0's last collective
        self.ctx.abort()  # kills any follower that did not exit

    # ---- plumbing ----------------------------------------------------------------
    def _send(self, op: Op, args: tuple[int, ...] = ()) -> None:
        # The control group's own timeout is for idle followers; rank 0 waits at most ctx.timeout
        # (gloo's send waits for the receiver, so a hung follower would block it here).
        work = dist.broadcast(Header(self.ctx.seq, op, args).encode(), 0, group=self.ctx.ctrl_group,
                              async_op=True)
        work.wait(timeout=self.ctx.timeout)
        self.ctx.seq += 1  # on the context: a later executor on the same group (a new pool) goes on

    def _payload(self, t: torch.Tensor) -> None:
        dist.broadcast(t, 0, group=self.ctx.parallel.group)

    @contextlib.contextmanager
    def _step(self, what: str):
        if self.failure is not None:
            raise DistributedError(self.failure)
        if self.closed:
            raise DistributedError("the tensor-parallel group was shut down")
        dead = self.ctx.dead_followers()
        if dead or self._watch_fired():
            self._fail(what, None, dead)
        try:
            yield
        except BaseException as e:  # the ranks are out of step now, whatever went wrong
            self._fail(what, e, self._dead_after_failure())
        if self._watch_fired():  # the group broke during the step: its results are not to be trusted
            self._fail(what, None, [])

    def _watch_fired(self) -> bool:
        return self.ctx.watch is not None and self.ctx.watch.fired.is_set()

    def _dead_after_failure(self) -> list[str]:
        """The followers gone after a collective failed, given a dying one a moment to be seen."""
        if self.ctx.watch is not None and self.ctx.watch.running:
            self.ctx.watch.fired.wait(2.0)
            return self.ctx.dead_followers()
        return self.ctx.dead_followers(wait_s=2.0 if self.ctx.followers else 0.0)

    def _fail(self, what: str, exc: BaseException | None, dead: list[str]) -> None:
        raised = self.ctx.raised()  # a follower's own exception is the cause, not the lost peer
        watched = self.ctx.watch.cause if self._watch_fired() else None
        if raised:
            _show(raised)
            cause = "; ".join(r.line() for r in raised)
        elif watched:  # the first follower to exit; the others most likely only lost it
            cause = watched
        elif dead:
            cause = "; ".join(dead)
        elif exc is not None and "timed out" in str(exc).lower():
            cause = (f"a rank did not answer within {self.ctx.timeout.total_seconds():g}s "
                     f"(TREEFLASH_DIST_TIMEOUT): hung or far behind ({type(exc).__name__}: {exc})")
        else:
            cause = f"{type(exc).__name__}: {exc}"
        self.failure = f"tensor-parallel group failed during {what}: {cause}"
        self.closed = True
        self.ctx.abort()
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise exc
        raise DistributedError(self.failure) from exc


def _show(raised: list[Raised]) -> None:
    for r in raised:
        log(0, f"{r.line()}; its traceback:\n{r.traceback.rstrip()}")
