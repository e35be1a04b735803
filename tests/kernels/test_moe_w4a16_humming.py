"""humming-kernels in the W4A16 MoE dispatch (`kernels/moe_w4a16/humming.py`, `dispatch.py`): which
rows go to humming and when a layer's copy is refused, the one rearrangement of our packed words
before humming's own repack (checked against compressed-tensors' unpacking), the pair alignment
humming's indexed GEMMs read (vLLM's moe_align_block_size contract), the load-time copy policy; on a
GPU with humming installed (benchmarks/gpu_w4a16.sh), its output against the float64 loop."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402

from treeflash.kernels.int4 import Int4Weight  # noqa: E402
from treeflash.kernels.moe_w4a16 import dispatch, humming, moe_experts_w4a16  # noqa: E402
from treeflash.kernels.testing import assert_close  # noqa: E402

pytestmark = pytest.mark.slow

GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()


def _int4(e, n, k, group, g, device="cpu") -> Int4Weight:
    packed = torch.randint(-2**31, 2**31, (e, n, k // 8), generator=g, dtype=torch.int64).to(torch.int32)
    scale = ((torch.rand(e, n, k // group, generator=g) + 0.5) * 0.25 * k ** -0.5).to(torch.bfloat16)
    return Int4Weight(packed.to(device), scale.to(device), group)


@pytest.fixture
def no_pins(monkeypatch):
    for name in ("TREEFLASH_W4A16_IMPL", "TREEFLASH_W4A16_HUMMING", "TREEFLASH_W4A16_MMA"):
        monkeypatch.delenv(name, raising=False)


def test_dispatch_sends_humming_the_rows_it_measured_faster_at(no_pins, monkeypatch):
    """Up to 16 rows ours whatever the copy (the MMA kernel 1.1-3.4x faster than humming there,
    one H100 call); from 17 rows humming where the layer's copy takes the call, else the row's
    own kernel; a pin wins."""
    for rows in (1, 2, 4, 8, 9, 16):
        assert dispatch.impl(rows, True) == dispatch.impl(rows, False) == dispatch.MMA
    for rows in (17, 32, 64, 65, 512, 1024):
        assert dispatch.impl(rows, True) == dispatch.HUMMING
        assert dispatch.impl(rows, False) == dispatch.MMA
    monkeypatch.setenv("TREEFLASH_W4A16_IMPL", "portable")
    assert dispatch.impl(64, True) == dispatch.PORTABLE
    monkeypatch.setenv("TREEFLASH_W4A16_IMPL", "humming")
    assert dispatch.impl(1, False) == dispatch.HUMMING


class _Copy:
    """Stands in for a layer's HummingExperts where there is no GPU: records the calls it takes."""

    def __init__(self, refusal=None):
        self.refusal, self.calls = refusal, 0

    def refuses(self, x, expert_offset, num_experts):
        return self.refusal

    def __call__(self, x, topk_weights, topk_ids, shared=None, stats=None):
        self.calls += 1
        return torch.zeros_like(x)


def _layer(t, seed=0):
    """A small layer where the kernels run: the GPU when they are compiled (a compiled launch
    refuses CPU tensors), else the CPU under the interpreter."""
    g, dev = torch.Generator().manual_seed(seed), "cuda" if GPU else "cpu"
    e, hid, inter = 8, 64, 32
    x = torch.randn(t, hid, generator=g).to(dev)
    ids = torch.rand(t, e, generator=g).topk(2, dim=-1).indices.to(dev)
    w = torch.rand(t, 2, generator=g).to(dev)
    shapes = ((inter, hid), (inter, hid), (hid, inter))  # gate, up, down
    return x, w, ids, [_int4(e, n, k, 32, g, dev) for n, k in shapes]


def test_moe_call_runs_the_copy_only_where_the_table_and_the_copy_agree(no_pins):
    x, w, ids, wq = _layer(17)
    copy = _Copy()
    assert moe_experts_w4a16(x, w, ids, *wq, humming=copy).abs().sum() == 0 and copy.calls == 1
    refusing = _Copy("experts sharded across ranks")
    out = moe_experts_w4a16(x, w, ids, *wq, humming=refusing)  # ours (portable: fp32 x)
    assert refusing.calls == 0 and out.abs().sum() > 0
    with pytest.raises(ValueError, match="'humming' cannot take this call: experts sharded"):
        moe_experts_w4a16(x, w, ids, *wq, impl="humming", humming=refusing)
    with pytest.raises(ValueError, match="no humming copy"):
        moe_experts_w4a16(x, w, ids, *wq, impl="humming")
    x, w, ids, wq = _layer(2)
    out = moe_experts_w4a16(x, w, ids, *wq, humming=copy)  # 2 rows: ours
    assert copy.calls == 1 and out.abs().sum() > 0


def test_stack_gate_up_is_gate_then_up_as_compressed_tensors_unpacks_it():
    g = torch.Generator().manual_seed(1)
    wg, wu = _int4(3, 16, 64, 32, g), _int4(3, 16, 64, 32, g)
    w13 = humming.stack_gate_up(wg, wu)
    assert w13.shape == (3, 32, 64) and w13.group_size == 32
    q13 = unpack_from_int32(w13.packed, 4, torch.Size(w13.shape))
    want = torch.cat([unpack_from_int32(w.packed, 4, torch.Size(w.shape)) for w in (wg, wu)], dim=1)
    assert torch.equal(q13, want)
    assert torch.equal(w13.scale, torch.cat([wg.scale, wu.scale], dim=1))
    assert torch.equal(w13.dequantize(), torch.cat([wg.dequantize(), wu.dequantize()], dim=1))
    with pytest.raises(ValueError, match="alike"):
        humming.stack_gate_up(wg, _int4(3, 8, 64, 32, g))


