"""The speculative step for a batch: propose, build the tree, verify, walk, commit.

Per step and request: the drafter proposes a block from [bonus, MASK...] over its cached
context; DDTree (or the DFlash chain) turns the block's marginals into a tree; the target
computes every tree node in one forward with the ancestor mask, writing the nodes'
latents after the committed prefix; the walk follows the target's own tokens; the
accepted nodes' latents move into sequential slots (`kernels.kv_commit`); the drafter's
cache is extended with the accepted nodes' tapped features. Tree build, walk and commit
run on the device where the tensors live; the host learns only the tokens it emits and
the counts, in one small copy at the end of the step.

On CUDA by default (TREEFLASH_OVERLAP=0 opts out) the step also queues, before it waits for that copy,
its append to the drafter caches and the next step's proposal (both read the accepted count
and the bonus token on the device), so the device drafts step i+1 while the host processes
step i.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from treeflash import knobs
from treeflash.engine.graphs import buffers_key, capture_seconds
from treeflash.engine.sampling import choose_tokens_batch
from treeflash.spec.budget import CANDIDATES, BudgetController, FloorCost, candidate_bounds
from treeflash.spec.build import build_tree, check_budget, tree_width
from treeflash.spec.metrics import MetricsContradiction, SpecMetrics
from treeflash.spec.tree import DraftTree
from treeflash.spec.verify import walk_tree

if TYPE_CHECKING:  # kernels.tree_build imports Triton: not needed on the CPU (a base install has none)
    from treeflash.kernels.tree_build import TreeOut

# 31 drafted + the root = 32 verify rows: with 8 heads (kimi-k2-tp8) four whole 64-row tiles of
# the verify kernel; budget 32 pays a fifth tile for 8 rows (H200, 2026-12-02/03: the sweep's
# step 4-9% slower from 64k up; the shipped pair 2.12x spec off at 31).
DEFAULT_TREE_BUDGET = 31
log = logging.getLogger(__name__)

# Tests set this to True or False to run either step whatever TREEFLASH_OVERLAP says.
OVERLAP: bool | None = None


def overlap_enabled(device: torch.device | str = "cuda") -> bool:
    """Whether a SpecDecoder on `device` overlaps its steps (SpecDecoder.step): on CUDA by
    default, TREEFLASH_OVERLAP=0 / =1 forces it off / on anywhere. On the CPU the "device" work
    runs in the host's own thread, so there is nothing to overlap, and the masked append's fixed
    block is only more work (the shipped pair on this project's 2-core CPU, one pass each,
    budgets 8 / 16 / 32: 101 / 96 / 106 decode tok/s overlapped against 121 / 107 / 92
    sequential, within this box's drift; sequential kept).
    Lossless on the CPU (tests/engine/test_overlap.py) and on the H200 in float32 (same tokens
    as spec off). Default since session 10 (results/h200-20261203-overlap-ab,
    shipped pair, bf16, 5 rounds each, same call): ddtree-31 5994 decode tok/s overlapped
    against 5399 sequential (2.88x / 2.68x spec off), ddtree-15 5753 / 5190. Session 6 had
    measured no gain (2.07x / 2.12x): then the device's own step was ~1.1 ms and the host's
    share hidden behind it small; with ~70 fewer launches a step the host had become the
    critical path."""
    if OVERLAP is not None:
        return OVERLAP
    flag = knobs.get("TREEFLASH_OVERLAP")
    if flag is not None:
        return flag == "1"
    return torch.device(device).type == "cuda"


@dataclass
class SpecState:
    """A request's speculative state: its drafter cache, next root token and counters."""

    cache: object
    bonus: int
    metrics: SpecMetrics


@dataclass
class PendingDraft:
    """The next step's tree, queued on the device by the overlapped step before the host
    had processed the step (so before it knew which requests finish)."""

    reqs: list  # the requests it was proposed for, in order
    budget: int
    tree: DraftTree

    def serves(self, reqs) -> bool:
        """Only the very same requests in the same order may use it: a finished or a newly
        joined request changes every row's place (and, at batch > 1, the padding)."""
        return len(reqs) == len(self.reqs) and all(a is b for a, b in zip(reqs, self.reqs, strict=True))


@dataclass
class HostCopy:
    """A device tensor on its way into pinned host memory. The device may run work queued
    behind the copy meanwhile; a copy into pageable memory (.tolist() of the device
    tensor) would wait for that work too."""

    values: torch.Tensor
    done: torch.cuda.Event | None = None

    @staticmethod
    def start(src: torch.Tensor, buffers: dict) -> HostCopy:
        """Queue src's copy into a pinned buffer from `buffers` (one per shape, reused: the
        host has read the last copy out of it before the next is queued)."""
        if src.device.type != "cuda":
            return HostCopy(src)
        buf = buffers.get(src.shape)
        if buf is None:
            buf = buffers[src.shape] = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        buf.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(src.device))
        return HostCopy(buf, done)

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.values


