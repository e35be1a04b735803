"""SpecMetrics: one definition, and every contradiction is caught."""

from __future__ import annotations

import pytest
import torch

from treeflash.speculative.build import build_tree
from treeflash.speculative.metrics import MetricsContradiction, SpecMetrics
from treeflash.speculative.verify import walk_tree


def _filled():
    m = SpecMetrics(tree_budget=8, max_depth=4, spec_mode="ddtree")
    for drafted, acc in [(8, 0), (8, 4), (6, 2), (8, 2)]:
        m.record(drafted, acc)
    return m


def test_figures_and_names():
    d = _filled().to_dict()
    assert d["num_spec_steps"] == 4
    assert d["num_draft_tokens"] == 30
    assert d["num_accepted_draft_tokens"] == 8
    assert d["mean_acceptance_length"] == 1 + 8 / 4
    assert d["draft_acceptance_rate"] == 8 / 30
    assert d["acceptance_histogram"] == [1, 0, 2, 0, 1]
    assert d["num_accepted_tokens_per_pos"] == [3, 3, 1, 1]
    assert d["per_step_accepted"] == [0, 4, 2, 2] and d["per_step_drafted"] == [8, 8, 6, 8]
    assert d["mean_accepted_depth"] == 2.0 and d["tree_budget"] == 8
    assert d["per_step_budget"] == [8, 8, 8, 8] and d["steps_by_budget"] == {"8": 4}
    assert d["num_plain_steps"] == 0
    _filled().check_invariants(num_generated=1 + 1 + 5 + 3 + 3)


def test_plain_steps_and_budgets_per_step():
    """The sizing's steps: trees under different budgets and plain steps, counted apart; a plain
    step commits one token, is no speculative step, and is never cut."""
    m = SpecMetrics(tree_budget=63, max_depth=15, spec_mode="ddtree")
    m.record(7, 3, budget=7)
    m.record_plain()
    m.record_plain()
    m.record(3, 0, budget=3)
    m.record(7, 7, budget=15)  # a wide tree need not be full (small vocabularies)
    m.record_plain()
    d = m.to_dict()
    assert d["num_spec_steps"] == 3 and d["num_plain_steps"] == 3
    assert d["steps_by_budget"] == {"3": 1, "7": 1, "15": 1}
    assert d["mean_acceptance_length"] == 1 + 10 / 3
    expected = 1 + (4 + 1 + 8) + 3
    m.check_invariants(num_generated=expected)
    with pytest.raises(MetricsContradiction, match="generated"):  # the last step was plain: nothing cut
        m.check_invariants(num_generated=expected - 1)
    m.record(15, 5, budget=15)
    m.check_invariants(num_generated=expected + 6 - 5)  # a speculative last step may lose its drafts
    with pytest.raises(ValueError, match="budget"):
        m.record(16, 1, budget=15)
    total = SpecMetrics.merge([m, m])
    assert total.num_plain_steps == 6 and total.steps_by_budget == {"3": 2, "7": 2, "15": 4}


def test_empty():
    m = SpecMetrics()
    m.check_invariants(num_generated=1)
    d = m.to_dict()
    assert d["num_spec_steps"] == 0 and d["mean_acceptance_length"] is None
    assert d["draft_acceptance_rate"] is None and d["acceptance_histogram"] == []


def test_histogram_without_max_depth():
    m = SpecMetrics()
    m.record(3, 1)
    m.record(3, 3)
    assert m.acceptance_histogram == [0, 1, 0, 1]
    m.check_invariants()


@pytest.mark.parametrize("drafted, acc, depth", [(2, 3, None), (3, -1, None), (8, 5, None)])
def test_bad_records(drafted, acc, depth):
    m = SpecMetrics(max_depth=4)
    with pytest.raises(ValueError):
        m.record(drafted, acc, depth)


@pytest.mark.parametrize(
    "corrupt, msg",
    [
        (lambda m: m.per_step_depth.__setitem__(1, 3), "depth"),
        (lambda m: m.per_step_drafted.pop(), "lengths"),
        (lambda m: m.per_step_drafted.__setitem__(0, 9), "budget"),
        (lambda m: m.per_step_budget.__setitem__(0, 16), "tree_budget"),
        (lambda m: m.per_step_budget.pop(), "lengths"),
        (lambda m: m.per_step_accepted.__setitem__(2, 7), "accepted"),
    ],
)
def test_contradictions_raise(corrupt, msg):
    m = _filled()
    corrupt(m)
    with pytest.raises(MetricsContradiction, match=msg):
        m.check_invariants()


@pytest.mark.parametrize("generated, ok", [(13, True), (11, True), (10, False), (14, False)])
def test_generated_tokens(generated, ok):
    # expected = 1 + (1 + 5 + 3 + 3) = 13; the last step (2 drafts) may lose up to 2 tokens
    m = _filled()
    if ok:
        m.check_invariants(num_generated=generated)
    else:
        with pytest.raises(MetricsContradiction, match="generated"):
            m.check_invariants(num_generated=generated)


def test_record_batch_and_merge():
    g = torch.Generator().manual_seed(0)
    tree = build_tree(
        "ddtree",
        torch.randn(3, 4, 6, generator=g),
        torch.zeros(3, dtype=torch.long),
        torch.zeros(3, dtype=torch.long),
        5,
    )
    child = torch.zeros(3, tree.width, dtype=torch.long)
    for b in range(3):
        for i in range(1, tree.width):
            child[b, tree.parents[b, i]] = tree.tokens[b, i]
    walk = walk_tree(tree, child)  # the target always picks the last-listed child
    ms = [SpecMetrics(tree_budget=5, max_depth=4) for _ in range(3)]
    SpecMetrics.record_batch(ms, walk, tree)
    for b, m in enumerate(ms):
        m.check_invariants()
        assert m.per_step_accepted == [int(walk.num_accepted[b])] and m.per_step_drafted == [5]
    total = SpecMetrics.merge(ms)
    total.check_invariants()
    assert total.num_spec_steps == 3 and total.tree_budget == 5
    assert total.num_accepted_draft_tokens == int(walk.num_accepted.sum())
