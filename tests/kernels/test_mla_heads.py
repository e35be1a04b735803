"""kernels.head_matmul (MLA's per-head absorb / expand products): the Triton kernel (interpreter)
against a float64 einsum, through the strided views MLA passes (q_nope a slice of q, the output a
slice of q_abs, W_UV transposed), and its argument checks."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from treeflash import kernels  # noqa: E402

TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # max |err| / max |ref|


def _rel(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 70])  # decode, a small tree, more than one 64-row tile
def test_absorb_into_a_slice_of_q_abs(dtype, m):
    """q_abs[..., :r] = q_nope x W_UK with q_nope a column slice of q and the output a column
    slice of q_abs: the rope columns after it stay untouched (NaN before, NaN after)."""
    g = torch.Generator().manual_seed(m)
    h, nope, rope, r = 3, 48, 8, 80  # r not a multiple of the 32 / 64-column tiles
    q = torch.randn(m, h, nope + rope, generator=g).to(dtype)
    w = (torch.randn(h, nope + 40, r, generator=g) / nope ** 0.5).to(dtype)  # kv_b's [H, nope + v, r]
    q_abs = torch.full((m, h, r + rope), float("nan"), dtype=dtype)
    out = kernels.head_matmul(q[..., :nope], w[:, :nope], out=q_abs[..., :r], impl="triton")
    assert out.data_ptr() == q_abs.data_ptr()
    ref = torch.einsum("mhk,hkn->mhn", q[..., :nope].double(), w[:, :nope].double())
    assert _rel(q_abs[..., :r], ref) < TOL[dtype]
    assert torch.isnan(q_abs[..., r:]).all()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 17])
def test_expand_with_w_uv_transposed(dtype, m):
    """out = out_lat x W_UV^T (b a transposed view: unit stride along K), a new contiguous
    [M, H, v] that reshapes to o_proj's input without a copy."""
    g = torch.Generator().manual_seed(100 + m)
    h, r, v = 4, 130, 24  # K past two 64-key steps, not a multiple
    out_lat = torch.randn(m, h, r, generator=g).to(dtype)
    w_uv = (torch.randn(h, v, r, generator=g) / r ** 0.5).to(dtype)
    out = kernels.head_matmul(out_lat, w_uv.transpose(1, 2), impl="triton")
    assert out.shape == (m, h, v) and out.is_contiguous() and out.dtype == dtype
    ref = torch.einsum("mhr,hvr->mhv", out_lat.double(), w_uv.double())
    assert _rel(out, ref) < TOL[dtype]
    twin = kernels.head_matmul(out_lat, w_uv.transpose(1, 2), impl="torch")
    assert _rel(twin, ref) < TOL[dtype]


def test_empty_and_bad_shapes():
    a, b = torch.randn(0, 2, 8), torch.randn(2, 8, 4)
    assert kernels.head_matmul(a, b, impl="triton").shape == (0, 2, 4)
    out = torch.full((3, 2, 4), 7.0)
    assert torch.equal(kernels.head_matmul(torch.randn(3, 2, 0), torch.randn(2, 0, 4), out=out, impl="triton"),
                       torch.zeros(3, 2, 4))
    with pytest.raises(ValueError, match="do not multiply"):
        kernels.head_matmul(torch.randn(3, 2, 8), torch.randn(3, 8, 4), impl="triton")
    with pytest.raises(ValueError, match="do not multiply"):
        kernels.head_matmul(torch.randn(3, 2, 8), torch.randn(2, 8, 4).double(), impl="triton")
    with pytest.raises(ValueError, match="must be"):
        kernels.head_matmul(torch.randn(3, 2, 8), torch.randn(2, 8, 4), out=torch.empty(3, 2, 5), impl="triton")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, interleave", [(1, True), (5, False), (70, True)])
def test_absorb_rotates_q_pe_in_the_same_launch(dtype, m, interleave):
    """rope=: q_pe (a column slice of q) rotated into q_abs' last columns by the absorb launch,
    bit for bit the rope kernel's result (the launch it replaces; test_norm_rope bounds that one
    against the reference), beside the same absorb; the torch path's twin is the reference's."""
    g = torch.Generator().manual_seed(7 + m)
    h, nope, rope, r = 3, 48, 8, 80
    q = torch.randn(m, h, nope + rope, generator=g).to(dtype)
    w = (torch.randn(h, nope, r, generator=g) / nope ** 0.5).to(dtype)
    ang = torch.rand(m, rope // 2, generator=g) * 6.0
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    q_abs = torch.full((m, h, r + rope), float("nan"), dtype=dtype)
    kernels.head_matmul(q[..., :nope], w, out=q_abs[..., :r], impl="triton",
                        rope=(q[..., nope:], cos, sin, interleave, q_abs[..., r:]))
    alone = torch.full((m, h, r + rope), float("nan"), dtype=dtype)
    kernels.head_matmul(q[..., :nope], w, out=alone[..., :r], impl="triton")
    assert torch.equal(q_abs[..., :r], alone[..., :r])
    want = kernels.rope(q[..., nope:], cos, sin, interleave, impl="triton")
    assert torch.equal(q_abs[..., r:], want)
    twin = torch.full_like(q_abs, float("nan"))
    kernels.head_matmul(q[..., :nope], w, out=twin[..., :r], impl="torch",
                        rope=(q[..., nope:], cos, sin, interleave, twin[..., r:]))
    assert torch.equal(twin[..., r:], kernels.rope(q[..., nope:], cos, sin, interleave, impl="torch"))
    assert _rel(twin[..., :r], alone[..., :r].double()) < TOL[dtype]


def test_absorb_rope_argument_errors():
    a, b = torch.randn(4, 2, 8).half(), torch.randn(2, 8, 16).half()
    x, c = torch.randn(4, 2, 6).half(), torch.randn(4, 3).half()

    def run(x=x, c=c, s=c, xo=None):
        kernels.head_matmul(a, b, impl="triton", rope=(x, c, s, False, torch.empty_like(x) if xo is None else xo))

    with pytest.raises(ValueError, match="must be \\[4, 2, even\\]"):
        run(x=torch.randn(4, 2, 5).half())
    with pytest.raises(ValueError, match="must be \\[4, 2, even\\]"):
        run(xo=torch.empty(4, 2, 4).half())
    with pytest.raises(ValueError, match="cos / sin"):
        run(c=torch.randn(4, 2).half())
    with pytest.raises(ValueError, match="16-bit"):
        run(x=x.float(), c=c.float(), s=c.float(), xo=torch.empty(4, 2, 6))
    with pytest.raises(ValueError, match="16-bit"):
        run(c=c.bfloat16())
    with pytest.raises(ValueError, match="unit stride"):
        run(x=torch.randn(4, 2, 12).half()[..., ::2])
