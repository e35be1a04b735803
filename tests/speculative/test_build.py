"""DDTree construction: exactly the top-budget prefixes, prefix-closed, parents first,
in the order of the reference best-first heap; chain mode; bad input."""

from __future__ import annotations

import heapq
import itertools

import pytest
import torch

from treeflash.speculative.build import MAX_TREE_BUDGET, build_tree
from treeflash.speculative.tree import DraftTree


def _logits(b, d, v, seed=0):
    return 2.0 * torch.randn(b, d, v, generator=torch.Generator().manual_seed(seed))


def _paths(tree: DraftTree, b: int) -> list[tuple[int, ...]]:
    t = tree.request(b)
    toks, par = t.tokens[0].tolist(), t.parents[0].tolist()
    out = [()]
    for i in range(1, len(toks)):
        out.append(out[par[i]] + (toks[i],))
    return out[1:]


def _brute_top(logits: torch.Tensor, budget: int) -> set[tuple[int, ...]]:
    lp = torch.log_softmax(logits.double(), -1)
    d, v = lp.shape
    scored = []
    for depth in range(1, d + 1):
        for toks in itertools.product(range(v), repeat=depth):
            scored.append((sum(float(lp[e, t]) for e, t in enumerate(toks)), toks))
    scored.sort(key=lambda x: -x[0])
    return {t for _, t in scored[:budget]}


def _heap_reference(logits: torch.Tensor, budget: int):
    """DDTree's best-first heap, literally (ddtree.py): (token, parent, depth) per node."""
    lp = torch.log_softmax(logits.double(), -1)
    d, v = lp.shape
    k = min(budget, v)
    vals, toks = lp.topk(k, -1)
    heap = [(-float(vals[0, 0]), 1, 0, 0)]
    nodes = []
    while heap and len(nodes) < budget:
        neg, depth, rank, parent = heapq.heappop(heap)
        nodes.append((int(toks[depth - 1, rank]), parent, depth))
        me = len(nodes)
        s = -neg
        if rank + 1 < k:
            heapq.heappush(
                heap,
                (
                    -(s - float(vals[depth - 1, rank]) + float(vals[depth - 1, rank + 1])),
                    depth,
                    rank + 1,
                    parent,
                ),
            )
        if depth < d:
            heapq.heappush(heap, (-(s + float(vals[depth, 0])), depth + 1, 0, me))
    return nodes


@pytest.mark.parametrize("budget", [1, 2, 3, 7, 16, 40, 155, 500])
def test_matches_brute_force_top_budget(budget):
    v, d = 5, 3
    logits = _logits(3, d, v, seed=budget)
    tree = build_tree("ddtree", logits, torch.tensor([1, 2, 3]), torch.tensor([0, 7, 100]), budget)
    tree.check()
    total = sum(v**k for k in range(1, d + 1))
    assert tree.width == 1 + min(budget, total)
    for b in range(3):
        assert set(_paths(tree, b)) == _brute_top(logits[b], budget)


@pytest.mark.parametrize("budget, d, v", [(1, 4, 9), (8, 4, 9), (32, 7, 50), (256, 15, 300)])
def test_node_order_matches_heap_reference(budget, d, v):
    logits = _logits(2, d, v, seed=d)
    tree = build_tree("ddtree", logits, torch.tensor([4, 5]), torch.tensor([3, 9]), budget)
    tree.check()
    for b in range(2):
        want = _heap_reference(logits[b], budget)
        got = list(
            zip(
                tree.tokens[b, 1:].tolist(),
                tree.parents[b, 1:].tolist(),
                tree.depths[b, 1:].tolist(),
                strict=True,
            )
        )
        assert got == want


@pytest.mark.parametrize("mode, budget", [("ddtree", 24), ("dflash", None)])
def test_scores_are_the_path_log_probs_in_rank_order(mode, budget):
    """Node i's score is the drafter's log-prob of its whole path (the sum of its depths'
    marginals): what the tree sizing calibrates; non-increasing in node order (the ranks)."""
    logits = _logits(2, 5, 20, seed=3)
    tree = build_tree(mode, logits, torch.tensor([1, 2]), torch.tensor([0, 4]), budget)
    lp = torch.log_softmax(logits.double(), -1)
    for b in range(2):
        toks, par, dep = tree.tokens[b].tolist(), tree.parents[b].tolist(), tree.depths[b].tolist()
        path_lp = [0.0]
        for i in range(1, len(toks)):
            path_lp.append(path_lp[par[i]] + float(lp[b, dep[i] - 1, toks[i]]))
        assert tree.scores.dtype == torch.float32 and tree.scores[b, 0] == 0
        assert torch.allclose(tree.scores[b].double(), torch.tensor(path_lp, dtype=torch.float64), atol=1e-5)
        assert (tree.scores[b, 1:-1] >= tree.scores[b, 2:]).all()


