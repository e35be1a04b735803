"""DDTree's tree build (speculative/build.py) in one Triton launch per step.

The torch build runs ~250 small kernels for a 31-node tree over 15 depths (per depth: two
gathers, an add, a sort, three gathers; then a global sort, scatters, cats and the ancestor
mask's pointer doubling). Inside the drafter's CUDA graph each still costs ~2 us of GPU time:
about half of the shipped pair's drafter phase. Here one program per request does it all:

- per depth, every candidate (parent beam rank i, child rank r) of `tree_plan.candidate_pairs` gets the score
  prev[i] + lp[r] (the same float32 add as the torch code) and one int64 sort key: the score's
  order-preserving bits, then the candidate's index reversed, so the keys are distinct and a
  descending order of them is score descending with ties in candidate order, i.e. torch's
  stable descending sort; the beam's best m_d come from a bitonic top-k (`_topk_desc`, shared
  with kernels/topk_lp.py: blocks of k sorted, then halved log2(C / k) times), not a full sort
  of all C candidates (31 of 1024 at budget 31: ~a third of the compare-and-swap stages);
- the global top-`n` over all depths the same way (ties by depth, then beam rank);
- parents by a node-of-candidate scatter, the ancestor mask by following parents D times;
- each node's score (its path log-prob) beside it, for the tree sizing.

The result is the torch build's DraftTree, bit for bit (tests/speculative/test_build.py runs both).
Scores must be finite (the drafter's log-probs are); -0.0 is ordered as +0.0, as torch does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from treeflash.kernels.tree_plan import candidate_pairs  # noqa: E402

MAX_BUDGET = 127  # 1024 candidates a depth at most: one tl.sort of 1024 keys
MAX_DEPTH = 16
NUM_WARPS = 4  # one program a request


@triton.jit
def _order_key(score, index, INDEX_SPAN: tl.constexpr):
    """int64 key: descending order = score descending, then index ascending."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 becomes +0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone in the float's value
    return (ordered.to(tl.int64) << 32) | (INDEX_SPAN - 1 - index).to(tl.int64)


@triton.jit
def _key_score(key):
    ordered = (key >> 32).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _bitonic_merge(h, N: tl.constexpr, STAGE: tl.constexpr, ALTERNATE: tl.constexpr):
    """Bitonic merge of blocks of 2**STAGE along the innermost axes of the hypercube h [2]*N:
    descending, or (ALTERNATE) with each block's direction given by bit STAGE of its lane.

    A lane's partner is (pair sum) - self (int64 wraps) where tl.sort / tl.topk use an xor_sum:
    a custom-combine reduce, which the interpreter runs element by element in Python (~15x
    slower here), while a sum is one numpy call; on the GPU both are the same reduce over a
    size-2 axis (registers or one shuffle)."""
    if ALTERNATE:
        flip = tl.reshape(tl.arange(0, 2), [1] * (N - STAGE - 1) + [2] + [1] * STAGE)
    else:
        flip = 1
    # step s pairs lanes along axis N - STAGE + s (lane bit STAGE - 1 - s); inline expressions,
    # no locals: the interpreter turns every plain assignment into a tensor, and a constexpr
    # cannot be reassigned in a loop
    for s in tl.static_range(STAGE):
        other = tl.sum(h, axis=N - STAGE + s, keep_dims=True) - h
        right = tl.reshape(tl.arange(0, 2), [1] * (N - STAGE + s) + [2] + [1] * (STAGE - 1 - s))
        h = tl.where((h > other) != ((flip ^ right) == 1), other, h)
    return h


@triton.jit
def _topk_desc(x, LOG_N: tl.constexpr, LOG_K: tl.constexpr):
    """The 2**LOG_K largest of x [2**LOG_N], descending; 1 <= LOG_K <= LOG_N (tl.topk of 3.6
    cannot do k = 1 either). tl.topk's bitonic top-k: sort blocks of 2**LOG_K (alternating
    directions), then LOG_N - LOG_K times keep the larger of each pair of blocks (an elementwise
    max of a bitonic pair) and re-merge. Nested @jit calls are few: the interpreter pays ~1 ms
    for each."""
    h = tl.reshape(x, [2] * LOG_N)
    for i in tl.static_range(1, LOG_K + 1):
        h = _bitonic_merge(h, LOG_N, i, i < LOG_N)
    for i in tl.static_range(LOG_K + 1, LOG_N + 1):
        h = tl.max(h, axis=LOG_N - i)  # [2] * (LOG_N + LOG_K - i) axes left
        h = _bitonic_merge(h, LOG_N + LOG_K - i, LOG_K, i < LOG_N)
    return tl.reshape(h, [2**LOG_K])


