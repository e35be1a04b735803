"""Step messages are schema-checked; layouts that do not split are refused before any process starts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from treeflash import LLM
from treeflash.config import ModelConfig
from treeflash.parallel import protocol
from treeflash.parallel.protocol import CommitSizes, ForwardSizes, Header, Op, ProtocolError
from treeflash.sharding import Parallel


def test_header_round_trip():
    h = Header(7, Op.FORWARD, ForwardSizes(2, 3, 4, True).args)
    back = Header.decode(h.encode(), 7)
    assert back == Header(7, Op.FORWARD, (2, 3, 4, 1, 1, 0) + (0,) * (protocol.HEADER_LEN - 10))
    assert ForwardSizes.from_args(back.args, num_pages=10) == ForwardSizes(2, 3, 4, True)
    coarse = Header.decode(Header(8, Op.FORWARD, ForwardSizes(2, 3, 4, True, 64).args).encode(), 8)
    assert ForwardSizes.from_args(coarse.args, num_pages=256) == ForwardSizes(2, 3, 4, True, 64)
    c = Header.decode(Header(9, Op.COMMIT, CommitSizes(2, 5, 3, 16).args).encode(), 9)
    assert CommitSizes.from_args(c.args, num_pages=64) == CommitSizes(2, 5, 3, 16)
    verify = Header.decode(Header(10, Op.FORWARD, ForwardSizes(2, 3, 4, True, 1, True).args).encode(), 10)
    assert ForwardSizes.from_args(verify.args, num_pages=10).commit_later
    with pytest.raises(ProtocolError, match="MOVE"):
        protocol.move_size((11,), num_pages=10)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.__setitem__(0, 123), "magic"),
    (lambda t: t.__setitem__(1, 99), "version"),
    (lambda t: t.__setitem__(2, 8), "message 8 arrived when 7"),
    (lambda t: t.__setitem__(3, 42), "unknown op code 42"),
])
def test_bad_headers_are_refused(edit, match):
    t = Header(7, Op.COMMIT, (1, 2, 3)).encode()
    edit(t)
    with pytest.raises(ProtocolError, match=match):
        Header.decode(t, 7)
    with pytest.raises(ProtocolError, match="int64"):
        Header.decode(t.int(), 7)


@pytest.mark.parametrize("args, match", [
    ((0, 3, 4, 0, 1), "out of range"),
    ((2, 3, 11, 0, 1), "page-table width 11"),
    ((2, 3, 4, 2, 1), "has_mask"),
    ((2, 3, 4, 0, 1, 2), "commit_later"),
    ((1 << 20, 1 << 10, 4, 0, 1), "out of range"),
    ((2, 3, 4, 0, 0), "coarse factor 0"),  # an old (version 1) header's missing field
    ((2, 3, 4, 0, 11), "coarse factor 11"),
    ((2, 3, 3, 0, 4), r"page-table width 3 is outside \[1, 2\]"),  # 10 pages make 2 coarse pages of 4
])
def test_forward_sizes_are_checked(args, match):
    with pytest.raises(ProtocolError, match=match):
        ForwardSizes.from_args(args, num_pages=10)


def test_payload_pack_unpack_and_page_check():
    ids, pos = torch.arange(6).view(2, 3), torch.arange(6).view(2, 3) + 10
    table, prefix = torch.tensor([[1, 2], [3, 10]], dtype=torch.int32), torch.tensor([4, 5], dtype=torch.int32)
    s = ForwardSizes(2, 3, 2, False)
    ints = protocol.pack([ids, pos, table, prefix], torch.device("cpu"))
    assert ints.numel() == s.num_ints
    out = protocol.unpack_forward(ints, s)
    for a, b in zip(out, (ids, pos, table, prefix)):
        assert torch.equal(a, b.to(a.dtype))
    protocol.check_pages(table, num_pages=10)  # 10 is the padding id
    with pytest.raises(ProtocolError, match="outside"):
        protocol.check_pages(table + 1, num_pages=10)
    c = CommitSizes(2, 4, 2)
    accept, rows = torch.zeros(2, 4, dtype=torch.long), torch.tensor([1, 2])
    back = protocol.unpack_commit(protocol.pack([table, prefix, accept, rows], torch.device("cpu")), c)
    assert torch.equal(back[0], table) and torch.equal(back[3], rows)


def test_layouts_that_do_not_split(target):
    cfg = ModelConfig.from_hf(target)
    Parallel(4, 3, 2).validate(cfg)
    with pytest.raises(ValueError, match="num_attention_heads=4 does not split evenly over tp=8"):
        Parallel(8, 0).validate(cfg)
    with pytest.raises(ValueError, match="n_routed_experts=6 does not split evenly over ep=4"):
        Parallel(4, 0, 4).validate(dataclasses.replace(cfg, n_routed_experts=6))
    with pytest.raises(ValueError, match="moe_intermediate_size=30 does not split evenly over tp/ep=4"):
        Parallel(4, 0).validate(dataclasses.replace(cfg, moe_intermediate_size=30))
    with pytest.raises(ValueError, match="ep=2 must divide tp=3"):
        Parallel(3, 0, 2)
    for kw, match in [(dict(tp=8), "num_attention_heads"), (dict(tp=2, ep=4), "ep=4 must divide tp=2"),
                      (dict(tp=0), "tp must be an integer"), (dict(tp=2, ep=True), "ep must be")]:
        with pytest.raises(ValueError, match=match):
            LLM(target, device="cpu", **kw)


def test_more_ranks_than_gpus_is_refused_before_spawning(target, monkeypatch):
    """Rank r runs on cuda:<base + r>: too few GPUs is a ValueError, not a follower that dies
    on 'invalid device ordinal' after the processes started."""
    from treeflash.engine.llm import start_tensor_parallel
    from treeflash.parallel import launch

    started = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(launch, "start_group", lambda spec: started.append(spec) or "ctx")
    for tp, base, match in [(4, 0, r"tp=4 from cuda:0 needs cuda:0..cuda:3, but 2 CUDA"),
                            (2, 1, r"tp=2 from cuda:1 needs cuda:1..cuda:2")]:
        with pytest.raises(ValueError, match=match):
            start_tensor_parallel(target, tp, 1, torch.device("cuda", base), torch.float32)
    assert not started
    assert start_tensor_parallel(target, 2, 1, torch.device("cuda", 0), torch.float32) == "ctx"


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "nan", "inf", "1e30"])
def test_bad_dist_timeout_is_refused_before_spawning(target, monkeypatch, raw):
    from treeflash.parallel import launch

    monkeypatch.setenv("TREEFLASH_DIST_TIMEOUT", raw)
    monkeypatch.setattr(launch, "start_group", lambda spec: pytest.fail("a group was started"))
    with pytest.raises(ValueError, match=r"TREEFLASH_DIST_TIMEOUT must be a number of seconds in \(0, "):
        LLM(target, device="cpu", tp=2)
