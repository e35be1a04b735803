"""Speculative-decoding metrics, defined once: per request, named as vLLM names them.

Everything is derived from per-step lists (accepted drafts, drafted nodes, the accepted
depth, the budget the tree was built under) plus a count of plain steps, so the figures cannot
drift apart; `check_invariants` proves they agree. A speculative step is one verify pass. Its
commit length is accepted + 1 (the bonus), so mean_acceptance_length = 1 + accepted / steps,
and for a walk from the root the depth of the last accepted node equals the number of
accepted drafts. A plain step (the tree sizing found no tree that pays: speculative/budget.py) decodes
one token without a tree; it is no speculative step and counts only in `num_plain_steps`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class MetricsContradiction(AssertionError):
    """Two speculative-decoding figures disagree: the accounting is wrong somewhere."""


@dataclass
class SpecMetrics:
    tree_budget: int | None = None  # nodes per tree (root excluded), None when not a tree
    spec_mode: str | None = None  # "ddtree" | "dflash"
    max_depth: int | None = None  # block_size - 1: fixes the histogram's length
    per_step_accepted: list[int] = field(default_factory=list)
    per_step_drafted: list[int] = field(default_factory=list)
    per_step_depth: list[int] = field(default_factory=list)
    per_step_budget: list[int] = field(default_factory=list)  # the node budget each tree was built under
    num_plain_steps: int = 0  # steps decoded without a tree (the sizing's "off")
    last_step_plain: bool = False  # the request's latest step was a plain one

    # ---- recording -------------------------------------------------------------------
    def record(self, drafted: int, accepted: int, accepted_depth: int | None = None,
               budget: int | None = None) -> None:
        """One verify step: `accepted` drafts committed out of `drafted` nodes verified
        (root excluded); accepted_depth defaults to `accepted`, as for any root walk; budget
        (the tree's node budget) defaults to tree_budget, else drafted."""
        depth = accepted if accepted_depth is None else accepted_depth
        budget = (self.tree_budget if self.tree_budget is not None else drafted) if budget is None else budget
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted={accepted} must be in [0, drafted={drafted}]")
        if self.max_depth is not None and depth > self.max_depth:
            raise ValueError(f"accepted depth {depth} exceeds max_depth={self.max_depth}")
        if drafted > budget:
            raise ValueError(f"drafted={drafted} exceeds the step's budget {budget}")
        self.per_step_accepted.append(int(accepted))
        self.per_step_drafted.append(int(drafted))
        self.per_step_depth.append(int(depth))
        self.per_step_budget.append(int(budget))
        self.last_step_plain = False

    def record_plain(self) -> None:
        """One plain decode step (no tree): one token committed."""
        self.num_plain_steps += 1
        self.last_step_plain = True

    @staticmethod
    def record_batch(metrics: Sequence[SpecMetrics], walk: Any, tree: Any) -> None:
        """Record one step for each request of a batch from a WalkResult and its DraftTree
        (one device-to-host copy for the whole batch)."""
        import torch

        rows = torch.stack([walk.num_accepted, tree.num_nodes, walk.accepted_depth]).tolist()
        for m, acc, drafted, depth in zip(metrics, *rows, strict=True):
            m.record(drafted, acc, depth)

    # ---- figures ---------------------------------------------------------------------
    @property
    def num_spec_steps(self) -> int:
        return len(self.per_step_accepted)

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.per_step_drafted)

    @property
    def num_accepted_draft_tokens(self) -> int:
        return sum(self.per_step_accepted)

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / steps (the mean commit length, bonus included); None before any step."""
        steps = self.num_spec_steps
        return 1.0 + self.num_accepted_draft_tokens / steps if steps else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        drafted = self.num_draft_tokens
        return self.num_accepted_draft_tokens / drafted if drafted else None

    @property
    def mean_accepted_depth(self) -> float | None:
        steps = self.num_spec_steps
        return sum(self.per_step_depth) / steps if steps else None

    @property
    def acceptance_histogram(self) -> list[int]:
        """[j] = steps that accepted exactly j drafts."""
        top = max(self.per_step_accepted, default=-1)
        if self.max_depth is not None:
            top = max(top, self.max_depth)
        hist = [0] * (top + 1)
        for a in self.per_step_accepted:
            hist[a] += 1
        return hist

    @property
    def steps_by_budget(self) -> dict[str, int]:
        """{budget: speculative steps built under it}, budgets ascending (string keys, as JSON
        writes them)."""
        out: dict[str, int] = {}
        for b in sorted(set(self.per_step_budget)):
            out[str(b)] = self.per_step_budget.count(b)
        return out

    @property
    def num_accepted_tokens_per_pos(self) -> list[int]:
        """[j] = steps whose draft at depth j+1 was accepted (vLLM's per-position counter)."""
        hist = self.acceptance_histogram
        return [sum(hist[j + 1 :]) for j in range(max(len(hist) - 1, 0))]

    def expected_generated_tokens(self) -> int:
        """1 (the prefill's token) + sum over speculative steps of (accepted + 1) + one a plain
        step, before any cut."""
        return 1 + sum(a + 1 for a in self.per_step_accepted) + self.num_plain_steps

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_spec_steps": self.num_spec_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_histogram": self.acceptance_histogram,
            "num_accepted_tokens_per_pos": self.num_accepted_tokens_per_pos,
            "per_step_accepted": list(self.per_step_accepted),
            "per_step_drafted": list(self.per_step_drafted),
            "per_step_budget": list(self.per_step_budget),
            "steps_by_budget": self.steps_by_budget,
            "num_plain_steps": self.num_plain_steps,
            "mean_accepted_depth": self.mean_accepted_depth,
            "tree_budget": self.tree_budget,
            "spec_mode": self.spec_mode,
        }

    @staticmethod
    def merge(parts: Sequence[SpecMetrics]) -> SpecMetrics:
        """All steps of several requests in one accumulator (for totals across requests)."""
        depths = {p.max_depth for p in parts}
        budgets = {p.tree_budget for p in parts}
        modes = {p.spec_mode for p in parts}
        out = SpecMetrics(
            tree_budget=budgets.pop() if len(budgets) == 1 else None,
            spec_mode=modes.pop() if len(modes) == 1 else None,
            max_depth=max((d for d in depths if d is not None), default=None),
        )
        for p in parts:
            out.per_step_accepted += p.per_step_accepted
            out.per_step_drafted += p.per_step_drafted
            out.per_step_depth += p.per_step_depth
            out.per_step_budget += p.per_step_budget
            out.num_plain_steps += p.num_plain_steps
        return out

    # ---- invariants ------------------------------------------------------------------
    def check_invariants(self, num_generated: int | None = None) -> None:
        """Raise MetricsContradiction if any two figures disagree.

        num_generated: tokens the request actually emitted. Only the last step may be cut
        (stop token or max_tokens), and it keeps at least one token, so
        expected - last_accepted <= num_generated <= expected.
        """
        d = self.to_dict()
        steps, acc, drafted = (
            d["num_spec_steps"],
            d["num_accepted_draft_tokens"],
            d["num_draft_tokens"],
        )
        _require(
            len(self.per_step_drafted) == steps == len(self.per_step_depth) == len(self.per_step_budget),
            "per-step lists have different lengths",
        )
        for i, (a, n, dep, b) in enumerate(
            zip(self.per_step_accepted, self.per_step_drafted, self.per_step_depth, self.per_step_budget,
                strict=True)
        ):
            _require(0 <= a <= n, f"step {i}: accepted {a} not in [0, drafted {n}]")
            _require(dep == a, f"step {i}: accepted depth {dep} != accepted drafts {a}")
            _require(n <= b, f"step {i}: {n} nodes > the step's budget {b}")
            if self.max_depth is not None:
                _require(
                    a <= self.max_depth, f"step {i}: accepted {a} > max_depth {self.max_depth}"
                )
            if self.tree_budget is not None:
                _require(
                    b <= self.tree_budget, f"step {i}: budget {b} > tree_budget {self.tree_budget}"
                )
        _require(sum(d["steps_by_budget"].values()) == steps, "steps by budget do not sum to the steps")
        _require(self.num_plain_steps >= 0, "negative plain steps")
        hist = d["acceptance_histogram"]
        _require(sum(hist) == steps, f"histogram sums to {sum(hist)}, not steps={steps}")
        _require(sum(j * h for j, h in enumerate(hist)) == acc, "sum j*hist[j] != accepted")
        _require(sum(d["num_accepted_tokens_per_pos"]) == acc, "per-position counts != accepted")
        _require(acc <= drafted, f"accepted {acc} > drafted {drafted}")
        if steps:
            _require(
                abs(d["mean_acceptance_length"] - (1 + acc / steps)) < 1e-9,
                "mean_acceptance_length != 1 + accepted/steps",
            )
            _require(
                abs(d["mean_accepted_depth"] - acc / steps) < 1e-9,
                "mean_accepted_depth != accepted/steps",
            )
        if num_generated is not None:
            expected = self.expected_generated_tokens()
            # a plain step emits one token, which is never cut
            cut_max = self.per_step_accepted[-1] if steps and not self.last_step_plain else 0
            _require(
                expected - cut_max <= num_generated <= expected,
                f"generated {num_generated} tokens, but steps commit {expected} "
                f"(at most {cut_max} of them cut at the end)",
            )


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise MetricsContradiction(msg)
