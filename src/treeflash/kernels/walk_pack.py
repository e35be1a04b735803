"""The walk (speculative/verify.py) and the step's packed result in one Triton launch per step.

The torch walk is ~30 small kernels (a gather, the match, the ancestor reduction, the
accepted count, a scatter of node ids by depth, gathers of the deepest node, the bonus and
the drafts, a cat and a scatter), and packing what the host learns is ~8 more (casts and a
cat). Inside the tail's CUDA graph each still costs ~1.5-2.5 us of GPU time: on a small
pair, whose step is launch-bound, that is a visible slice of every step and none of the
plain decode's. Here one program per request does it all:

- match[i] = node i's token is the target's choice after its parent (the root matches);
- accepted[i] = every ancestor-or-self matches (one [N, N] block of the ancestor mask);
- path[d] = the accepted node at depth d (the accepted nodes form one chain, one per depth);
- the drafts along the path, the bonus (the target's token after the deepest accepted node),
  the counts, and the acceptance under each auto-budget candidate (accepted nodes numbered
  1..c), written straight into the packed row.

The result equals the torch walk's, element for element (tests/speculative/test_walk.py runs both).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MAX_NODES = 256  # one [N, N] block of the ancestor mask a program


@triton.jit
def _walk_kernel(TOK, PAR, DEP, VAL, ANC, POST, CAND,
                 O_PATH, O_IDX, O_ROWS, O_NUM, O_DEPTH, O_BONUS, O_NEW, O_PACK,
                 N, W, C, s_pack,
                 NB: tl.constexpr, WB: tl.constexpr, CB: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, NB)
    inb = offs < N
    row = b * N
    tok = tl.load(TOK + row + offs, mask=inb, other=0)
    par = tl.load(PAR + row + offs, mask=inb, other=-1)
    dep = tl.load(DEP + row + offs, mask=inb, other=0)
    val = (tl.load(VAL + row + offs, mask=inb, other=0) != 0) & inb
    post_par = tl.load(POST + row + tl.maximum(par, 0), mask=inb, other=-1)
    match = ((tok == post_par) & (par >= 0) & val) | (offs == 0)
    i2 = offs[:, None]
    j2 = offs[None, :]
    anc = tl.load(ANC + b * N * N + i2 * N + j2, mask=(i2 < N) & (j2 < N), other=0) != 0
    bad = tl.sum((anc & (match[None, :] == 0)).to(tl.int32), axis=1) > 0
    acc = (bad == 0) & val
    num = tl.sum(acc.to(tl.int32), axis=0) - 1
    d = tl.arange(0, WB)
    at_d = acc[None, :] & (dep[None, :] == d[:, None])  # [WB, NB]
    path = tl.max(tl.where(at_d, j2, -1), axis=1).to(tl.int64)  # [WB]: -1 where none
    after = acc[None, :] & (dep[None, :] == d[:, None] + 1)
    path_next = tl.max(tl.where(after, j2, -1), axis=1).to(tl.int64)
    deepest = tl.sum(tl.where(d == num, path, 0), axis=0)
    bonus = tl.load(POST + row + deepest)
    acc_depth = tl.load(DEP + row + deepest)
    drafts = tl.load(TOK + row + tl.maximum(path_next, 0), mask=(path_next >= 0) & (d < W), other=-1)
    drafts = tl.where(path_next >= 0, drafts, -1)
    new = tl.where(d < num, drafts, tl.where(d == num, bonus, -1)).to(tl.int64)
    in_w = d < W
    tl.store(O_PATH + b * W + d, path, mask=in_w)
    tl.store(O_IDX + b * W + d, tl.maximum(path, 0), mask=in_w)
    tl.store(O_NEW + b * W + d, new, mask=in_w)
    num64 = num.to(tl.int64)
    tl.store(O_NUM + b, num64)
    tl.store(O_ROWS + b, num64 + 1)
    tl.store(O_DEPTH + b, acc_depth)
    tl.store(O_BONUS + b, bonus)
    pack = O_PACK + b * s_pack
    tl.store(pack + d, new, mask=in_w)
    tl.store(pack + W, num64)
    tl.store(pack + W + 1, tl.sum(val.to(tl.int64), axis=0) - 1)
    tl.store(pack + W + 2, acc_depth)
    if CB > 0:
        c = tl.arange(0, CB)
        bound = tl.load(CAND + c, mask=c < C, other=0)
        drafted = acc & (offs >= 1)
        under = tl.sum((drafted[None, :] & (j2 <= bound[:, None])).to(tl.int64), axis=1)
        tl.store(pack + W + 3 + c, under, mask=c < C)


def tree_walk_triton(tokens, parents, depths, valid, ancestor_mask, post, width, candidates=None):
    """See `treeflash.kernels.tree_walk`."""
    b, n = tokens.shape
    if n > MAX_NODES:
        raise ValueError(f"tree_walk_triton takes at most {MAX_NODES} nodes a tree, got {n}")
    dev = tokens.device
    c = 0 if candidates is None else candidates.shape[0]
    long = dict(dtype=torch.long, device=dev)
    path, idx, new = (torch.empty(b, width, **long) for _ in range(3))
    rows, num, depth, bonus = (torch.empty(b, **long) for _ in range(4))
    packed = torch.empty(b, width + 3 + c, **long)
    _walk_kernel[(b,)](
        tokens.contiguous(), parents.contiguous(), depths.contiguous(), valid.contiguous().view(torch.uint8),
        ancestor_mask.contiguous().view(torch.uint8), post.contiguous(),
        candidates if c else tokens,
        path, idx, rows, num, depth, bonus, new, packed,
        n, width, c, packed.stride(0),
        NB=max(16, triton.next_power_of_2(n)), WB=max(16, triton.next_power_of_2(width)),
        CB=0 if c == 0 else max(2, triton.next_power_of_2(c)),
    )
    return path, idx, rows, num, depth, bonus, new, packed


@triton.jit
def _argmax_rows_kernel(X, OUT, V, s_row, BV: tl.constexpr):
    """One row a program: the index of its first maximum (torch.argmax's tie rule)."""
    r = tl.program_id(0).to(tl.int64)
    best = tl.full((), float("-inf"), tl.float32)
    idx = tl.full((), 0, tl.int64)
    for start in range(0, V, BV):
        offs = start + tl.arange(0, BV)
        x = tl.load(X + r * s_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        i = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start
        take = m > best  # strictly greater: an earlier chunk keeps a tie
        idx = tl.where(take, i, idx)
        best = tl.where(take, m, best)
    tl.store(OUT + r, idx)


def argmax_rows_triton(x: torch.Tensor) -> torch.Tensor:
    """See `treeflash.kernels.argmax`."""
    v = x.shape[-1]
    rows = x.reshape(-1, v)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.long, device=x.device)
    if rows.shape[0]:
        _argmax_rows_kernel[(rows.shape[0],)](rows, out, v, rows.stride(0),
                                              BV=min(4096, triton.next_power_of_2(v)))
    return out.view(x.shape[:-1])
