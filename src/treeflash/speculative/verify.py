"""The walk: follow the target's own token through the draft tree, batched, on device.

`post[b, i]` is the target's token after node i (its argmax, or one draw from the processed
target distribution at T > 0: the sampler belongs to the engine). Starting at the root,
the walk moves to the child whose token equals post at the current node, while there is
one; the first target token that is not a child becomes the bonus. Every committed token
is the target's own choice, so this is lossless for greedy and for sampling alike. On CUDA
the walk and the packing of what the host learns are one launch (`kernels/walk_pack.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeflash import kernels
from treeflash.runtime import DEFAULT, RuntimeOptions
from treeflash.speculative.tree import DraftTree


@dataclass(frozen=True)
class WalkResult:
    accepted_nodes: torch.Tensor  # [B, max_depth+1] node indices, root first; -1 pads
    num_accepted: torch.Tensor  # [B] accepted drafts (root excluded)
    accepted_depth: torch.Tensor  # [B] depth of the deepest accepted node (== num_accepted)
    bonus: torch.Tensor  # [B] target token after the deepest accepted node
    new_tokens: torch.Tensor  # [B, max_depth+1] accepted drafts then the bonus; -1 pads
    index: torch.Tensor  # [B, max_depth+1] accepted_nodes clamped at 0 (the rows to commit)
    rows: torch.Tensor  # [B] rows to commit: num_accepted + 1 (the bonus's own row is the root's)
    packed: torch.Tensor  # [B, W] what the host learns (kernels.tree_walk): tokens, counts, ...

    @property
    def commit_lengths(self) -> torch.Tensor:
        """[B] tokens this step emits (accepted drafts + bonus)."""
        return self.rows


WALK_IMPL: str | None = None  # tests: "triton" runs the fused walk on CPU tensors (interpreter)
WALK_MAX_NODES = 256  # kernels/walk_pack.py's MAX_NODES (not imported here: it imports Triton)


def walk_impl(t: torch.Tensor, fused: bool = True) -> str | None:
    """The walk's kernel impl: Triton (one launch) on CUDA, torch elsewhere; fused=False (the
    runtime option fused_walk=0) keeps the torch ops on CUDA (A/B). Tests set WALK_IMPL."""
    if WALK_IMPL is not None:
        return WALK_IMPL
    if t.is_cuda and not fused:
        return "torch"
    return None


def walk_tree(tree: DraftTree, post: torch.Tensor, candidates: torch.Tensor | None = None,
              options: RuntimeOptions = DEFAULT) -> WalkResult:
    """Accepted path per request. post [B, N] long: the target's token at every tree node.
    candidates [C] long: also count, per auto-budget candidate c, the drafts accepted among
    nodes 1..c (the packed row's last C columns; `speculative/budget.py`).

    Needs siblings with distinct tokens (what build_tree makes), so the path is unique.
    """
    b, n = tree.tokens.shape
    if post.shape != (b, n):
        raise ValueError(f"post must be [B, N] = {[b, n]}, got {list(post.shape)}")
    impl = walk_impl(post, options.fused_walk)
    if impl is None and n > WALK_MAX_NODES:  # one [N, N] mask block a program: big trees keep torch
        impl = "torch"
    path, index, rows, num, depth, bonus, new, packed = kernels.tree_walk(
        tree.tokens, tree.parents, tree.depths, tree.valid, tree.ancestor_mask, post, tree.max_depth + 1,
        candidates, impl=impl)
    return WalkResult(accepted_nodes=path, num_accepted=num, accepted_depth=depth, bonus=bonus,
                      new_tokens=new, index=index, rows=rows, packed=packed)


def walk_greedy(tree: DraftTree, target_logits: torch.Tensor) -> WalkResult:
    """walk_tree with post = argmax of target_logits [B, N, V]."""
    return walk_tree(tree, target_logits.argmax(-1))