@triton.jit
def _ddtree_kernel(LP, TOK, ROOT, START, PI, RI, MD, CD,
                   S_SC, S_PA, S_TK, NODE_OF,
                   O_TOK, O_PAR, O_DEP, O_POS, O_MASK, O_VAL, O_PRE, O_SC,
                   s_lb, s_ld, s_tb, s_td, K, n_nodes,
                   HAS_PRE: tl.constexpr, D: tl.constexpr, MB: tl.constexpr, CB: tl.constexpr, GB: tl.constexpr,
                   NB: tl.constexpr, KD: tl.constexpr, KN: tl.constexpr, LOG_CB: tl.constexpr,
                   LOG_KD: tl.constexpr, LOG_GB: tl.constexpr, LOG_KN: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    lp = LP + b * s_lb
    tok = TOK + b * s_tb
    s_sc = S_SC + b * D * MB
    s_pa = S_PA + b * D * MB
    s_tk = S_TK + b * D * MB
    j = tl.arange(0, MB)

    # depth 1 (slot 0): the drafter's top m_0 tokens, already sorted
    m0 = tl.load(MD)
    ok = j < m0
    tl.store(s_sc + j, tl.load(lp + j, mask=ok, other=0.0), mask=ok)
    tl.store(s_pa + j, tl.zeros([MB], tl.int32), mask=ok)
    tl.store(s_tk + j, tl.load(tok + j, mask=ok, other=0), mask=ok)
    tl.debug_barrier()

    c = tl.arange(0, CB)
    kd = tl.arange(0, KD)
    for d in range(1, D):
        n_cand = tl.load(CD + d)
        m_d = tl.load(MD + d)
        c_ok = c < n_cand
        pi = tl.load(PI + d * CB + c, mask=c_ok, other=0)
        ri = tl.load(RI + d * CB + c, mask=c_ok, other=0)
        cand = tl.load(s_sc + (d - 1) * MB + pi, mask=c_ok, other=0.0) \
            + tl.load(lp + d * s_ld + ri, mask=c_ok, other=0.0)
        key = tl.where(c_ok, _order_key(cand, c, CB), -9223372036854775807 - 1)
        # the beam's m_d <= KD best keys, descending (keys are distinct: the same prefix as a
        # full descending sort of all CB, at ~a third of its compare-and-swap stages for 31 of 1024)
        key = _topk_desc(key, LOG_CB, LOG_KD)
        src = (CB - 1) - (key & 0xFFFFFFFF).to(tl.int32)  # candidate index, in sorted order
        keep = kd < m_d
        src = tl.where(keep, src, 0)
        r_sel = tl.load(RI + d * CB + src, mask=keep, other=0)
        tl.store(s_sc + d * MB + kd, _key_score(key), mask=keep)
        tl.store(s_pa + d * MB + kd, tl.load(PI + d * CB + src, mask=keep, other=0), mask=keep)
        tl.store(s_tk + d * MB + kd, tl.load(tok + d * s_td + r_sel, mask=keep, other=0), mask=keep)
        tl.debug_barrier()

    # the global top n_nodes over all depths: ties by depth, then by beam rank
    g = tl.arange(0, GB)
    g_d = g // MB
    g_j = g % MB
    g_ok = (g_d < D) & (g_j < tl.load(MD + g_d, mask=g_d < D, other=0))
    score = tl.load(s_sc + g, mask=g_ok, other=0.0)
    key = tl.where(g_ok, _order_key(score, g, GB), -9223372036854775807 - 1)
    key = _topk_desc(key, LOG_GB, LOG_KN)  # the n_nodes <= KN best, descending
    t = tl.arange(0, KN)
    src = (GB - 1) - (key & 0xFFFFFFFF).to(tl.int32)  # node t + 1 is candidate src[t]
    is_node = t < n_nodes
    src = tl.where(is_node, src, 0)
    node_of = NODE_OF + b * GB
    tl.store(node_of + src, t + 1, mask=is_node)
    tl.debug_barrier()
    d_of = src // MB
    parent_beam = tl.load(s_pa + src, mask=is_node, other=0)
    up = tl.load(node_of + (d_of - 1) * MB + parent_beam, mask=is_node & (d_of > 0), other=0)
    start = tl.load(START + b)
    o_tok = O_TOK + b * (n_nodes + 1)
    o_par = O_PAR + b * (n_nodes + 1)
    o_dep = O_DEP + b * (n_nodes + 1)
    o_pos = O_POS + b * (n_nodes + 1)
    tl.store(o_tok + 1 + t, tl.load(s_tk + src, mask=is_node, other=0), mask=is_node)
    tl.store(o_par + 1 + t, up.to(tl.int64), mask=is_node)
    tl.store(o_dep + 1 + t, (d_of + 1).to(tl.int64), mask=is_node)
    tl.store(o_pos + 1 + t, start + (d_of + 1).to(tl.int64), mask=is_node)
    tl.store(O_SC + b * (n_nodes + 1) + 1 + t, _key_score(key), mask=is_node)
    tl.store(O_SC + b * (n_nodes + 1), 0.0)
    tl.store(o_tok, tl.load(ROOT + b))
    tl.store(o_par, -1)
    tl.store(o_dep, 0)
    tl.store(o_pos, start)
    if HAS_PRE:  # the verify forward's prefix length (int32): the root's position
        tl.store(O_PRE + b, start.to(tl.int32))
    tl.debug_barrier()

    # ancestor-or-self mask: follow each node's parents up to D times
    n1 = n_nodes + 1
    rows = tl.arange(0, NB)
    cols = tl.arange(0, NB)[None, :]
    mask = cols == rows[:, None]
    cur = rows.to(tl.int64)
    for _ in range(D):
        live = (cur >= 0) & (cur < n1)
        cur = tl.load(o_par + cur, mask=live, other=-1)
        mask = mask | (cols == cur[:, None])
    inside = (rows[:, None] < n1) & (cols < n1)
    tl.store(O_MASK + b * n1 * n1 + rows[:, None] * n1 + cols, mask.to(tl.uint8), mask=inside)
    tl.store(O_VAL + b * n1 + rows, tl.full([NB], 1, tl.uint8), mask=rows < n1)


@lru_cache(maxsize=64)
def _plan(budget: int, k: int, depth: int, device: torch.device):
    """Beam sizes m_d, candidate counts C_d and the (i, r) pairs per depth, as in _beams."""
    md, cd, pis, ris = [min(budget, k)], [0], [None], [None]
    for _ in range(1, depth):
        pi, ri = candidate_pairs(md[-1], k, budget, torch.device("cpu"))
        cd.append(pi.numel())
        md.append(min(budget, md[-1] * k, pi.numel()))
        pis.append(pi)
        ris.append(ri)
    cb = max(16, triton.next_power_of_2(max(cd)))
    pi_t = torch.zeros(depth, cb, dtype=torch.int32)
    ri_t = torch.zeros(depth, cb, dtype=torch.int32)
    for d in range(1, depth):
        pi_t[d, : cd[d]] = pis[d].to(torch.int32)
        ri_t[d, : cd[d]] = ris[d].to(torch.int32)
    n = min(budget, sum(md))
    return (torch.tensor(md, dtype=torch.int32, device=device), torch.tensor(cd, dtype=torch.int32, device=device),
            pi_t.to(device), ri_t.to(device), cb, n)


def supported(budget: int, k: int, depth: int) -> bool:
    """k = 1 is the chain (dflash: one candidate a depth, budget = depth)."""
    return 1 <= k and budget <= MAX_BUDGET and 1 <= depth <= MAX_DEPTH


def build_ddtree_triton(top_lp: torch.Tensor, top_tok: torch.Tensor, root: torch.Tensor,
                        start: torch.Tensor, budget: int, num_warps: int | None = None,
                        out: TreeOut | None = None):
    """(tokens, parents, depths, positions, ancestor_mask, valid, scores), each as
    `speculative/build.py::_build` makes them (scores: each node's path log-prob, float32), from
    top_lp / top_tok [B, D, K] (log-probs sorted descending per depth).
    num_warps: None = NUM_WARPS (benchmarks/tune_tree_build.py times the others).
    out: buffers to write tokens / positions / mask / the prefix lengths into (the verify
    forward's static inputs, engine/graphs.py), in place of new ones."""
    b, depth, k = top_lp.shape
    dev = top_lp.device
    md, cd, pi, ri, cb, n = _plan(budget, k, depth, dev)
    mb = max(16, triton.next_power_of_2(min(budget, k)))
    gb = triton.next_power_of_2(depth * mb)
    nb = max(16, triton.next_power_of_2(n + 1))
    # top-k widths (powers of two, 2 <= k <= n for `_topk_desc`): a beam keeps <= min(budget, k)
    # of its CB candidates, the tree <= n of the GB beam slots
    kd = min(cb, mb)
    kn = min(gb, max(2, triton.next_power_of_2(n)))
    lp = top_lp.float().contiguous()
    tok = top_tok.contiguous()
    s_sc = torch.empty(b, depth, mb, dtype=torch.float32, device=dev)
    s_pa = torch.empty(b, depth, mb, dtype=torch.int32, device=dev)
    s_tk = torch.empty(b, depth, mb, dtype=tok.dtype, device=dev)
    node_of = torch.empty(b, gb, dtype=torch.int32, device=dev)
    o4 = torch.empty(4, b, n + 1, dtype=torch.long, device=dev)
    o_tok, o_par, o_dep, o_pos = o4
    o_mask = torch.empty(b, n + 1, n + 1, dtype=torch.uint8, device=dev)
    o_pre = None
    if out is not None:
        o_tok = o_tok if out.tokens is None else _checked(out.tokens, (b, n + 1), torch.long)
        o_pos = o_pos if out.positions is None else _checked(out.positions, (b, n + 1), torch.long)
        if out.mask is not None:
            o_mask = _checked(out.mask, (b, n + 1, n + 1), torch.bool).view(torch.uint8)
        o_pre = None if out.prefix_lens is None else _checked(out.prefix_lens, (b,), torch.int32)
    o_val = torch.empty(b, n + 1, dtype=torch.uint8, device=dev)
    o_sc = torch.empty(b, n + 1, dtype=torch.float32, device=dev)
    _ddtree_kernel[(b,)](
        lp, tok, root.to(dev).long().contiguous(), start.to(dev).long().contiguous(), pi, ri, md, cd,
        s_sc, s_pa, s_tk, node_of, o_tok, o_par, o_dep, o_pos, o_mask, o_val,
        o_val if o_pre is None else o_pre, o_sc,
        lp.stride(0), lp.stride(1), tok.stride(0), tok.stride(1), k, n,
        HAS_PRE=o_pre is not None, D=depth, MB=mb, CB=cb, GB=gb, NB=nb, KD=kd, KN=kn, LOG_CB=cb.bit_length() - 1,
        LOG_KD=kd.bit_length() - 1, LOG_GB=gb.bit_length() - 1, LOG_KN=kn.bit_length() - 1,
        num_warps=num_warps or NUM_WARPS,
    )
    return o_tok, o_par, o_dep, o_pos, o_mask.view(torch.bool), o_val.view(torch.bool), o_sc


@dataclass
class TreeOut:
    """Where a build writes its tree instead of new tensors (None: a new one): tokens and
    positions [B, N] long, mask [B, N, N] bool, prefix_lens [B] int32 (= the start positions).
    Each must be contiguous with exactly that shape."""

    tokens: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None


def _checked(t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"tree output buffer must be a contiguous {dtype} tensor of shape {list(shape)}, "
                         f"got {t.dtype} {list(t.shape)} strides {t.stride()}")
    return t
