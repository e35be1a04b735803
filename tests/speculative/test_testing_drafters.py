"""Test drafters through build + walk against a toy deterministic target: every drafter is
lossless, the oracle reaches full acceptance, and the metrics never contradict."""

from __future__ import annotations

import pytest
import torch

from treeflash.speculative.build import build_tree
from treeflash.speculative.metrics import SpecMetrics
from treeflash.speculative.testing_drafters import AdversarialDrafter, OracleDrafter, RandomDrafter
from treeflash.speculative.verify import walk_tree

V = 12


def target_next(prefix: list[int]) -> int:
    """A toy greedy target: a fixed pseudo-random function of the last two tokens."""
    a, b = (prefix[-2] if len(prefix) > 1 else 0), prefix[-1]
    return (a * 7 + b * 5 + (a * b) % 3) % V


def generate_plain(prompt, n):
    out = list(prompt)
    while len(out) < len(prompt) + n:
        out.append(target_next(out))
    return out


def generate_spec(drafter, prompts, n, mode, budget):
    b = len(prompts)
    outs = [list(p) + [target_next(list(p))] for p in prompts]
    caches = [drafter.new_cache(p) for p in prompts]
    for c, p in zip(caches, prompts, strict=True):
        drafter.extend(c, torch.zeros(len(p), 1), torch.arange(len(p)))
    metrics = [
        SpecMetrics(
            tree_budget=budget if mode == "ddtree" else drafter.block_size - 1,
            max_depth=drafter.block_size - 1,
        )
        for _ in prompts
    ]
    while min(len(o) - len(p) for o, p in zip(outs, prompts, strict=True)) < n:
        start = torch.tensor([len(o) - 1 for o in outs])
        bonus = torch.tensor([o[-1] for o in outs])
        tree = build_tree(mode, drafter.propose(caches, bonus, start), bonus, start, budget)
        post = torch.zeros_like(tree.tokens)
        for i in range(b):  # the target's greedy token after each node, on its ancestor path
            toks, par = tree.tokens[i].tolist(), tree.parents[i].tolist()
            paths = [outs[i]]
            for j in range(1, tree.width):
                paths.append(paths[par[j]] + [toks[j]])
            post[i] = torch.tensor([target_next(p) for p in paths])
        walk = walk_tree(tree, post)
        SpecMetrics.record_batch(metrics, walk, tree)
        for i in range(b):
            k = int(walk.num_accepted[i])
            outs[i] += walk.new_tokens[i, : k + 1].tolist()
            drafter.extend(caches[i], torch.zeros(k + 1, 1), start[i] + torch.arange(k + 1))
    return outs, metrics


PROMPTS = [[1, 2, 3], [4, 4], [7, 0, 5, 9, 11]]
N = 30


def _drafter(kind, bs):
    seqs = [generate_plain(p, N + 2 * bs) for p in PROMPTS]
    if kind == "oracle":
        return OracleDrafter(V, bs, sequences=seqs)
    if kind == "random":
        return RandomDrafter(V, bs, seed=3)
    return AdversarialDrafter(V, bs, seed=5, sequences=seqs)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["oracle", "random", "adversarial"])
@pytest.mark.parametrize(
    "mode, budget, bs",
    [
        ("dflash", None, 4),
        ("dflash", None, 7),
        ("ddtree", 1, 4),
        ("ddtree", 4, 5),
        ("ddtree", 16, 4),
        ("ddtree", 64, 8),
    ],
)
def test_lossless_and_metrics(kind, mode, budget, bs):
    outs, metrics = generate_spec(_drafter(kind, bs), PROMPTS, N, mode, budget)
    for o, p, m in zip(outs, PROMPTS, metrics, strict=True):
        plain = generate_plain(p, len(o) - len(p))
        assert o == plain
        m.check_invariants(num_generated=len(o) - len(p))
        if kind == "oracle":  # the spine comes first, so the budget caps the depth
            full = min(bs - 1, budget or bs)
            assert m.per_step_accepted == [full] * m.num_spec_steps
            assert m.mean_acceptance_length == full + 1


def test_adversarial_needs_the_tree():
    """The adversary hides the truth behind decoys: a tree accepts more than the chain."""
    bs = 6
    _, chain = generate_spec(_drafter("adversarial", bs), PROMPTS, N, "dflash", None)
    _, tree = generate_spec(_drafter("adversarial", bs), PROMPTS, N, "ddtree", 32)
    acc = lambda ms: SpecMetrics.merge(ms).mean_acceptance_length
    assert acc(tree) > acc(chain)


def test_random_drafter_is_seeded():
    a, b = RandomDrafter(V, 4, seed=1), RandomDrafter(V, 4, seed=1)
    ca, cb = a.new_cache(), b.new_cache()
    args = (torch.tensor([1]), torch.tensor([3]))
    assert torch.equal(a.propose([ca], *args), b.propose([cb], *args))


def test_oracle_unknown_prompt():
    with pytest.raises(ValueError, match="no known continuation"):
        OracleDrafter(V, 4, sequences=[[1, 2, 3]]).new_cache([9, 9])
