"""The walk: follow the target's own token through the draft tree, batched, on device.

`post[b, i]` is the target's token after node i (its argmax, or one draw from the processed
target distribution at T > 0: the sampler belongs to the engine). Starting at the root,
the walk moves to the child whose token equals post at the current node, while there is
one; the first target token that is not a child becomes the bonus. Every committed token
is the target's own choice, so this is lossless for greedy and for sampling alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeflash.spec.tree import DraftTree


@dataclass(frozen=True)
class WalkResult:
    accepted_nodes: torch.Tensor  # [B, max_depth+1] node indices, root first; -1 pads
    num_accepted: torch.Tensor  # [B] accepted drafts (root excluded)
    accepted_depth: torch.Tensor  # [B] depth of the deepest accepted node (== num_accepted)
    bonus: torch.Tensor  # [B] target token after the deepest accepted node
    new_tokens: torch.Tensor  # [B, max_depth+1] accepted drafts then the bonus; -1 pads

    @property
    def commit_lengths(self) -> torch.Tensor:
        """[B] tokens this step emits (accepted drafts + bonus)."""
        return self.num_accepted + 1


def walk_tree(tree: DraftTree, post: torch.Tensor) -> WalkResult:
    """Accepted path per request. post [B, N] long: the target's token at every tree node.

    Needs siblings with distinct tokens (what build_tree makes), so the path is unique.
    """
    b, n = tree.tokens.shape
    if post.shape != (b, n):
        raise ValueError(f"post must be [B, N] = {[b, n]}, got {list(post.shape)}")
    dev = tree.tokens.device
    idx = torch.arange(n, device=dev)
    parent = tree.parents.clamp(min=0)
    # Node i matches if it is the target's choice after its parent; the root always does.
    match = (tree.tokens == post.gather(1, parent)) & (tree.parents >= 0) & tree.valid
    match |= idx == 0
    # Accepted = every ancestor (and itself) matched.
    accepted = ~(tree.ancestor_mask & ~match[:, None, :]).any(-1) & tree.valid  # [B, N]
    num_accepted = accepted.sum(-1) - 1
    width = tree.max_depth + 1
    # Scatter accepted node ids by depth; rejected nodes go to a scratch column.
    slot = torch.where(accepted, tree.depths, torch.full_like(tree.depths, width))
    path = torch.full((b, width + 1), -1, dtype=torch.long, device=dev)
    path.scatter_(1, slot, idx.expand(b, n))
    path = path[:, :width]
    deepest = path.gather(1, num_accepted[:, None])  # [B, 1]
    bonus = post.gather(1, deepest)[:, 0]
    drafts = torch.where(path[:, 1:] >= 0, tree.tokens.gather(1, path[:, 1:].clamp(min=0)), -1)
    new_tokens = torch.cat([drafts, drafts.new_full((b, 1), -1)], 1)
    new_tokens.scatter_(1, num_accepted[:, None], bonus[:, None])
    return WalkResult(
        accepted_nodes=path,
        num_accepted=num_accepted,
        accepted_depth=tree.depths.gather(1, deepest)[:, 0],
        bonus=bonus,
        new_tokens=new_tokens,
    )


def walk_greedy(tree: DraftTree, target_logits: torch.Tensor) -> WalkResult:
    """walk_tree with post = argmax of target_logits [B, N, V]."""
    return walk_tree(tree, target_logits.argmax(-1))
