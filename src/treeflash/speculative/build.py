"""DDTree: the best `budget` draft prefixes under the drafter's per-depth marginals, on device.

The drafter gives one distribution q_d per block slot d = 1..D (D = block_size - 1),
treated as independent. A prefix (t_1..t_d) scores sum_e log q_e(t_e); DDTree keeps the
`budget` best prefixes (its best-first heap pops exactly these, in order). Scores only
fall as a path grows, so the set is prefix-closed.

Instead of a heap (one host round trip per node) we run a beam per depth: the top-budget
prefixes of depth d extend only top-budget prefixes of depth d-1 (any prefix of a top-M
path is beaten by at most M-1 others at its depth), so keeping `budget` per depth is exact.
A candidate (parent beam rank i, child rank r) is beaten or tied by the (i+1)(r+1)-1 pairs
(i' <= i, r' <= r), so only pairs with (i+1)(r+1) <= budget can make the cut: about
budget * (ln budget + 1) candidates per depth instead of budget^2. The final set is the
global top-budget over all depths, ordered by (score desc, depth asc, beam order), which
puts every parent before its children even when scores tie (a log-prob of exactly 0).

Chain mode (DFlash) is the same code with width 1 and budget D: the argmax path. Each node
keeps its score (`DraftTree.scores`): the tree sizing reads them (speculative/budget.py).
Cost per step: D sorts of ~budget*ln(budget) scores per request, one top-k over V
(`kernels.topk_logprobs`).
"""

from __future__ import annotations

import dataclasses

import torch

from treeflash import kernels
from treeflash.kernels.tree_plan import candidate_pairs as _pairs
from treeflash.runtime import DEFAULT, RuntimeOptions
from treeflash.speculative.tree import DraftTree, ancestor_mask

# Verify width is budget + 1 rows per request; beyond this the dense [N, N] tree mask and
# the per-depth candidate sort stop being cheap, and the paper sweeps no further.
MAX_TREE_BUDGET = 1024
SPEC_MODES = ("ddtree", "dflash")


def build_tree(
    mode: str,
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    start_pos: torch.Tensor,
    budget: int | None = None,
    out=None,
    options: RuntimeOptions = DEFAULT,
) -> DraftTree:
    """Draft tree for each request from the drafter's block logits.

    draft_logits [B, D, V] (slot d-1 predicts depth d); root_tokens [B] (the bonus);
    start_pos [B] (the root's position). mode "ddtree" needs 1 <= budget <= MAX_TREE_BUDGET;
    mode "dflash" is the chain (budget ignored, D nodes). out (`kernels.tree_build.TreeOut`):
    write tokens / positions / mask (and start as int32 prefix lengths) into these buffers,
    which the returned tree then holds: the verify forward's static inputs (speculative/decoder.py).
    options: `fused_tree` / `fused_topk` off keep the torch ops on CUDA (A/B runs).
    """
    if mode not in SPEC_MODES:
        raise ValueError(f"unknown spec mode {mode!r} (expected one of {', '.join(SPEC_MODES)})")
    if draft_logits.dim() != 3 or draft_logits.shape[1] < 1:
        raise ValueError(f"draft_logits must be [B, D>=1, V], got {list(draft_logits.shape)}")
    depth = draft_logits.shape[1]
    if mode == "dflash":
        return _build(draft_logits, root_tokens, start_pos, budget=depth, width=1, out=out, options=options)
    check_budget(budget)
    return _build(draft_logits, root_tokens, start_pos, budget=budget, width=budget, out=out, options=options)


def tree_width(mode: str, budget: int, depth: int, vocab: int) -> int:
    """N, the verify rows per request (root included) of the trees build_tree makes from
    [B, depth, vocab] logits: a host-side figure, no device value read."""
    if mode == "dflash":
        return depth + 1
    k = min(budget, vocab)
    m = [k]
    for _ in range(1, depth):
        m.append(min(budget, m[-1] * k, _pairs(m[-1], k, budget, torch.device("cpu"))[0].numel()))
    return min(budget, sum(m)) + 1


def check_budget(budget: int | None) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"tree budget must be an int, got {budget!r}")
    if not 1 <= budget <= MAX_TREE_BUDGET:
        raise ValueError(f"tree budget must be in [1, {MAX_TREE_BUDGET}], got {budget}")
    return budget