@dataclass
class PhaseTimer:
    """Wall time per phase of a step (synchronising the device when enabled)."""

    enabled: bool = False
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def mark(self, device: torch.device) -> float:
        if self.enabled and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def add(self, phase: str, t0: float, device: torch.device) -> float:
        t1 = self.mark(device)
        if self.enabled:
            self.seconds[phase] += t1 - t0
        return t1


class SpecDecoder:
    """budget: an int pins the DDTree node budget; "auto" lets a `BudgetController` pick it
    from {7, 15, 31, 63, 127} every few steps (see spec/budget.py); None = DEFAULT_TREE_BUDGET (31)."""

    def __init__(self, drafter, mode: str, budget: int | str | None, *,
                 candidates: tuple[int, ...] = CANDIDATES, floor=None):
        if mode not in ("ddtree", "dflash"):
            raise ValueError(f"spec must be 'ddtree' or 'dflash', got {mode!r}")
        self.drafter = drafter
        self.mode = mode
        depth = drafter.block_size - 1
        self.auto = mode == "ddtree" and budget == "auto"
        if self.auto:
            for c in candidates:
                check_budget(c)
            self.candidates = tuple(sorted(set(candidates)))
            self.budget = self.candidates[-1]  # the widest tree a step may verify
        else:
            self.candidates = ()
            self.budget = depth if mode == "dflash" else check_budget(budget or DEFAULT_TREE_BUDGET)
        self._floor = floor  # floor(budget, contexts) -> s; default: bench/floors.py, built lazily
        self._host_in: dict[tuple[int, int], torch.Tensor] = {}  # (rows, batch) -> pinned step input
        self._dev_in: dict[torch.Size, torch.Tensor] = {}  # its device copy, one buffer per shape
        self._tree_outs: dict[tuple[int, int], TreeOut | None] = {}  # (batch, budget) -> _tree_out
        self._feats_static = False  # this step's accepted features are a tail graph's static output
        self._host_out: dict[torch.Size, torch.Tensor] = {}  # pinned buffers of the overlapped copy
        # Overlapping needs a drafter that appends from counts on the device (DFlashDrafter);
        # the test drafters count on the host and keep the sequential step.
        device = getattr(getattr(drafter, "embed_weight", None), "device", "cpu")
        self.overlap = overlap_enabled(device) and getattr(drafter, "supports_static_propose", False)
        self._pending: PendingDraft | None = None  # the overlapped step's next tree
        self.forced_budget: int | None = None  # LLM.warmup: this budget, unobserved by auto
        self.controller: BudgetController | None = None
        self.timer = PhaseTimer()
        self.draft_graphs = None  # spec.draft_graphs.DraftGraphs once enable_graphs() is called
        self.tail_graphs = None  # spec.tail_graphs.TailGraphs, likewise

    def enable_graphs(self, mode: str, *, tail: bool = True) -> None:
        """Propose + tree build of a batch-1 step from one CUDA graph ("cuda") or the same
        static path eagerly ("eager"), see spec/draft_graphs.py; tail: also lm_head, walk,
        commit and the host row of a greedy batch-1 step (spec/tail_graphs.py)."""
        from treeflash.spec.draft_graphs import DraftGraphs
        from treeflash.spec.tail_graphs import TailGraphs

        self.draft_graphs = DraftGraphs(self.drafter, mode)
        self.tail_graphs = TailGraphs(mode) if tail else None

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return tuple(self.drafter.target_layer_ids)

    @property
    def verify_width(self) -> int:
        """Rows per request of the widest verify (KV is reserved for it)."""
        return self.budget + 1

    def new_metrics(self) -> SpecMetrics:
        return SpecMetrics(tree_budget=self.budget, spec_mode=self.mode,
                           max_depth=self.drafter.block_size - 1)

    # ---- engine hooks ------------------------------------------------------------
    def on_prefill(self, engine, req, features: torch.Tensor, first_token: int) -> None:
        cache = self.drafter.new_cache(req.prompt_ids)
        positions = torch.arange(features.shape[0], device=features.device)
        self.drafter.extend(cache, features, positions)
        req.spec_state = SpecState(cache, first_token, self.new_metrics())

    def on_finish(self, req) -> None:
        if self._pending is not None and any(r is req for r in self._pending.reqs):
            self._pending = None  # proposed for a batch that will not run again
        state = req.spec_state
        if state is not None:
            summary = state.metrics.to_dict()
            if self.auto:
                summary["tree_budget"] = "auto"
                summary["tree_budget_max"] = self.budget
                if self.controller is not None:  # the engine's current pick (shared by the batch)
                    summary["tree_budget_choice"] = self.controller.choice
            try:  # figures that contradict each other are a bug: say so on the output itself
                state.metrics.check_invariants(len(req.output_ids))
            except MetricsContradiction as e:
                log.error("request %s: speculative metrics contradict: %s", req.request_id, e)
                summary["invariant_error"] = str(e)
            req.metrics["speculative_decoding"] = summary
            release = getattr(self.drafter, "release_cache", None)
            if release is not None:  # its buffers serve the next request (and its draft graphs)
                release(state.cache)
            req.spec_state = None

    def step_budget(self, engine, contexts: list[int]) -> int:
        """This step's node budget: forced (warm-up), pinned, or the controller's choice."""
        if self.forced_budget is not None:
            return self.forced_budget
        if not self.auto:
            return self.budget
        if self.controller is None:
            self.controller = BudgetController(self._floor or self._default_floor(engine),
                                               self.drafter.block_size - 1, self.candidates)
        return self.controller.budget_for(contexts)

    def _default_floor(self, engine):
        from treeflash.bench import floors

        dtype = engine.pool.dtype  # the values' dtype (an fp8 cache stores uint8 rows)
        if engine.device.type == "cuda":
            ceilings = floors.default_ceilings(engine.device, dtype)
        else:  # a quick probe: only the floor's shape matters, the measured ratio scales it
            ceilings = floors.measure_ceilings(engine.device, dtype, seconds=0.02)
        return FloorCost(engine.model, getattr(self.drafter, "inner", self.drafter), ceilings)

    def step(self, engine, reqs) -> list[list[int]]:
        """One speculative step for `reqs`. Everything up to the walk's result stays on the
        device; the host then learns tokens and counts in one device-to-host copy.

        Overlapped (self.overlap), the step queues more device work before it waits for that
        copy (_queue_next): its append to the drafter caches and the next step's tree. The
        host's processing of this step (tokens, stop conditions, the next step's inputs and
        verify launch) then runs while the device drafts. The next step takes that tree only
        if it runs the very same requests; otherwise it is dropped, having written nothing
        but its own output buffers (the append was this step's, due either way)."""
        states = [r.spec_state for r in reqs]
        contexts = [r.num_cached for r in reqs]
        pending = self._take_pending(reqs)
        budget = pending.budget if pending is not None else self.step_budget(engine, contexts)
        captured_s = capture_seconds()
        t_step = time.perf_counter()  # the controller's own bookkeeping is not the budget's cost
        start, roots, first = self._step_inputs(engine, contexts, states)
        if pending is not None:
            tree = pending.tree
        else:
            tree = self._draft(engine, [s.cache for s in states], roots, start, budget)
        packed, feats = self._verify_walk(engine, reqs, tree, start, budget)
        if self.overlap:
            copy = HostCopy.start(packed, self._host_out)
            self._queue_next(engine, reqs, states, packed, feats, start, first, contexts)
            packed = copy.wait()
        host = self._to_host(packed)  # the step's one device-to-host copy (queued above if overlapped)
        t0 = self.timer.mark(engine.device)
        out = [self._advance(engine, req, state, row, feats[i], start[i])
               for i, (req, state, row) in enumerate(zip(reqs, states, host, strict=True))]
        self.timer.add("drafter_extend", t0, engine.device)
        if self.controller is not None and self.forced_budget is None:
            # The time this step spent capturing CUDA graphs (a new page-table bucket, a grown
            # drafter cache, a new accepted length) is not its budget's cost: on the H200
            # (2026-12-02) such samples priced budget 16 at 2.7 ms a step against a true
            # 1.25 ms, and auto held 64, 8% slower than pinned 16, for the rest of the run.
            # Dropping those steps instead left the small budgets with no sample at all.
            seconds = time.perf_counter() - t_step - (capture_seconds() - captured_s)
            self.controller.observe(budget, contexts, max(seconds, 1e-6),
                                    [row.under_candidates for row in host])
        return out

    def _take_pending(self, reqs) -> PendingDraft | None:
        """The tree the last step queued, if it serves these requests; dropped either way."""
        pending, self._pending = self._pending, None
        return pending if pending is not None and pending.serves(reqs) else None

    def _step_inputs(self, engine, contexts: list[int], states) -> tuple[torch.Tensor, ...]:
        """start [B], roots [B] and first [layers, B] on the device, from one pinned host copy:
        the contexts, the bonus tokens and (overlapped) each drafter layer's first slot for
        the step's masked append, once every layer has room for a whole block (a full layer
        grows here, on the host); first is empty when not overlapping."""
        rows = [contexts, [s.bonus for s in states]]
        if self.overlap:
            block = self.drafter.block_size
            rows += zip(*(s.cache.reserve(block) for s in states), strict=True)
        host_in = self._pinned_input(len(rows), len(states), engine.device)
        host_in.copy_(torch.tensor(rows, dtype=torch.long))
        # From pinned memory the copy is truly asynchronous (from pageable memory it would wait
        # for the stream, i.e. for the previous step's drafter append, before the host goes on).
        # Into one device buffer per shape: the draft graph reads start and roots where they are.
        dev = self._dev_in.get(host_in.shape)
        if dev is None:
            dev = self._dev_in[host_in.shape] = torch.empty(host_in.shape, dtype=torch.long, device=engine.device)
        dev.copy_(host_in, non_blocking=True)
        return dev[0], dev[1], dev[2:]

    def _pinned_input(self, rows: int, batch: int, device: torch.device) -> torch.Tensor:
        """[rows, batch] host buffer for the step's inputs: pinned on CUDA. Reused every step:
        the previous step's copy out of it finished before its host copy."""
        buf = self._host_in.get((rows, batch))
        if buf is None:
            pin = device.type == "cuda"
            buf = self._host_in[rows, batch] = torch.empty(rows, batch, dtype=torch.long, pin_memory=pin)
        return buf

    def _draft(self, engine, caches, roots, start, budget: int, *, queued: bool = False) -> DraftTree:
        """Propose and build the tree: one draft-graph replay (batch 1) or eagerly. queued:
        for the next step, ahead of the host's counts of the caches' valid slots (_queue_next),
        so an eager proposal reads every slot (`full`; a replay always does)."""
        dev, t = engine.device, self.timer
        t0 = t.mark(dev)
        if self.draft_graphs is not None and self.draft_graphs.handles(caches):
            out = self._tree_out(engine, len(caches), budget)  # the tree lands where verify reads it
            tree = self.draft_graphs.run(self.mode, caches, roots, start, budget, out=out)  # both, one replay
            t.add("drafter", t0, dev)
            return tree
        extra = {"full": True} if queued else {}
        draft_logits = self.drafter.propose(caches, roots, start, **extra)  # [B, D, V]
        t0 = t.add("drafter", t0, dev)
        tree = build_tree(self.mode, draft_logits, roots, start, budget)  # top-k reads any float dtype
        t.add("tree_build", t0, dev)
        return tree

    def _tree_out(self, engine, batch: int, budget: int) -> TreeOut | None:
        """The verify forward's static inputs for this step's tree (engine/graphs.py
        StepInputs), for the draft graph's build to write into; None without verify graphs."""
        graphs = getattr(engine.executor, "graphs", None)
        if graphs is None or knobs.is_set("TREEFLASH_TREE_INTO_VERIFY", "0"):  # (A/B runs)
            return None
        key = (batch, budget)
        if key not in self._tree_outs:
            depth, vocab = self.drafter.block_size - 1, self.drafter.vocab_size
            n = tree_width(self.mode, budget, depth, vocab)
            chain = self.mode == "dflash" or min(budget, vocab) == 1
            out = None
            if graphs.handles(batch, n):
                from treeflash.kernels.tree_build import TreeOut

                inp = graphs.static_inputs(batch, n, masked=not chain)
                out = TreeOut(inp.ids[:batch], inp.positions[:batch], None if chain else inp.mask[:batch],
                              inp.prefix_lens[:batch])
            self._tree_outs[key] = out
        return self._tree_outs[key]

    def _verify_walk(self, engine, reqs, tree: DraftTree, start, budget: int):
        """Verify, walk and commit, all on the device: (packed, feats), see _tail."""
        dev, t = engine.device, self.timer
        t0 = t.mark(dev)
        mask = None if tree.is_chain else tree.ancestor_mask
        out = self._tree_outs.get((len(reqs), budget))
        # a tree built into the verify's inputs came with its prefix lengths (int32) there too
        prefix = out.prefix_lens if out is not None and tree.tokens.data_ptr() == out.tokens.data_ptr() else start
        hidden, taps = engine.forward(reqs, tree.tokens, tree.positions, prefix, mask,
                                      taps=self.tap_layers, graphable=True)
        t0 = t.add("verify", t0, dev)  # lm_head is timed with the tail ("walk_commit")
        self._feats_static = False  # set by a tail-graph replay: feats is then its static output
        out = self._graphed_tail(engine, reqs, tree, hidden, taps, budget)
        if out is None:
            commit = partial(engine.executor.commit, [r.pages for r in reqs], start)
            out = self._tail(engine, reqs, tree, hidden, taps, commit)
        t.add("walk_commit", t0, dev)
        return out

    def _queue_next(self, engine, reqs, states, packed, feats, start, first, contexts) -> None:
        """The overlapped step's device work, queued before the host reads `packed`: each
        request's append of its accepted rows (a fixed block masked to the count in packed,
        on the device), then the next step's tree from the bonus tokens and start positions
        that are on the device too, unless a request is sure to finish at this step (max
        tokens: the batch will change and the tree would be dropped)."""
        dev, t = engine.device, self.timer
        t0 = t.mark(dev)
        width = feats.shape[1]  # max depth + 1: packed's token columns, then the accepted count
        accepted = packed[:, width]  # [B]
        counts = accepted + 1
        graphed = self.draft_graphs is not None and len(engine.running) == 1
        for i, state in enumerate(states):
            args = (state.cache, feats[i], start[i:i + 1], first[:, i], counts[i:i + 1])
            if graphed and self.draft_graphs.handles([state.cache]):
                self.draft_graphs.extend_masked(*args)
            else:
                self.drafter.extend_static(*args)
        t.add("drafter_extend", t0, dev)
        if any(len(r.output_ids) + 1 >= r.params.max_tokens for r in reqs):
            return
        roots = packed[:, :width].gather(1, accepted[:, None])[:, 0]
        budget = self.step_budget(engine, contexts)  # the next step's contexts are not known yet
        tree = self._draft(engine, [s.cache for s in states], roots, start + counts, budget, queued=True)
        self._pending = PendingDraft(list(reqs), budget, tree)

    def _tail(self, engine, reqs, tree: DraftTree, hidden, taps, commit) -> tuple[torch.Tensor, torch.Tensor]:
        """lm_head, token choice, walk, commit(accept_idx [B, D+1], num_rows [B]) and the
        accepted rows' features, on the device: (packed [B, W] long, what the host learns
        (see _to_host); feats [B, D+1, taps*hidden]). The graphed tail runs this very code."""
        # [B, N, V] in the model's dtype: choose_tokens_batch computes in float32 itself (the
        # argmax of bf16 logits is that of their float32 copy; process_logits casts first)
        logits = engine.logits(hidden, float32=False)
        post = choose_tokens_batch(logits, [r.params for r in reqs], [r.generator for r in reqs])
        walk = walk_tree(tree, post, candidate_bounds(self._candidates(), post.device) if self.auto else None)
        commit(walk.index, walk.rows)
        idx = walk.index[..., None].expand(-1, -1, taps.shape[-1])
        feats = taps.gather(1, idx)  # [B, D+1, taps*hidden]: the accepted rows' features
        return walk.packed, feats

    def _graphed_tail(self, engine, reqs, tree: DraftTree, hidden, taps, budget: int):
        """_tail from one CUDA graph (spec/tail_graphs.py) for one greedy request whose verify
        forward ran from the static buffers, committing over that forward's page table and
        prefix lengths (static too); None where that does not apply (the caller runs _tail)."""
        tg, graphs = self.tail_graphs, getattr(engine.executor, "graphs", None)
        if tg is None or tg.failure is not None or graphs is None or taps is None:
            return None
        if len(reqs) != 1 or not reqs[0].params.greedy:
            return None  # a draw from the request's own generator stays eager
        step = graphs.served(hidden)
        if step is None:
            return None
        tensors = [getattr(tree, f.name) for f in fields(tree) if isinstance(getattr(tree, f.name), torch.Tensor)]
        key = (self.mode, budget, self._candidates() if self.auto else (), tree.max_depth, tree.is_chain,
               buffers_key(hidden, taps, step.page_table, step.prefix_lens, step.kv, *tensors))
        commit = partial(graphs.commit, step)
        out = tg.run(key, lambda: self._tail(engine, reqs, tree, hidden, taps, commit), engine.device)
        self._feats_static = tg.last_static
        return out

    def _advance(self, engine, req, state: SpecState, row: HostRow, feats, start) -> list[int]:
        """Record the step, extend the drafter's cache, move the request on; its new tokens."""
        k = row.accepted
        state.metrics.record(row.drafted, k, row.depth)
        if self.overlap:
            state.cache.advance(k + 1)  # the rows themselves were queued on the device (_queue_next)
        elif self.draft_graphs is not None and self.draft_graphs.handles([state.cache]) and len(engine.running) == 1:
            # (req.num_cached is start's host value: the slots go in one host-to-device copy)
            self.draft_graphs.extend(state.cache, feats[: k + 1], req.num_cached,  # maybe a replay
                                     static=self._feats_static)
        else:
            self.drafter.extend(state.cache, feats[: k + 1], start + torch.arange(k + 1, device=feats.device))
        req.num_cached += k + 1
        for listener in engine.spec_listeners:
            listener(req, row.drafted, k)
        state.bonus = row.tokens[k]
        return row.tokens[: k + 1]

    def _candidates(self) -> tuple[int, ...]:
        return self.controller.candidates if self.controller is not None else self.candidates

    def _to_host(self, packed: torch.Tensor) -> list[HostRow]:
        """packed [B, W] (_tail): tokens (max depth + 1 columns), accepted, drafted, depth and
        (auto budget) the acceptance per candidate, in one device-to-host copy."""
        w = packed.shape[1] - 3 - (len(self._candidates()) if self.auto else 0)
        return [HostRow(r[:w], r[w], r[w + 1], r[w + 2], r[w + 3:]) for r in packed.tolist()]


@dataclass
class HostRow:
    """What the host learns about one request after a step."""

    tokens: list[int]  # accepted drafts then the bonus, -1 pads
    accepted: int
    drafted: int
    depth: int
    under_candidates: list[int]  # accepted under each auto-budget candidate (empty if pinned)


def make_spec_decoder(model, drafter, mode: str, budget: int | str | None, device, dtype) -> SpecDecoder:
    """`drafter` is a path to a z-lab DFlash checkpoint or an already-built drafter object."""
    if isinstance(drafter, (str, Path)):
        from treeflash.models.drafter import DFlashDrafter

        path = Path(drafter)
        if not path.exists():
            raise ValueError(f"drafter path {path} does not exist")
        drafter = DFlashDrafter.from_pretrained(
            path, model.model.embed_tokens.weight, model.lm_head.weight,
            target_cfg=model.cfg, device=device, dtype=dtype,
        )
    return SpecDecoder(drafter, mode, budget)