@pytest.mark.parametrize("t,k,e,block", [(1, 8, 384, 8), (5, 2, 8, 16), (40, 4, 16, 8), (3, 2, 64, 64)])
def test_align_is_moe_align_block_size(t, k, e, block):
    """Blocks of one expert each, active blocks first (padded = their count x block), every pair
    exactly once in its expert's blocks in pair order, padding = A."""
    g = torch.Generator().manual_seed(t)
    ids = torch.rand(t, e, generator=g).topk(k, dim=-1).indices
    sorted_ids, blk_e, padded = humming.align(ids, e, block)
    a = t * k
    n_act = int(padded) // block
    assert int(padded) % block == 0 and bool((blk_e[:n_act] >= 0).all()) and bool((blk_e[n_act:] < 0).all())
    blocks = sorted_ids.view(-1, block)[:n_act]
    flat_ids = ids.reshape(-1)
    seen = []
    for b in range(n_act):
        real = blocks[b][blocks[b] < a]
        assert real.numel() and bool((flat_ids[real.long()] == blk_e[b]).all())
        seen += real.tolist()
    assert sorted(seen) == list(range(a))
    for expert in flat_ids.unique().tolist():
        mine = [p for p in seen if flat_ids[p] == expert]
        assert mine == sorted(mine)


def test_copy_policy(no_pins, monkeypatch):
    """All INT4 layers get a copy or none: none without CUDA (auto: the reason; =1: an error naming
    it), none at =0, and a copy is wanted at all only while the table names humming for some rows."""
    g = torch.Generator().manual_seed(2)
    layers = [(_int4(2, 32, 64, 32, g), _int4(2, 32, 64, 32, g), _int4(2, 64, 32, 32, g)) for _ in range(2)]
    assert humming.wanted()
    assert humming.refusal(layers) == "experts not on a CUDA device"
    assert humming.refusal([]) == "no INT4 expert layers"
    monkeypatch.setenv("TREEFLASH_W4A16_HUMMING", "1")
    with pytest.raises(RuntimeError, match="TREEFLASH_W4A16_HUMMING=1: humming-kernels unusable: experts not on"):
        humming.refusal(layers)
    monkeypatch.setenv("TREEFLASH_W4A16_HUMMING", "0")
    assert not humming.wanted() and humming.refusal(layers).startswith("not wanted")
    monkeypatch.delenv("TREEFLASH_W4A16_HUMMING")
    monkeypatch.setattr(dispatch, "RULES", tuple(dispatch.Rule(r.max_rows, r.impl, r.tiles) for r in dispatch.RULES))
    assert not humming.wanted()


def test_copies_fit_with_the_reserve_left(monkeypatch):
    """Kimi K2.6 at TP8 on an H200 after loading (~56 GiB free of 131): 60 layers' copies (66 GiB)
    do not fit, 8 layers' do."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (56 * 2**30, 131 * 2**30))
    layer = 384 * 3096576
    assert not humming.fits(61 * layer, torch.device("cuda"))
    assert humming.fits(9 * layer, torch.device("cuda"))


@pytest.mark.skipif(not GPU or humming.import_error() is not None,
                    reason="humming-kernels runs on a CUDA GPU with the package installed (benchmarks/gpu_w4a16.sh)")
@pytest.mark.parametrize("t", [1, 16, 200])
def test_humming_matches_the_reference_on_gpu(t, no_pins):
    """The layer's copy through the dispatch against the torch reference (float32 on the same INT4
    weights), shared expert included; the dispatch picks it at 16+ rows."""
    from treeflash.kernels import reference

    g = torch.Generator().manual_seed(t)
    e, hid, inter, k = 16, 512, 128, 4
    wq = [_int4(e, inter, hid, 32, g, "cuda"), _int4(e, inter, hid, 32, g, "cuda"), _int4(e, hid, inter, 32, g, "cuda")]
    shared = [(torch.randn(*s, generator=g) * s[1] ** -0.5).to("cuda", torch.bfloat16)
              for s in ((inter, hid), (inter, hid), (hid, inter))]
    x = torch.randn(t, hid, generator=g).to("cuda", torch.bfloat16)
    ids = torch.rand(t, e, generator=g).topk(k, dim=-1).indices.cuda()
    w = torch.rand(t, k, generator=g).cuda()
    assert humming.refusal([tuple(wq)]) is None
    copy = humming.HummingExperts(*wq, torch.bfloat16)
    want = reference.moe_experts(x.float(), w, ids, *wq, shared=[s.float() for s in shared])
    got = moe_experts_w4a16(x, w, ids, *wq, shared=shared, impl="humming", humming=copy)
    assert_close(got, want.to(torch.bfloat16), torch.bfloat16, "humming")
    auto = moe_experts_w4a16(x, w, ids, *wq, shared=shared, humming=copy)
    assert_close(auto, want.to(torch.bfloat16), torch.bfloat16, "dispatch")
