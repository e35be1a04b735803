"""How many launches a layer of decode context parallelism adds besides the verify kernel, counted
with torch's profiler on CPU (`MLA._attend_dcp`, after the first layer has built the forward's
plans): each Triton launch (the merge, a settle's kv_commit) stands as one marked range, the
collectives as theirs, and every other op that writes memory counts as one launch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import treeflash.kernels as kernels
from treeflash.bench.kernel_dcp import SCALE, RankShape, rank_layer
from treeflash.kernels import dcp_merge, kv_ops, reference
from treeflash.models import dcp
from treeflash.models.mla import MLA

# leaf ops that move no data (views, allocations, a dtype cast to the same dtype)
NO_DATA = {"aten::as_strided", "aten::empty", "aten::empty_strided", "aten::view", "aten::_unsafe_view",
           "aten::to", "aten::lift_fresh", "aten::detach", "aten::alias", "aten::_reshape_alias",
           "aten::resolve_conj", "aten::resolve_neg"}


@pytest.fixture
def marked(monkeypatch):
    """The verify kernel, the merge, kv_commit and the collectives as marked ranges (torch inside)."""
    verify = kernels.mla_verify_attention

    def mark(name, fn):
        def wrapped(*a, **kw):
            with record_function(name):
                return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(kernels, "mla_verify_attention",
                        mark("verify", lambda *a, impl=None, **kw: verify(*a, impl="torch", **kw)))
    monkeypatch.setattr(dcp_merge, "merge_packed_triton",
                        mark("launch:merge", lambda p, v: dcp.merge_torch(*dcp.unpack(p, v))))
    monkeypatch.setattr(kv_ops, "kv_commit_triton", mark("launch:kv_commit", reference.kv_commit))

    def all_gather(flat, q, group):  # every rank's queries: this rank's again
        flat.copy_(q.expand(flat.shape[0] // q.shape[0], *q.shape).reshape(flat.shape))

    monkeypatch.setattr(torch.distributed, "all_gather_single", mark("collective:all_gather", all_gather),
                        raising=False)
    monkeypatch.setattr(torch.distributed, "all_to_all_single",
                        mark("collective:all_to_all", lambda recv, send, group: recv.copy_(send)))


def launches(fn) -> tuple[list[str], int]:
    """(the marked ranges fn ran, the other ops that write memory) in one call of fn."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.events()
    ranges = [e for e in events if e.name.split(":")[0] in ("verify", "launch", "collective")]

    def inside(e) -> bool:
        return any(r.time_range.start <= e.time_range.start and e.time_range.end <= r.time_range.end
                   for r in ranges if r is not e)

    other = [e.name for e in events if e not in ranges and not e.cpu_children and e.name.startswith("aten::")
             and e.name not in NO_DATA and not inside(e)]
    return sorted(r.name for r in ranges), len(other)


@pytest.mark.parametrize("group, rows, want_ranges, want_other", [
    # a real group: plain decode's heads land as a view, its row needs no settle: the pack's cat (1) + merge
    ("real", 1, ["collective:all_gather", "collective:all_to_all", "launch:merge", "verify"], 1),
    # a tree: + the heads side by side and the send buffer's permute (3)
    ("real", 3, ["collective:all_gather", "collective:all_to_all", "launch:merge", "verify"], 3),
    # modelled (one process): the heads' copy stands where the all-gather lands; nothing for the all-to-all
    ("modelled", 1, ["launch:merge", "verify"], 2),
    ("modelled", 3, ["launch:merge", "verify"], 3),
])
def test_a_dcp_layer_adds_two_to_four_launches(marked, group, rows, want_ranges, want_other):
    call, inp = rank_layer(RankShape.of(1024, 4, 2, rows), 2, "cpu", torch.bfloat16, impl="triton")
    if group == "real":
        layer = SimpleNamespace(parallel=SimpleNamespace(dcp_size=4, dcp_rank=0, dcp_group=object()),
                                cfg=SimpleNamespace(softmax_scale=SCALE, kv_lora_rank=512))
        kv = inp["kv"]
        call = lambda i: MLA._attend_dcp(layer, inp["q"], kv[i % 2], inp["local"], inp["shared"])  # noqa: E731
    first = call(0)  # the first layer builds the forward's plans
    ranges, other = launches(lambda: call(1))
    assert ranges == want_ranges and other == want_other
    torch.testing.assert_close(call(0), first)  # (the collectives' stand-ins give the modelled rank's result)
