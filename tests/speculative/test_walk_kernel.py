"""The fused walk (kernels/walk_pack.py, Triton interpreter) against its torch twin on built
trees: every output, element for element, with padding, chains, batches and candidates."""

from __future__ import annotations

import pytest
import torch

from treeflash import kernels
from treeflash.speculative import verify
from treeflash.speculative.build import build_tree
from treeflash.speculative.tree import DraftTree


def _post_along(tree: DraftTree, g: torch.Generator, follow: float) -> torch.Tensor:
    """A target that, at each node, picks one of its children's tokens with probability
    `follow` (so walks go deep), otherwise a token no child has."""
    b, n = tree.tokens.shape
    post = torch.randint(50, 60, (b, n), generator=g)  # drafts use tokens < 50 (vocab below)
    for bi in range(b):
        for i in range(n):
            kids = ((tree.parents[bi] == i) & tree.valid[bi]).nonzero().flatten()
            if len(kids) and torch.rand((), generator=g) < follow:
                post[bi, i] = tree.tokens[bi, kids[torch.randint(len(kids), (), generator=g)]]
    return post


def _outputs(tree, post, cands, impl):
    return kernels.tree_walk(tree.tokens, tree.parents, tree.depths, tree.valid, tree.ancestor_mask, post,
                             tree.max_depth + 1, cands, impl=impl)


@pytest.mark.slow
@pytest.mark.parametrize("mode, budget, batch, follow", [
    ("ddtree", 31, 1, 0.9), ("ddtree", 15, 3, 0.7), ("ddtree", 63, 2, 0.95), ("ddtree", 7, 4, 0.3),
    ("dflash", None, 2, 0.8), ("ddtree", 127, 1, 1.0),
])
def test_fused_walk_equals_torch(mode, budget, batch, follow):
    g = torch.Generator().manual_seed(len(mode) * 1000 + (budget or 0) * 10 + batch)  # fixed per case
    depth, vocab = 15, 50
    logits = torch.randn(batch, depth, vocab, generator=g) * 3
    tree = build_tree(mode, logits.log_softmax(-1), torch.randint(vocab, (batch,), generator=g),
                      torch.randint(10, 900, (batch,), generator=g), budget)
    if batch > 1:  # ragged batch: a smaller tree padded to the others' width
        small = build_tree(mode, logits[:1].log_softmax(-1), torch.tensor([3]), torch.tensor([7]),
                           None if budget is None else max(1, budget // 4))
        tree = DraftTree.cat([tree, small])
    post = _post_along(tree, g, follow)
    cands = torch.tensor([7, 15, 31, 63, 127])
    for c in (None, cands):
        ref = _outputs(tree, post, c, "torch")
        got = _outputs(tree, post, c, "triton")
        names = ("path", "index", "rows", "num_accepted", "depth", "bonus", "new_tokens", "packed")
        for name, r, t in zip(names, ref, got, strict=True):
            assert r.dtype == t.dtype == torch.long, name
            assert torch.equal(r, t), (name, r, t)
    assert int(ref[3].max()) >= 1  # the walks went somewhere


def _recorded_walk(monkeypatch, seed: int, budget: int):
    """A built tree and target tokens, with kernels.tree_walk wrapped to record each call's impl:
    (tree, post, the impls seen, the real kernels.tree_walk)."""
    g = torch.Generator().manual_seed(seed)
    tree = build_tree("ddtree", torch.randn(1, 15, 50, generator=g).log_softmax(-1), torch.tensor([1]),
                      torch.tensor([5]), budget)
    post = _post_along(tree, g, 0.9)
    seen = []
    real = kernels.tree_walk
    monkeypatch.setattr(kernels, "tree_walk", lambda *a, impl=None: seen.append(impl) or real(*a, impl=impl))
    return tree, post, seen, real


def test_walk_tree_runs_the_kernel_when_asked(monkeypatch):
    """walk_tree goes through kernels.tree_walk with the impl walk_impl picks."""
    tree, post, seen, real = _recorded_walk(monkeypatch, 3, 31)
    monkeypatch.setattr(verify, "WALK_IMPL", "triton")
    a = verify.walk_tree(tree, post)
    monkeypatch.setattr(verify, "WALK_IMPL", None)
    b = verify.walk_tree(tree, post)
    assert seen == ["triton", None]
    assert torch.equal(a.packed, b.packed) and torch.equal(a.accepted_nodes, b.accepted_nodes)
    assert torch.equal(a.rows, a.num_accepted + 1) and torch.equal(a.index, a.accepted_nodes.clamp(min=0))


def test_big_trees_keep_the_torch_walk(monkeypatch):
    """Trees wider than the kernel's one [N, N] block (budgets up to 1024) walk with torch ops."""
    from treeflash.kernels import walk_pack

    assert verify.WALK_MAX_NODES == walk_pack.MAX_NODES
    tree, post, seen, real = _recorded_walk(monkeypatch, 5, 300)
    monkeypatch.setattr(verify, "walk_impl", lambda t, fused=True: None)  # as on CUDA: the default impl
    verify.walk_tree(tree, post)
    assert seen == ["torch"]
    with pytest.raises(ValueError, match="at most 256 nodes"):
        real(tree.tokens, tree.parents, tree.depths, tree.valid, tree.ancestor_mask, post, 16, impl="triton")
