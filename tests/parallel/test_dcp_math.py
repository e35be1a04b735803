"""Decode context parallelism's bookkeeping without processes: how positions are dealt across the
ranks, a commit split over them (against one rank's commit), and the LSE merge of partials
(torch and the Triton combine, under the interpreter) against float64 attention over all keys."""

from __future__ import annotations

import pytest
import torch

from treeflash import kernels
from treeflash.kvcache import KVPool
from treeflash.models import dcp


@pytest.mark.parametrize("size, unit", [(2, 1), (2, 4), (4, 2), (8, 3)])
def test_positions_are_dealt_page_by_page_and_shares_grow_evenly(size, unit):
    lens = torch.arange(0, 200)
    shares = torch.stack([dcp.local_lens(lens, r, size, unit) for r in range(size)])  # [size, L]
    assert torch.equal(shares.sum(0), lens)  # every position on exactly one rank
    assert int((shares.max(0).values - shares.min(0).values).max()) <= unit  # even growth
    pos = torch.arange(200)
    own = dcp.owner(pos, size, unit)
    assert torch.equal(own, (pos // unit) % size)  # interleaved: page i on rank i % size
    for r in range(size):  # a rank's positions are its consecutive local rows, in order
        mine = pos[own == r]
        local = torch.stack([dcp.local_lens(p.view(1), r, size, unit)[0] for p in mine])
        assert torch.equal(local, torch.arange(len(mine)))
        assert torch.equal(local, (mine // (unit * size)) * unit + mine % unit)


def _commit_on_ranks(size, unit, prefix, accept, rows, n):
    """Scratch rows (node i tagged i + 1) written after each rank's share, the commit plan run on
    each rank's cache by kernels.kv_commit; returns the tag each global position ends up with."""
    b = len(prefix)
    pages = 64
    table = torch.arange(b * 16, dtype=torch.int32).view(b, 16)
    caches = []
    pre = torch.tensor(prefix)
    for r in range(size):
        kv = torch.zeros(pages, unit, 1)
        lp = dcp.local_lens(pre, r, size, unit).to(torch.int32)
        tags = (torch.arange(n, dtype=torch.float32) + 1).expand(b, n)[..., None]
        kernels.kv_write(kv, table, lp, tags.contiguous(), impl="torch")
        lp2, local, count = dcp.commit_plan(pre, torch.tensor(accept), torch.tensor(rows), r, size, unit)
        assert torch.equal(lp2, lp)
        kernels.kv_commit(kv, table, lp2, local, count, impl="torch")
        caches.append(kv)
    got = []
    for i in range(b):
        row = []
        for k in range(rows[i]):
            p = torch.tensor([prefix[i] + k])
            r = int(dcp.owner(p, size, unit))
            q = int(dcp.local_lens(p, r, size, unit))
            page = int(table[i, q // unit])
            row.append(int(caches[r][page, q % unit, 0]))
        got.append(row)
    return got


@pytest.mark.parametrize("size, unit", [(2, 2), (4, 1), (4, 3)])
def test_commit_keeps_each_accepted_node_on_its_owner(size, unit):
    prefix, n = [0, 5, 13], 9
    accept = [[0, 2, 3, 7, 8, 0], [0, 1, 4, 0, 0, 0], [0, 3, 4, 5, 6, 8]]
    rows = [5, 3, 6]
    got = _commit_on_ranks(size, unit, prefix, accept, rows, n)
    assert got == [[a + 1 for a in acc[:k]] for acc, k in zip(accept, rows)]  # one rank's commit


def test_settle_keeps_every_row_in_order():
    got = _commit_on_ranks(4, 2, [3, 0], [list(range(7))] * 2, [7, 7], 7)
    assert got == [list(range(1, 8))] * 2
    prefix = torch.tensor([3, 0])
    for r in range(4):
        want = dcp.commit_plan(prefix, torch.arange(7).expand(2, 7), torch.tensor([7, 7]), r, 4, 2)
        for a, b in zip(dcp.settle_plan(prefix, 7, r, 4, 2), want):
            assert torch.equal(a, b)


def _partials(scores, values, cuts):
    """Attention over each slice [a, b) of the keys: (out [S, ..., v], lse [S, ...]) in float32,
    an empty slice with lse -inf and NaN values (as the reference kernel leaves a row that sees
    nothing)."""
    outs, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        s = scores[..., a:b].float()
        lse = torch.logsumexp(s, -1) if b > a else torch.full(s.shape[:-1], float("-inf"))
        p = torch.exp(s - lse[..., None])
        outs.append(p @ values[a:b].float() if b > a else torch.full((*s.shape[:-1], values.shape[1]), float("nan")))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lse_merge_equals_attention_over_all_keys(impl, dtype):
    g = torch.Generator().manual_seed(0)
    b, n, h, keys, v = 2, 3, 4, 40, 32
    scores = torch.randn(b, n, h, keys, generator=g, dtype=torch.float64) * 3
    values = torch.randn(keys, v, generator=g, dtype=torch.float64)
    want_lse = torch.logsumexp(scores, -1)
    want = torch.softmax(scores, -1) @ values  # float64, one rank
    out, lse = _partials(scores, values, [0, 7, 7, 25, 40, 40])  # 5 ranks, two with no key,
    lse[4] = float("nan")  # one of them reported as a kernel may: LSE NaN (log of an empty sum)
    out = out.to(dtype)
    merged, merged_lse = dcp.merge(dcp.pack(out, lse), v, impl)  # as received: one buffer, LSE bits inside
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # (bf16 partials in, bf16 out)
    torch.testing.assert_close(merged.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(merged_lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_dcp_pool_holds_dcp_times_the_tokens_and_room_for_scratch():
    pool = KVPool(2, 10, 4, 8, torch.float32, "cpu", dcp=4)
    assert pool.tokens_per_page == 16 and pool.pages_for(17) == 2
    assert KVPool(2, 10, 4, 8, torch.float32, "cpu").scratch_tokens(64) == 0
    # every rank's share of any prefix, plus a forward's rows, fits the reserved pages
    for total in (1, 15, 16, 40, 100):
        for rows in (1, 6, 33):
            pages = pool.pages_for(total + pool.scratch_tokens(rows))
            for prefix in range(0, total - rows + 1):
                for r in range(4):
                    lp = int(dcp.local_lens(torch.tensor(prefix), r, 4, 4))
                    assert lp + rows <= pages * 4


@pytest.mark.parametrize("size, unit", [(2, 1), (4, 2), (8, 64)])
def test_one_new_row_is_at_its_owners_row_already(size, unit):
    # why `MLA._attend_dcp` skips the settle of a one-row forward: every rank's plan moves nothing
    for pos in range(3 * size * unit + 3):
        for rank in range(size):
            lp, local, count = dcp.settle_plan(torch.tensor([pos]), 1, rank, size, unit)
            assert int(count[0]) == int(dcp.owner(torch.tensor(pos), size, unit) == rank)
            assert int(local[0, 0]) == 0  # row lp + 0 to lp + 0
