"""The INT4 layout against the library that defines it (compressed-tensors' pack-quantized)."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from treeflash.kernels.int4 import Int4Weight, pack_int4, quantize_int4, unpack_int4


@pytest.mark.parametrize("shape", [(3, 8), (5, 64), (2, 7, 96)])
def test_pack_matches_compressed_tensors(shape):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    ours = pack_int4(q)
    if q.dim() == 2:
        assert torch.equal(ours, pack_to_int32(q, 4))
    else:  # the library packs 3-D stacks slice by slice
        assert torch.equal(ours, torch.stack([pack_to_int32(x, 4) for x in q]))
    assert torch.equal(unpack_int4(ours), q)
    flat = ours.reshape(-1, ours.shape[-1])
    lib = unpack_from_int32(flat, 4, torch.Size((flat.shape[0], q.shape[-1])))
    assert torch.equal(unpack_int4(flat), lib)


def test_extremes_and_sign_bit():
    q = torch.tensor([[-8, 7, -1, 0, 1, -7, 7, 7]], dtype=torch.int8)  # top nibble 15: word < 0
    p = pack_int4(q)
    assert int(p[0, 0]) < 0 and torch.equal(p, pack_to_int32(q, 4))
    assert torch.equal(unpack_int4(p), q)


def test_quantize_roundtrip_and_dequantize():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 16, 64, generator=g)
    qw = quantize_int4(w, 32)
    assert qw.shape == (2, 16, 64) and qw.scale.shape == (2, 16, 2) and qw.scale.dtype == torch.bfloat16
    deq = qw.dequantize()
    # each value within half a step of its group's scale
    step = qw.scale.float().repeat_interleave(32, -1)
    assert ((deq - w).abs() <= step * 0.5 + 1e-6).all()
    assert qw.nbytes == 2 * 16 * 8 * 4 + 2 * 16 * 2 * 2
    assert torch.equal(qw[1].packed, qw.packed[1])


def test_bad_inputs_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(2, 6, dtype=torch.int8))
    with pytest.raises(ValueError, match="-8..7"):
        pack_int4(torch.full((1, 8), 9, dtype=torch.int8))
    with pytest.raises(ValueError, match="int32"):
        Int4Weight(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 1), 32)
    with pytest.raises(ValueError, match="does not match"):
        Int4Weight(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 2), 32)


@pytest.mark.parametrize("tokens", [1, 6])  # per-pair gather (T*K <= E) and the dense loop
def test_reference_moe_on_int4_equals_dequantized(tokens):
    from treeflash.kernels import reference

    g = torch.Generator().manual_seed(2)
    e, inter, hid, k = 8, 32, 64, 2
    wq = [quantize_int4(torch.randn(e, inter, hid, generator=g)),
          quantize_int4(torch.randn(e, inter, hid, generator=g)),
          quantize_int4(torch.randn(e, hid, inter, generator=g))]
    x = torch.randn(tokens, hid, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g)
    got = reference.moe_experts(x, w, ids, *wq)
    want = reference.moe_experts(x, w, ids, *(q.dequantize() for q in wq))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
