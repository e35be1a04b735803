"""The walk: hand-made trees, a literal reference walk on random trees, padding, chains."""

from __future__ import annotations

import pytest
import torch

from treeflash.speculative.build import build_tree
from treeflash.speculative.tree import DraftTree, ancestor_mask
from treeflash.speculative.verify import walk_greedy, walk_tree


def make_tree(tokens, parents, start=10, max_depth=None) -> DraftTree:
    tokens = torch.tensor([tokens])
    parents = torch.tensor([parents])
    depths = [0]
    for p in parents[0, 1:].tolist():
        depths.append(depths[p] + 1)
    depths = torch.tensor([depths])
    return DraftTree(
        tokens,
        parents,
        depths,
        start + depths,
        ancestor_mask(parents),
        torch.ones_like(tokens, dtype=torch.bool),
        max_depth if max_depth is not None else int(depths.max()),
    )


#        0(root=5)
#       /    |    \
#   1(7)   2(8)   3(9)
#    |       |  \
#   4(1)   5(2) 6(3)
#            |
#          7(4)
TREE = ([5, 7, 8, 9, 1, 2, 3, 4], [-1, 0, 0, 0, 1, 2, 2, 5])


@pytest.mark.parametrize(
    "post, path, bonus",
    [
        ([8, 0, 2, 0, 0, 4, 0, 6], [0, 2, 5, 7], 6),  # a sibling branch to the deepest leaf
        ([8, 0, 3, 0, 0, 0, 0, 0], [0, 2, 6], 0),  # the other child at depth 2
        ([7, 1, 0, 0, 9, 0, 0, 0], [0, 1, 4], 9),  # full depth of the first branch
        ([6, 7, 8, 9, 1, 2, 3, 4], [0], 6),  # nothing accepted: bonus is the target's root token
        ([9, 9, 9, 9, 9, 9, 9, 9], [0, 3], 9),  # leaf at depth 1
    ],
)
def test_hand_made_tree(post, path, bonus):
    tree = make_tree(*TREE, max_depth=3)
    tree.check()
    w = walk_tree(tree, torch.tensor([post]))
    k = len(path) - 1
    assert w.accepted_nodes[0, : k + 1].tolist() == path
    assert (w.accepted_nodes[0, k + 1 :] == -1).all()
    assert w.num_accepted.tolist() == [k] and w.accepted_depth.tolist() == [k]
    assert w.bonus.tolist() == [bonus]
    drafts = [TREE[0][i] for i in path[1:]]
    assert w.new_tokens[0].tolist() == drafts + [bonus] + [-1] * (3 - k)
    assert w.commit_lengths.tolist() == [k + 1]


def _reference_walk(tokens, parents, post):
    """ddtree.py's loop with child maps."""
    child = {}
    for i in range(1, len(tokens)):
        child.setdefault(parents[i], {})[tokens[i]] = i
    cur, acc, nxt = 0, [0], post[0]
    while nxt in child.get(cur, {}):
        cur = child[cur][nxt]
        acc.append(cur)
        nxt = post[cur]
    return acc, nxt


@pytest.mark.parametrize("seed", range(6))
def test_random_trees_match_reference_walk(seed):
    g = torch.Generator().manual_seed(seed)
    v, d, b = 6, 5, 4
    logits = torch.randn(b, d, v, generator=g)
    tree = build_tree(
        "ddtree", logits, torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long), 20
    )
    # A target that often agrees with the tree: post = a random node's child token or noise.
    post = torch.randint(v, (b, tree.width), generator=g)
    agree = torch.rand(b, tree.width, generator=g) < 0.7
    child_tok = torch.zeros_like(post)
    for bi in range(b):
        for i in range(1, tree.width):
            child_tok[bi, tree.parents[bi, i]] = tree.tokens[bi, i]
    post = torch.where(agree, child_tok, post)
    w = walk_tree(tree, post)
    for bi in range(b):
        acc, bonus = _reference_walk(
            tree.tokens[bi].tolist(), tree.parents[bi].tolist(), post[bi].tolist()
        )
        assert w.accepted_nodes[bi, : len(acc)].tolist() == acc
        assert int(w.num_accepted[bi]) == len(acc) - 1 and int(w.bonus[bi]) == bonus


def test_padded_batch_equals_single_walks():
    t1 = make_tree(*TREE, max_depth=3)
    t2 = make_tree([1, 2, 3], [-1, 0, 1], start=4)
    t3 = make_tree([0], [-1], start=0, max_depth=0)
    batch = DraftTree.cat([t1, t2, t3])
    batch.check()
    assert batch.width == 8 and batch.num_nodes.tolist() == [7, 2, 0]
    posts = [[8, 0, 2, 0, 0, 4, 0, 6], [2, 3, 9], [4]]
    post = torch.tensor(
        [p + [2] * (8 - len(p)) for p in posts]
    )  # padding tokens collide on purpose
    w = walk_tree(batch, post)
    for i, (t, p) in enumerate(zip([t1, t2, t3], posts, strict=True)):
        single = walk_tree(t, torch.tensor([p]))
        k = int(single.num_accepted[0])
        assert int(w.num_accepted[i]) == k and int(w.bonus[i]) == int(single.bonus[0])
        assert w.accepted_nodes[i, : k + 1].tolist() == single.accepted_nodes[0, : k + 1].tolist()
    assert w.num_accepted.tolist() == [3, 2, 0] and w.bonus.tolist() == [6, 9, 4]


def test_chain_walk_is_the_longest_matching_prefix():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 7, 4, generator=g)
    tree = build_tree(
        "dflash", logits, torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long)
    )
    target_logits = torch.randn(5, 8, 4, generator=g)
    post = target_logits.argmax(-1)
    w = walk_greedy(tree, target_logits)
    drafts = tree.tokens[:, 1:]
    want = (drafts == post[:, :-1]).long().cumprod(1).sum(1)  # the reference dflash_generate rule
    assert torch.equal(w.num_accepted, want)
    assert torch.equal(w.bonus, post.gather(1, want[:, None])[:, 0])


def test_bad_post_shape():
    with pytest.raises(ValueError, match="post"):
        walk_tree(make_tree(*TREE), torch.zeros(1, 3, dtype=torch.long))