def _build(
    logits: torch.Tensor, root: torch.Tensor, start: torch.Tensor, *, budget: int, width: int, out=None,
    options: RuntimeOptions = DEFAULT,
) -> DraftTree:
    b, depth, vocab = logits.shape
    dev = logits.device
    k = min(width, vocab, budget)
    # [B, D, K] log-probs, best first; one launch on CUDA where it fits (kernels/topk_lp.py,
    # ties: the lower token id). Both builds below read these same two tensors.
    top_lp, top_tok = kernels.topk_logprobs(logits, k, fused=options.fused_topk)
    impl = _fused_tree_impl(logits, budget, k, depth, options.fused_tree)
    if impl is not None:
        from treeflash.kernels.tree_build import build_ddtree_triton

        tokens, parents, depths_out, positions, mask, valid, node_scores = build_ddtree_triton(
            top_lp, top_tok, root, start, budget, out=out)
        return DraftTree(tokens=tokens, parents=parents, depths=depths_out, positions=positions,
                         ancestor_mask=mask, valid=valid, max_depth=depth, is_chain=k == 1, scores=node_scores)
    scores, parents, tokens = _beams(top_lp, top_tok, budget)
    depths = torch.cat([torch.full((s.shape[1],), d + 1, device=dev) for d, s in enumerate(scores)])
    offsets = [0]
    for s in scores:
        offsets.append(offsets[-1] + s.shape[1])
    # Candidate ids are 1-based over the concatenated beams; 0 is the root.
    parent_cand = torch.cat(
        [p + (offsets[d - 1] + 1 if d else 0) for d, p in enumerate(parents)], 1
    )
    all_scores, all_tokens = torch.cat(scores, 1), torch.cat(tokens, 1)  # [B, S]
    n = min(budget, all_scores.shape[1])
    order = torch.sort(all_scores, dim=1, descending=True, stable=True).indices[:, :n]  # [B, n]
    node_of = torch.zeros(b, all_scores.shape[1] + 1, dtype=torch.long, device=dev)
    node_of.scatter_(1, order + 1, torch.arange(1, n + 1, device=dev).expand(b, n))
    node_parent = node_of.gather(1, parent_cand.gather(1, order))
    parents_out = torch.cat([torch.full((b, 1), -1, device=dev, dtype=torch.long), node_parent], 1)
    depths_out = torch.cat(
        [torch.zeros(b, 1, dtype=torch.long, device=dev), depths.long()[order]], 1
    )
    tokens_out = torch.cat([root.to(dev).long()[:, None], all_tokens.gather(1, order)], 1)
    tree = DraftTree(
        tokens=tokens_out,
        parents=parents_out,
        depths=depths_out,
        positions=start.to(dev).long()[:, None] + depths_out,
        ancestor_mask=ancestor_mask(parents_out, depth),
        valid=torch.ones(b, n + 1, dtype=torch.bool, device=dev),
        max_depth=depth,
        is_chain=k == 1,
        scores=torch.cat([torch.zeros(b, 1, dtype=torch.float32, device=dev),
                          all_scores.gather(1, order).float()], 1),
    )
    return tree if out is None else _into(tree, out, start)


def _into(tree: DraftTree, out, start: torch.Tensor) -> DraftTree:
    """The torch build's tree moved into the caller's buffers (what the fused build writes
    there directly); the returned tree holds them."""
    from treeflash.kernels.tree_build import _checked

    b, n = tree.tokens.shape
    moved = {}
    if out.tokens is not None:
        moved["tokens"] = _checked(out.tokens, (b, n), torch.long).copy_(tree.tokens)
    if out.positions is not None:
        moved["positions"] = _checked(out.positions, (b, n), torch.long).copy_(tree.positions)
    if out.mask is not None:
        moved["ancestor_mask"] = _checked(out.mask, (b, n, n), torch.bool).copy_(tree.ancestor_mask)
    if out.prefix_lens is not None:
        _checked(out.prefix_lens, (b,), torch.int32).copy_(start)
    return dataclasses.replace(tree, **moved)


# Tests set this to "triton" to run the fused build on CPU tensors (interpreter), "torch" to
# keep the torch ops on CUDA; None: the default (fused on CUDA, see _fused_tree_impl).
FUSED_TREE: str | None = None


def _fused_tree_impl(logits: torch.Tensor, budget: int, k: int, depth: int, fused: bool = True) -> str | None:
    """The one-launch build (kernels/tree_build.py) where it applies: a tree or chain of at
    most 127 nodes and 16 depths, on CUDA (`fused`: the runtime option fused_tree; 0 keeps the torch ops).
    H200, 2026-12-03 (results/h200-20261203-tree-build): bit-identical to the torch build at
    budgets 15-127, batch 1 and 4; 51 / 60 / 113 / 275 us under a graph against 409 / 418 /
    605 / 639 us at budgets 15 / 31 / 63 / 127; the shipped pair's ddtree-31 decode 2.12x
    spec off (1.76x at 32 with the torch build). H200, 2026-12-03 (results/h200-20261203-build-bitonic):
    with the top-k kernel and the bitonic selection inside, 30.5 / 40.5 / 90.8 /
    198.7 us at budgets 15 / 31 / 63 / 127, still bit-identical. The kernel module is imported
    only when it may be used: it imports Triton, which a CPU base install does not have."""
    if FUSED_TREE is None:
        wanted = "triton" if logits.is_cuda and fused else None
    else:
        wanted = None if FUSED_TREE == "torch" else FUSED_TREE
    if wanted is None:
        return None
    from treeflash.kernels.tree_build import supported

    return wanted if supported(budget, k, depth) else None


def _beams(top_lp: torch.Tensor, top_tok: torch.Tensor, budget: int):
    """Per depth: scores [B, M_d] (sorted, stable), parent beam index [B, M_d], tokens."""
    b, depth, k = top_lp.shape
    m = min(budget, k)
    scores, parents = (
        [top_lp[:, 0, :m]],
        [torch.zeros(b, m, dtype=torch.long, device=top_lp.device)],
    )
    tokens = [top_tok[:, 0, :m]]
    for d in range(1, depth):
        prev = scores[-1]
        pi, ri = _pairs(prev.shape[1], k, budget, top_lp.device)  # [C] each
        cand = prev[:, pi] + top_lp[:, d, ri]  # [B, C]
        m = min(budget, prev.shape[1] * k)
        sel = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :m]
        scores.append(cand.gather(1, sel))
        parents.append(pi[sel])
        tokens.append(top_tok[:, d].gather(1, ri[sel]))
    return scores, parents, tokens