def test_tree_fields():
    logits = _logits(2, 5, 20)
    root, start = torch.tensor([11, 12]), torch.tensor([30, 0])
    tree = build_tree("ddtree", logits, root, start, 24)
    tree.check()  # parents first, depths, positions = start + depth, ancestor mask
    assert torch.equal(tree.tokens[:, 0], root)
    assert torch.equal(tree.positions[:, 0], start)
    assert tree.max_depth == 5 and not tree.is_chain
    assert tree.num_nodes.tolist() == [24, 24]
    for b in range(2):
        paths = set(_paths(tree, b))
        assert all(p[:-1] in paths or len(p) == 1 for p in paths)  # prefix-closed


def test_chain_mode_is_the_argmax_path():
    logits = _logits(3, 6, 30)
    tree = build_tree("dflash", logits, torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]), 999)
    tree.check()
    assert tree.is_chain and tree.width == 7
    assert torch.equal(tree.tokens[:, 1:], logits.argmax(-1))
    assert torch.equal(tree.parents[0], torch.arange(-1, 6))
    assert torch.equal(tree.ancestor_mask[0], torch.ones(7, 7, dtype=torch.bool).tril())


def test_width_one_ddtree_budget_equals_chain():
    logits = _logits(1, 4, 8)
    chain = build_tree("dflash", logits, torch.tensor([0]), torch.tensor([0]))
    tree = build_tree("ddtree", logits, torch.tensor([0]), torch.tensor([0]), 1)
    assert torch.equal(tree.tokens, chain.tokens[:, :2])


def test_one_hot_and_ties_keep_parents_first_and_are_deterministic():
    logits = torch.zeros(2, 5, 10)
    logits[:, :, 3] = 40.0  # log-prob ~0 at every depth: parent and child tie
    logits[1, 2, 4] = 40.0  # an exact tie between two tokens
    logits[1, 3, :5] = float("-inf")
    a = build_tree("ddtree", logits, torch.tensor([0, 0]), torch.tensor([0, 0]), 30)
    b = build_tree("ddtree", logits, torch.tensor([0, 0]), torch.tensor([0, 0]), 30)
    a.check()
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert a.tokens[0, 1:6].tolist() == [3] * 5  # the spine comes first


@pytest.mark.parametrize("budget", [0, -1, MAX_TREE_BUDGET + 1, 2.5, None, True])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match="budget"):
        build_tree("ddtree", _logits(1, 3, 5), torch.tensor([0]), torch.tensor([0]), budget)


def test_unknown_mode_and_bad_shape():
    with pytest.raises(ValueError, match="unknown spec mode"):
        build_tree("eagle", _logits(1, 3, 5), torch.tensor([0]), torch.tensor([0]), 4)
    with pytest.raises(ValueError, match="draft_logits"):
        build_tree("ddtree", torch.zeros(3, 5), torch.tensor([0]), torch.tensor([0]), 4)


def test_max_budget_builds():
    logits = _logits(1, 15, 2000)
    tree = build_tree("ddtree", logits, torch.tensor([0]), torch.tensor([0]), MAX_TREE_BUDGET)
    assert tree.width == MAX_TREE_BUDGET + 1
    tree.check()


FUSED_CASES = [  # budget, depth, vocab, batch, logits
    (7, 5, 30, 1, "randn"), (15, 15, 4096, 2, "randn"), (31, 15, 200, 1, "randn"),
    (127, 15, 300, 1, "randn"), (16, 6, 12, 2, "randn"), (5, 3, 4, 3, "randn"),
    (15, 6, 8, 2, "zeros"), (31, 15, 64, 1, "onehot"), (7, 4, 5, 2, "small-ints"),
]


