"""The speculative step for a batch: propose, build the tree, verify, walk, commit.

Per step and request: the drafter proposes a block from [bonus, MASK...] over its cached
context; DDTree (or the DFlash chain) turns the block's marginals into a tree; the target
computes every tree node in one forward with the ancestor mask, writing the nodes'
latents after the committed prefix; the walk follows the target's own tokens; the
accepted nodes' latents move into sequential slots (`kernels.kv_commit`); the drafter's
cache is extended with the accepted nodes' tapped features. Tree build, walk and commit
run on the device where the tensors live; the host learns only the tokens it emits and
the counts, in one small copy at the end of the step.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path

import torch

from treeflash.engine.graphs import capture_seconds
from treeflash.engine.sampling import choose_tokens_batch
from treeflash.spec.budget import CANDIDATES, BudgetController, FloorCost, accepted_under
from treeflash.spec.build import build_tree, check_budget
from treeflash.spec.metrics import MetricsContradiction, SpecMetrics
from treeflash.spec.tail_graphs import buffers_key
from treeflash.spec.tree import DraftTree
from treeflash.spec.verify import walk_tree

DEFAULT_TREE_BUDGET = 32
log = logging.getLogger(__name__)


@dataclass
class SpecState:
    """A request's speculative state: its drafter cache, next root token and counters."""

    cache: object
    bonus: int
    metrics: SpecMetrics


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
    from {7, 15, 31, 63, 127} every few steps (see spec/budget.py); None = 32."""

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
        self._host_in: dict[int, torch.Tensor] = {}  # batch -> pinned [2, batch] step input
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

        dtype = engine.pool.kv.dtype
        if engine.device.type == "cuda":
            ceilings = floors.default_ceilings(engine.device, dtype)
        else:  # a quick probe: only the floor's shape matters, the measured ratio scales it
            ceilings = floors.measure_ceilings(engine.device, dtype, seconds=0.02)
        return FloorCost(engine.model, getattr(self.drafter, "inner", self.drafter), ceilings)

    def step(self, engine, reqs) -> list[list[int]]:
        """One speculative step for `reqs`. Everything up to the walk's result stays on the
        device; the host then learns tokens and counts in one device-to-host copy."""
        states = [r.spec_state for r in reqs]
        contexts = [r.num_cached for r in reqs]
        budget = self.step_budget(engine, contexts)
        captured_s = capture_seconds()
        t_step = time.perf_counter()  # the controller's own bookkeeping is not the budget's cost
        host_in = self._pinned_input(len(reqs), engine.device)
        host_in.copy_(torch.tensor([contexts, [s.bonus for s in states]], dtype=torch.long))
        # From pinned memory the copy is truly asynchronous (from pageable memory it would wait
        # for the stream, i.e. for the previous step's drafter append, before the host goes on).
        start, roots = host_in.to(engine.device, non_blocking=True)  # [B] each
        packed, feats = self._draft_verify_walk(engine, reqs, states, start, roots, budget)
        host = self._to_host(packed)  # the step's one device-to-host copy
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

    def _pinned_input(self, batch: int, device: torch.device) -> torch.Tensor:
        """[2, batch] host buffer for the step's contexts and bonus tokens: pinned on CUDA.
        Reused every step: the previous step's copy out of it finished before its host copy."""
        buf = self._host_in.get(batch)
        if buf is None:
            pin = device.type == "cuda"
            buf = self._host_in[batch] = torch.empty(2, batch, dtype=torch.long, pin_memory=pin)
        return buf

    def _draft_verify_walk(self, engine, reqs, states, start, roots, budget):
        """Propose, build, verify, walk and commit, all on the device: (packed, feats), see _tail."""
        dev, t = engine.device, self.timer
        t0 = t.mark(dev)
        caches = [s.cache for s in states]
        if self.draft_graphs is not None and self.draft_graphs.handles(caches):
            tree = self.draft_graphs.run(self.mode, caches, roots, start, budget)  # both, one replay
            t0 = t.add("drafter", t0, dev)
        else:
            draft_logits = self.drafter.propose(caches, roots, start)  # [B, D, V]
            t0 = t.add("drafter", t0, dev)
            tree = build_tree(self.mode, draft_logits.float(), roots, start, budget)
            t0 = t.add("tree_build", t0, dev)
        mask = None if tree.is_chain else tree.ancestor_mask
        hidden, taps = engine.forward(reqs, tree.tokens, tree.positions, start, mask,
                                      taps=self.tap_layers, graphable=True)
        t0 = t.add("verify", t0, dev)  # lm_head is timed with the tail ("walk_commit")
        out = self._graphed_tail(engine, reqs, tree, hidden, taps, budget)
        if out is None:
            commit = partial(engine.executor.commit, [r.pages for r in reqs], start)
            out = self._tail(engine, reqs, tree, hidden, taps, commit)
        t.add("walk_commit", t0, dev)
        return out

    def _tail(self, engine, reqs, tree: DraftTree, hidden, taps, commit) -> tuple[torch.Tensor, torch.Tensor]:
        """lm_head, token choice, walk, commit(accept_idx [B, D+1], num_rows [B]) and the
        accepted rows' features, on the device: (packed [B, W] long, what the host learns
        (see _to_host); feats [B, D+1, taps*hidden]). The graphed tail runs this very code."""
        logits = engine.logits(hidden)  # [B, N, V]
        post = choose_tokens_batch(logits, [r.params for r in reqs], [r.generator for r in reqs])
        walk = walk_tree(tree, post)
        commit(walk.accepted_nodes.clamp(min=0), walk.num_accepted + 1)
        idx = walk.accepted_nodes.clamp(min=0)[..., None].expand(-1, -1, taps.shape[-1])
        feats = taps.gather(1, idx)  # [B, D+1, taps*hidden]: the accepted rows' features
        cols = [walk.new_tokens, walk.num_accepted[:, None], tree.num_nodes[:, None],
                walk.accepted_depth[:, None]]
        if self.auto:
            cols.append(accepted_under(walk.accepted_nodes, self._candidates()))
        return torch.cat([c.long() for c in cols], dim=1), feats

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
               buffers_key(hidden, taps, step.page_table, step.prefix_lens, engine.pool.kv, *tensors))
        commit = partial(graphs.commit, step)
        return tg.run(key, lambda: self._tail(engine, reqs, tree, hidden, taps, commit), engine.device)

    def _advance(self, engine, req, state: SpecState, row: HostRow, feats, start) -> list[int]:
        """Record the step, extend the drafter's cache, move the request on; its new tokens."""
        k = row.accepted
        state.metrics.record(row.drafted, k, row.depth)
        if self.draft_graphs is not None and self.draft_graphs.handles([state.cache]) and len(engine.running) == 1:
            self.draft_graphs.extend(state.cache, feats[: k + 1], start)  # slots on the device, maybe a replay
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
