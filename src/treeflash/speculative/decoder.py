"""The speculative step for a batch: propose, build the tree, verify, walk, commit.

Per step and request: the drafter proposes a block from [bonus, MASK...] over its cached
context; DDTree (or the DFlash chain) turns the block's marginals into a tree; the target
computes every tree node in one forward with the ancestor mask, writing the nodes'
latents after the committed prefix; the walk follows the target's own tokens; the
accepted nodes' latents move into sequential slots (`kernels.kv_commit`); the drafter's
cache is extended with the accepted nodes' tapped features. Tree build, walk and commit
run on the device where the tensors live; the host learns only the tokens it emits and
the counts, in one small copy at the end of the step.

On CUDA by default (the runtime option overlap=0 opts out) the step's `OverlapDriver`
(speculative/overlap.py) also queues, before the step waits for that copy, its append to the
drafter caches and the next step's proposal (both read the accepted count and the bonus token
on the device), so the device drafts step i+1 while the host processes step i.

The step reaches the target through `speculative/target.py`'s `SpecTarget` (forward over
positions with a tree mask, logits, commit, the verify graphs), never its executor, pool or model.

Under tree_budget="auto" a `TreeSizer` (speculative/budget.py) plans each step: which requests verify
a tree of which size, which decode plainly (spec off's forward; the last steps of a plain spell
before its next tree with the drafter's taps, their rows appended to the drafter's cache in one
call before that tree: speculative/plain.py). A scoring step builds the
widest bucket's tree and verifies the first `budget` nodes of it. The copy then also carries
each built node's depth and score and the walk's path, what the sizing learns from; its module
docstring says why the next step is sized from that copy rather than from its own tree.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from treeflash.costs import StepShape
from treeflash.graph_capture import buffers_key, capture_seconds
from treeflash.runtime import DEFAULT, RuntimeOptions
from treeflash.sampling import choose_tokens_batch
from treeflash.speculative import budget as rule
from treeflash.speculative.budget import BUCKETS, Plan, RequestSizing, TreeSizer, candidate_bounds
from treeflash.speculative.build import build_tree, check_budget, tree_width
from treeflash.speculative.host import HostRow, InputCopy, PhaseTimer, StepClock, read_rows
from treeflash.speculative.metrics import MetricsContradiction, SpecMetrics
from treeflash.speculative.overlap import OverlapDriver, overlap_enabled, same_requests
from treeflash.speculative.plain import catch_up, plain_step
from treeflash.speculative.target import SpecTarget, StepBatch
from treeflash.speculative.tree import DraftTree
from treeflash.speculative.verify import walk_tree

if TYPE_CHECKING:  # kernels.tree_build imports Triton: not needed on the CPU (a base install has none)
    from treeflash.kernels.tree_build import TreeOut

# 31 drafted + the root = 32 verify rows: with 8 heads (kimi-k2-tp8) four whole 64-row tiles of
# the verify kernel; budget 32 pays a fifth tile for 8 rows (H200, 2026-12-02/03: the sweep's
# step 4-9% slower from 64k up; the shipped pair 2.12x spec off at 31).
DEFAULT_TREE_BUDGET = 31
TOUCH_EVERY = 16  # auto steps between two reads of the routers' distinct experts
# untapped plain steps per one priced (its seconds observed by the cost model): pricing each was
# a share of the host's time a step on par with spec off's own (benchmarks/notes/spec-cost.md)
PRICE_UNTAPPED_EVERY = 8
log = logging.getLogger(__name__)

@dataclass
class SpecState:
    """A request's speculative state: its drafter cache, next root token and counters; under
    the auto budget its sizing state and the tapped features of its plain steps, which the
    drafter's cache takes in before the request's next tree."""

    cache: object
    bonus: int
    metrics: SpecMetrics
    sizing: RequestSizing | None = None
    behind: list = field(default_factory=list)  # (features [B, F], row, position) of plain steps


class SpecDecoder:
    """budget: an int pins the DDTree node budget; "auto" lets a `TreeSizer` size each step's
    tree per request among {1, 3, 7, 15, 31, 63} nodes, or decode it plainly where no tree pays
    (see speculative/budget.py); None = DEFAULT_TREE_BUDGET (31). cost: the auto budget's
    `costs.StepCostModel` (default: built from the engine's model at the first step). options:
    the runtime options the step's A/B switches read (overlap, fused_tree, tree_into_verify,
    fused_walk, fused_topk)."""

    def __init__(self, drafter, mode: str, budget: int | str | None, *,
                 candidates: tuple[int, ...] = BUCKETS, cost=None, options: RuntimeOptions = DEFAULT):
        if mode not in ("ddtree", "dflash"):
            raise ValueError(f"spec must be 'ddtree' or 'dflash', got {mode!r}")
        self.drafter = drafter
        self.mode = mode
        self.options = options
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
        self._cost = cost  # the sizing's StepCostModel; default: costs/'s for the engine's model
        self._inputs = InputCopy()  # the step's inputs, host to device
        self._tree_outs: dict[tuple[int, int], TreeOut | None] = {}  # (batch, budget) -> _tree_out
        self._feats_static = False  # this step's accepted features are a tail graph's static output
        self.forced_budget: int | None = None  # the warm-up: this budget (0: plainly); auto learns no walk from it
        self.forced_build: int | None = None  # ... built with this many nodes (a scoring build), None: the budget
        # bench sweep's hindsight bound: with a pinned budget, what a tree of each of these node
        # counts would have accepted, per step and request (the walk counts it on the device)
        self.log_buckets: tuple[int, ...] | None = None
        self.bucket_log: list[list[int]] = []
        self.sizer: TreeSizer | None = None  # the auto budget's, made at the first step
        self._auto_steps = 0
        self.plain_forwards = {"tapped": 0, "untapped": 0}  # the auto budget's plain steps, by forward
        # bench sweep: a preset's step seconds as the real model's (extrapolated), for the sizing;
        # started by the step itself, so that it counts that step's device work only, whoever
        # drives the step (a warm-up, a timed loop, a server)
        self.step_clock: StepClock | None = None
        self._priced_key: int | None = None  # the last auto step's cost key (a switch prices nothing)
        self.timer = PhaseTimer()
        # Overlapping needs a drafter that appends from counts on the device (DFlashDrafter);
        # the test drafters count on the host and keep the sequential step.
        device = getattr(getattr(drafter, "embed_weight", None), "device", "cpu")
        overlap = overlap_enabled(device, options) and getattr(drafter, "supports_static_propose", False)
        # the overlapped step's device work, and the tree and plan it leaves for the next step
        self.driver = OverlapDriver(drafter, self.timer, self) if overlap else None
        self.draft_graphs = None  # spec.draft_graphs.DraftGraphs once enable_graphs() is called
        self.tail_graphs = None  # spec.tail_graphs.TailGraphs, likewise

    def enable_graphs(self, mode: str, *, tail: bool = True) -> None:
        """Propose + tree build of a batch-1 step from one CUDA graph ("cuda") or the same
        static path eagerly ("eager"), see speculative/draft_graphs.py; tail: also lm_head, walk,
        commit and the host row of a greedy batch-1 step (speculative/tail_graphs.py)."""
        from treeflash.speculative.draft_graphs import DraftGraphs
        from treeflash.speculative.tail_graphs import TailGraphs

        self.draft_graphs = DraftGraphs(self.drafter, mode, self.options)
        self.tail_graphs = TailGraphs(mode) if tail else None

    @property
    def overlap(self) -> bool:
        """Whether the steps overlap (an OverlapDriver queues the next step's device work)."""
        return self.driver is not None

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return tuple(self.drafter.target_layer_ids)

    @property
    def verify_width(self) -> int:
        """Rows per request of the widest verify (KV is reserved for it)."""
        return self.budget + 1

    @property
    def warmup_plans(self) -> tuple[tuple[int, int] | None, ...]:
        """The (budget, build) plans a warm-up forces so that every graph a step may use exists
        before the first timed or served step: auto's buckets, each built as itself and wide
        (a scoring step), and its plain steps, tapped and untapped (spec off's forward); a pinned
        budget: None (its own)."""
        if not self.auto:
            return (None,)
        top = self.candidates[-1]
        wide = tuple((b, top) for b in self.candidates if b < top)
        return (*((b, b) for b in sorted(self.candidates, reverse=True)), *wide, rule.PLAIN_TAPPED, rule.PLAIN_UNTAPPED)

    def new_metrics(self) -> SpecMetrics:
        return SpecMetrics(tree_budget=self.budget, spec_mode=self.mode,
                           max_depth=self.drafter.block_size - 1)

    def new_state(self, cache, bonus: int) -> SpecState:
        sizing = RequestSizing.fresh(len(self.candidates)) if self.auto else None
        return SpecState(cache, bonus, self.new_metrics(), sizing)

    # ---- engine hooks ------------------------------------------------------------
    def new_cache(self, prompt_ids, max_tokens: int):
        """A drafter cache for a request of this prompt and max tokens, its full layers sized
        at once for all of it (+ two blocks: the overlapped append's): it never grows
        mid-stream, and a request of a similar length meets the same pooled buffers, which the
        warm-up's draft graphs read (models/drafter.py LayerKV.presize)."""
        cache = self.drafter.new_cache(prompt_ids)
        presize = getattr(cache, "presize", None)
        if presize is not None:
            presize(len(prompt_ids) + max_tokens + 2 * self.drafter.block_size)
        return cache

    def on_prefill(self, target: SpecTarget, req, features: torch.Tensor, first_token: int) -> None:
        cache = self.new_cache(req.prompt_ids, req.params.max_tokens)
        positions = torch.arange(features.shape[0], device=features.device)
        self.drafter.extend(cache, features, positions)
        req.spec_state = self.new_state(cache, first_token)

    def on_finish(self, req) -> None:
        if self.driver is not None:
            self.driver.forget(req)
        state = req.spec_state
        if state is not None:
            state.behind.clear()
            summary = state.metrics.to_dict()
            if self.auto:
                summary["tree_budget"] = "auto"
                summary["tree_budget_max"] = self.budget
                summary["tree_budget_choice"] = state.sizing.last_budget if not state.sizing.off else 0
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

    def step_budget(self, target: SpecTarget, contexts: list[int]) -> int:
        """A pinned decoder's node budget (forced during the warm-up)."""
        return self.forced_budget if self.forced_budget is not None else self.budget

    def _sizer(self, target: SpecTarget) -> TreeSizer:
        if self.sizer is None:
            cost = self._cost or target.step_costs(getattr(self.drafter, "inner", self.drafter))
            self.sizer = TreeSizer(cost, self.drafter.block_size - 1, self.candidates)
        return self.sizer

    def step(self, target: SpecTarget, batch: StepBatch) -> list[list[int]]:
        """One step for the batch's requests: a speculative step at the pinned budget, or (auto)
        the sizer's plan, a speculative step for the requests it gives a tree and a plain one for
        the rest (two forwards, two reads, when the batch is split)."""
        reqs = batch.reqs
        if not self.auto:
            return self._spec_step(target, reqs, self.step_budget(target, []), batch)
        plan = self._plan(target, reqs)
        contexts = [r.num_cached for r in reqs]
        if self.step_clock is not None:
            self.step_clock.start()
        captured_s, decide_s, t_step = capture_seconds(), self.sizer.decide_s, time.perf_counter()
        out: list = [None] * len(reqs)
        if plan.plain:
            self.plain_forwards["tapped" if plan.tapped else "untapped"] += 1
            plain = plain_step(target, self.drafter, [reqs[i] for i in plan.plain],
                               self.tap_layers if plan.tapped else ())
            for i, toks in zip(plan.plain, plain, strict=True):
                out[i] = toks
        if plan.spec:
            spec = [reqs[i] for i in plan.spec]
            for i, toks in zip(plan.spec, self._spec_step(target, spec, plan.budget, batch, plan=plan),
                               strict=True):
                out[i] = toks
        # The time this step spent capturing CUDA graphs (a new page-table bucket, a grown
        # drafter cache, a new accepted length) is not its budget's cost: on the H200
        # (2026-12-02) such samples priced budget 16 at 2.7 ms a step against a true
        # 1.25 ms, and the old controller held 64, 8% slower than pinned 16. Warm-up steps
        # price the buckets too (each key's first step is no sample: costs.StepCostModel).
        # Nor are the host's decisions (the next step's, made inside this one when overlapped):
        # ~1 ms each on the H100's host, they fell on whichever budget ran at the time and priced
        # budget 3 above 31 (results/h100-20261207-spec-cost-5). A scoring step's wider build is
        # auto's cost at every budget alike, not its budget's: its steps price nothing.
        # The first step after a change of budget prices neither: its tree was not queued behind
        # the last step (the overlap starts again), and the warm-up's forced plans change every
        # few steps (their prices of budgets auto then left were never steady ones).
        key = plan.budget if plan.spec else 0
        switched, self._priced_key = self._priced_key != key, key
        if switched or not (plan.spec or plan.tapped or self.plain_forwards["untapped"] % PRICE_UNTAPPED_EVERY == 1) \
                or (plan.spec and plan.build > plan.budget):
            return out
        seconds = time.perf_counter() - t_step - (capture_seconds() - captured_s) - (self.sizer.decide_s - decide_s)
        if self.step_clock is not None:
            seconds = self.step_clock.seconds(seconds)
        shape = StepShape(tuple(contexts[i] for i in plan.plain), tuple(contexts[i] for i in plan.spec), key)
        self.sizer.observe_step(shape, max(seconds, 1e-6))
        return out

    def _plan(self, target: SpecTarget, reqs) -> Plan:
        """The plan the overlapped step made for this batch (its tree is queued), else a new one."""
        planned = self.driver.take_plan() if self.driver is not None else None
        forced = self.forced_budget is None or planned is None or (planned[1].budget, planned[1].build) == (
            self.forced_budget, self.forced_build or self.forced_budget)  # (a warm-up moved on to its next plan)
        if planned is not None and forced and same_requests(planned[0], reqs):
            return planned[1]
        states = [r.spec_state.sizing for r in reqs]
        return self._sizer(target).plan(states, [r.num_cached for r in reqs], self.forced_budget,
                                        self.forced_build)

    def plan_next(self, target: SpecTarget, batch: list) -> Plan:
        """The next step's plan, made by the overlapped step before it reads this step's copy:
        auto: the sizer's for the whole batch (its contexts are not known yet: this step's
        price it); pinned: every request at the step budget."""
        if not self.auto:
            budget = self.step_budget(target, [])
            return Plan(budget, list(range(len(batch))), [], build=budget)
        return self._sizer(target).plan([r.spec_state.sizing for r in batch], [r.num_cached for r in batch],
                                        self.forced_budget, self.forced_build)

    def _spec_step(self, target: SpecTarget, reqs, budget: int, batch: StepBatch,
                   plan: Plan | None = None) -> list[list[int]]:
        """One speculative step for `reqs` at `budget`. Everything up to the walk's result stays
        on the device; the host then learns tokens and counts in one device-to-host copy.

        Overlapped, the step's OverlapDriver (speculative/overlap.py) queues more device work
        before the step waits for that copy: its append to the drafter caches and the next
        step's tree. The host's processing of this step (tokens, stop conditions, the next step's inputs and
        verify launch) then runs while the device drafts. The next step takes that tree only
        if it runs the very same requests at the same budget; otherwise it is dropped, having
        written nothing but its own output buffers (the append was this step's, due either way).
        batch: the engine step (auto: the next step is planned for all its requests); plan
        (auto): this step's, whose `build` may exceed the budget (a scoring step)."""
        states = [r.spec_state for r in reqs]
        catch_up(self.drafter, states)
        contexts = [r.num_cached for r in reqs]
        build = plan.build if plan is not None else budget
        pending = self.driver.take(reqs, budget, build) if self.driver is not None else None
        start, roots, first = self._step_inputs(target, contexts, states)
        if pending is not None:
            tree = pending.tree
        else:
            tree = self.draft(target, [s.cache for s in states], roots, start, budget, build=build)
        packed, feats = self._verify_walk(target, reqs, tree, start, budget)
        packed, touched = self._with_touched(target, packed)
        if self.driver is not None:  # the next step's device work goes in behind the copy
            copy = self.driver.start_copy(packed)
            self.driver.queue_next(target, reqs, states, packed, feats, start, first, batch,
                                   self.draft_graphs if batch.solo else None)
            packed = copy.wait()
        host, nodes = self._to_host(packed, tree.width - 1, touched)  # the step's one read
        t0 = self.timer.mark(target.device)
        out = [self._advance(target, req, state, row, feats[i], start[i], budget, batch.solo)
               for i, (req, state, row) in enumerate(zip(reqs, states, host, strict=True))]
        self.timer.add("drafter_extend", t0, target.device)
        if nodes is not None and self.forced_budget is None:
            depths, scores, path, _, experts = nodes
            self.sizer.record([s.sizing for s in states], depths, scores, path, min(budget, tree.width - 1),
                              plan.why if plan is not None else "rule")
            if experts is not None:
                self.sizer.cost.observe_touch(len(reqs) * (budget + 1), experts)
        return out

    def _with_touched(self, target: SpecTarget, packed: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every TOUCH_EVERY-th auto step, the distinct experts each MoE layer's router picked in
        this verify (from `MoE.last_expert_counts`, on the device) ride in the step's copy: the
        cost model's measured experts (costs.ExpertTouch). (packed, columns added)."""
        if not self.auto or self.forced_budget is not None:
            return packed, 0
        self._auto_steps += 1
        counts = target.moe_expert_counts() if self._auto_steps % TOUCH_EVERY == 1 else []
        if not counts:
            return packed, 0
        touched = torch.stack(counts).ne(0).sum(1)  # [MoE layers]
        return torch.cat([packed, touched.expand(packed.shape[0], -1)], 1), len(counts)

    def _step_inputs(self, target: SpecTarget, contexts: list[int], states) -> tuple[torch.Tensor, ...]:
        """start [B], roots [B] and first [layers, B] on the device, in one copy (host.InputCopy):
        the contexts, the bonus tokens and (overlapped) each drafter layer's first slot for
        the step's masked append, once every layer has room for a whole block (a full layer
        grows here, on the host); first is empty when not overlapping."""
        rows = [contexts, [s.bonus for s in states]]
        if self.overlap:
            block = self.drafter.block_size
            rows += zip(*(s.cache.reserve(block) for s in states), strict=True)
        dev = self._inputs.copy(rows, target.device)
        return dev[0], dev[1], dev[2:]

    def draft(self, target: SpecTarget, caches, roots, start, budget: int, *, queued: bool = False,
               build: int | None = None) -> DraftTree:
        """Propose and build the tree: one draft-graph replay (batch 1) or eagerly. queued:
        for the next step, ahead of the host's counts of the caches' valid slots (OverlapDriver.queue_next),
        so an eager proposal reads every slot (`full`; a replay always does). build > budget:
        a scoring build of that many nodes, of which the verify takes the first `budget`."""
        dev, t = target.device, self.timer
        build = budget if build is None else build
        t0 = t.mark(dev)
        if self.draft_graphs is not None and self.draft_graphs.handles(caches):
            # the tree lands where verify reads it (a scoring build: its own buffers, verify copies a prefix)
            out = self._tree_out(target, len(caches), budget) if build == budget else None
            tree = self.draft_graphs.run(self.mode, caches, roots, start, build, out=out)  # both, one replay
            t.add("drafter", t0, dev)
            return tree
        # a batch reads every slot too (full views): its shapes then follow the caches' capacities,
        # not each step's longest context, so no new kernel specialization meets a served step and
        # the padded gather is one stack per tensor (models/drafter.py _gather_context)
        batch = len(caches) > 1 and getattr(self.drafter, "supports_static_propose", False)  # (test drafters: no full)
        extra = {"full": True} if queued or batch else {}
        draft_logits = self.drafter.propose(caches, roots, start, **extra)  # [B, D, V]
        t0 = t.add("drafter", t0, dev)
        tree = build_tree(self.mode, draft_logits, roots, start, build,  # top-k reads any float dtype
                          options=self.options)
        t.add("tree_build", t0, dev)
        return tree

    def _tree_out(self, target: SpecTarget, batch: int, budget: int) -> TreeOut | None:
        """The verify forward's static inputs for this step's tree (engine/graphs.py
        StepInputs), for the draft graph's build to write into; None without verify graphs."""
        graphs = target.verify_graphs
        if graphs is None or not self.options.tree_into_verify:  # (A/B runs)
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

    def _verify_walk(self, target: SpecTarget, reqs, built: DraftTree, start, budget: int):
        """Verify, walk and commit, all on the device: (packed, feats), see _tail. A scoring
        build's tree is verified through its first `budget` nodes (a prefix: a tree)."""
        dev, t = target.device, self.timer
        t0 = t.mark(dev)
        # views into the build's buffers when a graph copies them into its own (stable addresses
        # for the tail graph), copies for an eager forward
        graphed = target.verify_graphs is not None
        tree = built if built.width <= budget + 1 else built.prefix(budget + 1, views=graphed)
        mask = None if tree.is_chain else tree.ancestor_mask
        out = self._tree_outs.get((len(reqs), budget))
        # a tree built into the verify's inputs came with its prefix lengths (int32) there too
        prefix = out.prefix_lens if out is not None and tree.tokens.data_ptr() == out.tokens.data_ptr() else start
        hidden, taps = target.forward(reqs, tree.tokens, tree.positions, prefix, mask,
                                      taps=self.tap_layers, graphable=True, commit_later=True)
        t0 = t.add("verify", t0, dev)  # lm_head is timed with the tail ("walk_commit")
        self._feats_static = False  # set by a tail-graph replay: feats is then its static output
        out = self._graphed_tail(target, reqs, tree, hidden, taps, budget, built)
        if out is None:
            commit = partial(target.commit, reqs, start)
            out = self._tail(target, reqs, tree, hidden, taps, commit, built)
        t.add("walk_commit", t0, dev)
        return out

    def _tail(self, target: SpecTarget, reqs, tree: DraftTree, hidden, taps, commit,
              built: DraftTree | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """lm_head, token choice, walk, commit(accept_idx [B, D+1], num_rows [B]) and the
        accepted rows' features, on the device: (packed [B, W] long, what the host learns
        (see _to_host); feats [B, D+1, taps*hidden]). The graphed tail runs this very code.
        built: the tree as built, of which `tree` (verified) may be a prefix."""
        # [B, N, V] in the model's dtype: choose_tokens_batch computes in float32 itself (the
        # argmax of bf16 logits is that of their float32 copy; process_logits casts first)
        logits = target.logits(hidden, float32=False)
        post = choose_tokens_batch(logits, [r.params for r in reqs], [r.generator for r in reqs])
        logged = self._logged(tree)
        walk = walk_tree(tree, post, None if logged is None else candidate_bounds(logged, post.device),
                         self.options)
        commit(walk.index, walk.rows)
        idx = walk.index[..., None].expand(-1, -1, taps.shape[-1])
        feats = taps.gather(1, idx)  # [B, D+1, taps*hidden]: the accepted rows' features
        if not self.auto:
            return walk.packed, feats
        # the sizing's inputs ride in the same copy: each built node's depth and score (float32
        # bits) and the walk's path (speculative/learning.py)
        built = tree if built is None else built
        scores = built.scores[:, 1:].contiguous().view(torch.int32).long()
        return torch.cat([walk.packed, built.depths[:, 1:], walk.index, scores], 1), feats

    def _logged(self, tree: DraftTree) -> tuple[int, ...] | None:
        """The node counts whose acceptance a pinned step logs (bench sweep's hindsight bound)."""
        if self.auto or not self.log_buckets:
            return None
        return tuple(b for b in self.log_buckets if b < tree.width) or None

    def _graphed_tail(self, target: SpecTarget, reqs, tree: DraftTree, hidden, taps, budget: int, built: DraftTree):
        """_tail from one CUDA graph (speculative/tail_graphs.py) for one greedy request whose verify
        forward ran from the static buffers, committing over that forward's page table and
        prefix lengths (static too); None where that does not apply (the caller runs _tail)."""
        tg, graphs = self.tail_graphs, target.verify_graphs
        if tg is None or tg.failure is not None or graphs is None or taps is None:
            return None
        if len(reqs) != 1 or not reqs[0].params.greedy:
            return None  # a draw from the request's own generator stays eager
        step = graphs.served(hidden)
        if step is None:
            return None
        tensors = [getattr(t, f.name) for t in (tree, built) for f in fields(t)
                   if isinstance(getattr(t, f.name), torch.Tensor)]
        key = (self.mode, budget, self.auto, self._logged(tree), tree.max_depth, tree.is_chain,
               buffers_key(hidden, taps, step.page_table, step.prefix_lens, step.kv, *tensors))
        commit = partial(graphs.commit, step)
        out = tg.run(key, lambda: self._tail(target, reqs, tree, hidden, taps, commit, built), target.device)
        self._feats_static = tg.last_static
        return out

    def _advance(self, target: SpecTarget, req, state: SpecState, row: HostRow, feats, start,
                 budget: int, solo: bool) -> list[int]:
        """Record the step, extend the drafter's cache, move the request on; its new tokens."""
        k = row.accepted
        state.metrics.record(row.drafted, k, row.depth, budget)
        if self.overlap:
            state.cache.advance(k + 1)  # the rows themselves were queued on the device (OverlapDriver.queue_next)
        elif self.draft_graphs is not None and self.draft_graphs.handles([state.cache]) and solo:
            # (req.num_cached is start's host value: the slots go in one host-to-device copy)
            self.draft_graphs.extend(state.cache, feats[: k + 1], req.num_cached,  # maybe a replay
                                     static=self._feats_static)
        else:
            self.drafter.extend(state.cache, feats[: k + 1], start + torch.arange(k + 1, device=feats.device))
        req.num_cached += k + 1
        for listener in target.spec_listeners:
            listener(req, row.drafted, k, budget)
        state.bonus = row.tokens[k]
        return row.tokens[: k + 1]

    def _to_host(self, packed: torch.Tensor, nodes: int, touched: int = 0) -> tuple[list[HostRow], tuple | None]:
        """packed [B, W] (_tail): tokens (max depth + 1 columns), accepted, drafted, depth and
        (auto budget) the built tree's `nodes` depths, the walk's path (max depth + 1), the
        nodes' scores and `touched` columns of distinct experts per MoE layer, in one
        device-to-host copy; (a pinned budget, logging) what each logged node count would have
        accepted. Returns the rows and (auto) the sizer's arrays."""
        arr = packed.cpu().numpy()  # a pinned buffer when overlapped (.cpu() is then no copy)
        if touched:
            arr, experts = arr[:, :-touched], arr[0, -touched:].tolist()
        else:
            experts = None
        logged = self._logged_count(nodes)
        if logged:
            arr, counts = arr[:, :-logged], arr[:, -logged:]
            self.bucket_log += counts.tolist()
        rows, sizing = read_rows(arr, nodes, self.auto)
        return rows, None if sizing is None else (*sizing, experts)


    def _logged_count(self, nodes: int) -> int:
        if self.auto or not self.log_buckets:
            return 0
        return sum(b < nodes + 1 for b in self.log_buckets)


def make_spec_decoder(model, drafter, mode: str, budget: int | str | None, device, dtype,
                      options: RuntimeOptions = DEFAULT) -> SpecDecoder:
    """`drafter` is a path to a z-lab DFlash checkpoint or an already-built drafter object."""
    if isinstance(drafter, (str, Path)):
        from treeflash.models.drafter import DFlashDrafter

        path = Path(drafter)
        if not path.exists():
            raise ValueError(f"drafter path {path} does not exist")
        drafter = DFlashDrafter.from_pretrained(
            path, model.model.embed_tokens.weight, model.lm_head.weight,
            target_cfg=model.cfg, device=device, dtype=dtype, options=options,
        )
    return SpecDecoder(drafter, mode, budget, options=options)
