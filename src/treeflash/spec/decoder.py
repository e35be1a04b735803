"""The speculative step for a batch: propose, build the tree, verify, walk, commit.

Per step and request: the drafter proposes a block from [bonus, MASK...] over its cached
context; DDTree (or the DFlash chain) turns the block's marginals into a tree; the target
computes every tree node in one forward with the ancestor mask, writing the nodes'
latents after the committed prefix; the walk follows the target's own tokens; the
accepted nodes' latents move into sequential slots (`kernels.kv_commit`); the drafter's
cache is extended with the accepted nodes' tapped features. Tree build, walk and commit
run on the device where the tensors live; the host learns only the tokens it emits.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from treeflash.engine.sampling import choose_tokens
from treeflash.spec.build import build_tree, check_budget
from treeflash.spec.metrics import MetricsContradiction, SpecMetrics
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
    def __init__(self, drafter, mode: str, budget: int | None):
        if mode not in ("ddtree", "dflash"):
            raise ValueError(f"spec must be 'ddtree' or 'dflash', got {mode!r}")
        self.drafter = drafter
        self.mode = mode
        depth = drafter.block_size - 1
        self.budget = depth if mode == "dflash" else check_budget(budget or DEFAULT_TREE_BUDGET)
        self.timer = PhaseTimer()

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return tuple(self.drafter.target_layer_ids)

    @property
    def verify_width(self) -> int:
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
            try:  # figures that contradict each other are a bug: say so on the output itself
                state.metrics.check_invariants(len(req.output_ids))
            except MetricsContradiction as e:
                log.error("request %s: speculative metrics contradict: %s", req.request_id, e)
                summary["invariant_error"] = str(e)
            req.metrics["speculative_decoding"] = summary
            req.spec_state = None  # drops the drafter cache

    def step(self, engine, reqs) -> list[list[int]]:
        dev, t = engine.device, self.timer
        states = [r.spec_state for r in reqs]
        start = torch.tensor([r.num_cached for r in reqs], dtype=torch.long, device=dev)
        roots = torch.tensor([s.bonus for s in states], dtype=torch.long, device=dev)
        t0 = t.mark(dev)
        draft_logits = self.drafter.propose([s.cache for s in states], roots, start)  # [B, D, V]
        t0 = t.add("drafter", t0, dev)
        tree = build_tree(self.mode, draft_logits.float(), roots, start, self.budget)
        t0 = t.add("tree_build", t0, dev)
        mask = None if tree.is_chain else tree.ancestor_mask
        hidden, taps = engine.forward(reqs, tree.tokens, tree.positions, start.tolist(), mask,
                                      taps=self.tap_layers)
        logits = engine.logits(hidden)  # [B, N, V]
        t0 = t.add("verify", t0, dev)
        post = torch.stack([choose_tokens(logits[i], r.params, r.generator) for i, r in enumerate(reqs)])
        walk = walk_tree(tree, post)
        self._commit(engine, reqs, walk, start)
        feats = taps.gather(1, walk.accepted_nodes.clamp(min=0)[..., None].expand(-1, -1, taps.shape[-1]))
        t0 = t.add("walk_commit", t0, dev)
        # The step's only host syncs: the tokens to emit and the per-request counts.
        new_tokens = walk.new_tokens.tolist()
        SpecMetrics.record_batch([s.metrics for s in states], walk, tree)
        out = []
        for i, (req, state) in enumerate(zip(reqs, states, strict=True)):
            k = state.metrics.per_step_accepted[-1]
            self.drafter.extend(state.cache, feats[i, : k + 1],
                                start[i] + torch.arange(k + 1, device=dev))
            req.num_cached += k + 1
            for listener in engine.spec_listeners:
                listener(req, state.metrics.per_step_drafted[-1], k)
            toks = new_tokens[i][: k + 1]
            state.bonus = toks[-1]
            out.append(toks)
        t.add("drafter_extend", t0, dev)
        return out

    def _commit(self, engine, reqs, walk, start: torch.Tensor) -> None:
        """Accepted nodes' latents into slots start .. start+k, in every layer at once."""
        engine.executor.commit([r.pages for r in reqs], start, walk.accepted_nodes.clamp(min=0),
                               walk.num_accepted + 1)


def make_spec_decoder(model, drafter, mode: str, budget: int | None, device, dtype) -> SpecDecoder:
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