@pytest.mark.slow
@pytest.mark.parametrize("budget, depth, vocab, batch, kind", FUSED_CASES)
def test_fused_build_is_the_torch_build_bit_for_bit(budget, depth, vocab, batch, kind, monkeypatch):
    """kernels/tree_build.py (interpreter) against the torch build: every field equal, ties
    (all-equal, one-hot, repeated integer logits) included."""
    from treeflash.speculative import build

    g = torch.Generator().manual_seed(budget * 100 + depth)
    logits = {"randn": lambda: torch.randn(batch, depth, vocab, generator=g) * 3,
              "zeros": lambda: torch.zeros(batch, depth, vocab),
              "onehot": lambda: torch.full((batch, depth, vocab), -30.0).index_fill_(2, torch.tensor([0]), 30.0),
              "small-ints": lambda: torch.randint(0, 3, (batch, depth, vocab), generator=g).float()}[kind]()
    roots = torch.randint(0, vocab, (batch,), generator=g)
    start = torch.randint(0, 100, (batch,), generator=g)
    want = build_tree("ddtree", logits, roots, start, budget)
    monkeypatch.setattr(build, "FUSED_TREE", "triton")
    got = build_tree("ddtree", logits, roots, start, budget)
    for f in ("tokens", "parents", "depths", "positions", "ancestor_mask", "valid", "scores"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and torch.equal(a, b), f
    assert (got.max_depth, got.is_chain) == (want.max_depth, want.is_chain)


@pytest.mark.slow
@pytest.mark.parametrize("depth, vocab", [(15, 4096), (5, 7), (1, 10)])
def test_fused_chain_is_the_torch_chain(depth, vocab, monkeypatch):
    from treeflash.speculative import build

    g = torch.Generator().manual_seed(depth)
    logits = torch.randn(2, depth, vocab, generator=g)
    roots, start = torch.tensor([3, 4]), torch.tensor([10, 0])
    want = build_tree("dflash", logits, roots, start)
    monkeypatch.setattr(build, "FUSED_TREE", "triton")
    got = build_tree("dflash", logits, roots, start)
    assert got.is_chain and want.is_chain
    for f in ("tokens", "parents", "depths", "positions", "ancestor_mask", "valid", "scores"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["randn", "small-ints"])
def test_build_with_the_topk_kernel(kind, monkeypatch):
    """The top-k of the log-probs through its Triton kernel (interpreter) builds the same tree as
    through the torch twin; on tie-free logits both are the former log_softmax(...).topk(k)."""
    from treeflash import kernels
    from treeflash.speculative import build

    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(2, 4, 300, generator=g) * 3 if kind == "randn"
              else torch.randint(0, 3, (2, 4, 300), generator=g).float())
    roots, start = torch.tensor([3, 4]), torch.tensor([10, 0])
    trees, public = {}, kernels.topk_logprobs
    for name, topk in (("twin", lambda x, k, fused=True: public(x, k, impl="torch")),
                       ("kernel", lambda x, k, fused=True: public(x, k, impl="triton")),
                       ("former", lambda x, k, fused=True: torch.log_softmax(x.float(), dim=-1).topk(k, dim=-1))):
        monkeypatch.setattr(build.kernels, "topk_logprobs", topk)
        trees[name] = build_tree("ddtree", logits, roots, start, 15)
    others = ("kernel", "former") if kind == "randn" else ("kernel",)  # ties: torch.topk's order is its own
    for name in others:
        for f in ("tokens", "parents", "depths", "positions", "ancestor_mask", "valid"):
            assert torch.equal(getattr(trees[name], f), getattr(trees["twin"], f)), (name, f)
        assert torch.allclose(trees[name].scores, trees["twin"].scores, atol=1e-5), name  # (rounding of lp)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("mode, budget, depth, vocab", [("ddtree", 31, 15, 200), ("ddtree", 7, 4, 5),
                                                        ("dflash", None, 6, 50), ("ddtree", 1, 5, 30)])
def test_build_into_given_buffers(impl, mode, budget, depth, vocab, monkeypatch):
    """build_tree(out=TreeOut(...)): the same tree, its tokens / positions / mask in the given
    buffers (the verify forward's static inputs) and start in the int32 prefix buffer;
    tree_width gives their width without building."""
    from treeflash.kernels.tree_build import TreeOut
    from treeflash.speculative import build

    monkeypatch.setattr(build, "FUSED_TREE", impl)
    g = torch.Generator().manual_seed(depth)
    logits = torch.randn(2, depth, vocab, generator=g) * 3
    roots, start = torch.tensor([3, 4]), torch.tensor([10, 7])
    want = build_tree(mode, logits, roots, start, budget)
    n = build.tree_width(mode, budget or 0, depth, vocab)
    assert n == want.width
    chain = want.is_chain
    mask = None if chain else torch.zeros(2, n, n, dtype=torch.bool)
    out = TreeOut(torch.full((2, n), -5), torch.full((2, n), -5), mask, torch.zeros(2, dtype=torch.int32))
    got = build_tree(mode, logits, roots, start, budget, out=out)
    assert got.tokens is out.tokens and got.positions is out.positions
    assert chain or got.ancestor_mask.data_ptr() == out.mask.data_ptr()
    for f in ("tokens", "parents", "depths", "positions", "ancestor_mask", "valid", "scores"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert out.prefix_lens.tolist() == [10, 7]
    with pytest.raises(ValueError, match="tree output buffer"):
        build_tree(mode, logits, roots, start, budget, out=TreeOut(tokens=torch.zeros(2, n + 1, dtype=torch.long)))
