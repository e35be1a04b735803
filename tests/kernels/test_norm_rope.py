"""Fused RMSNorm and rotary kernels: Triton (interpreter on CPU) against the torch twins."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from treeflash.kernels import reference, rms_norm, rope  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: to rounding. fp16: the kernels round where torch rounds, so all but rare
    elements are equal bits (a variance summed in another order can move a rounding tie,
    by one unit, which the weight's product can carry to two). bf16: the interpreter
    truncates float32 -> bfloat16 where a GPU rounds, so up to a unit per rounding."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    units = 2.01
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((got.float() - want.float()).abs() <= ulp * units).all()
    if dtype == torch.float16:
        assert (got == want).float().mean() > 0.98


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [48, 256, 7168])
def test_rms_norm_matches_torch(dtype, d):
    g = torch.Generator().manual_seed(d)
    wide = (torch.randn(3, 5, d + 16, generator=g) * 3).to(dtype)
    x = wide[..., 8:8 + d]  # rows strided inside a wider tensor, as MLA's c_kv slice
    w = (1 + torch.randn(d, generator=g) * 0.1).to(dtype)
    _close(rms_norm(x, w, 1e-6, impl="triton"), reference.rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual(dtype):
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(2, 7, 96, generator=g).to(dtype) for _ in range(2))
    w = (1 + torch.randn(96, generator=g) * 0.1).to(dtype)
    got, got_sum = rms_norm(x, w, 1e-5, residual=res, impl="triton")
    want, want_sum = reference.rms_norm(x, w, 1e-5, residual=res)
    if dtype == torch.bfloat16:  # the interpreter truncates the rounded add: norm our sum
        _close(got_sum, want_sum, dtype)
        want = reference.rms_norm(got_sum, w, 1e-5)
    else:
        assert torch.equal(got_sum, want_sum)  # one rounded add, both ways
    _close(got, want, dtype)


def test_rms_norm_in_place_and_weight_promotion():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 40, generator=g).to(torch.bfloat16)
    w32 = 1 + torch.randn(40, generator=g) * 0.1  # float32 weight: the result is float32
    want = reference.rms_norm(x, w32, 1e-6)
    assert rms_norm(x, w32, 1e-6, impl="triton").dtype == torch.float32
    # the normalised row is rounded to bfloat16 before the float32 weight: bf16 units apply
    torch.testing.assert_close(rms_norm(x, w32, 1e-6, impl="triton"), want, atol=0,
                               rtol=2 * torch.finfo(torch.bfloat16).eps)
    y = x.clone()
    w = w32.to(torch.bfloat16)
    rms_norm(y, w, 1e-6, out=y, impl="triton")  # aliasing: each row is read before it is written
    _close(y, reference.rms_norm(x, w, 1e-6), torch.bfloat16)


def test_rms_norm_rejects_an_out_that_would_be_a_copy():
    x = torch.randn(3, 4, 8)
    out = torch.empty(4, 3, 8).transpose(0, 1)  # leading dims do not flatten
    with pytest.raises(ValueError, match="without a copy"):
        rms_norm(x, torch.ones(8), 1e-6, out=out, impl="triton")


def _rope_close(got, want, x, cos, sin, interleave, dtype, units=3.01):
    """bf16 under the interpreter: each truncated product may be a unit off, and x1 c - x2 s
    can cancel, so the bound is in units of the terms, not of the result (3: two products
    and the sum; a fused norm before adds the two of its own roundings)."""
    if dtype != torch.bfloat16:
        _close(got, want, dtype)
        return
    xf, c, s = x.float().abs(), cos.float().abs(), sin.float().abs()
    if xf.dim() == c.dim() + 1:
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleave else xf.chunk(2, -1)
    terms = torch.cat([x1 * c + x2 * s, x2 * c + x1 * s], -1)
    assert ((got.float() - want.float()).abs() <= units * torch.finfo(dtype).eps * terms).all()


def _tables(lead, half, dtype, g):
    pos = torch.randint(0, 5000, lead, generator=g).float()
    freqs = pos[..., None] * (1.0 / 10000 ** (torch.arange(half) / half))
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("heads", [None, 1, 5])
def test_rope_matches_torch(dtype, interleave, heads):
    g = torch.Generator().manual_seed(7)
    lead, dim = (2, 9), 64
    shape = lead + ((heads,) if heads else ()) + (dim,)
    wide = torch.randn(*shape[:-1], dim + 32, generator=g).to(dtype)
    x = wide[..., 32:]  # q_pe sits after q_nope in every head
    cos, sin = _tables(lead, dim // 2, dtype, g)
    _rope_close(rope(x, cos, sin, interleave, impl="triton"), reference.rope(x, cos, sin, interleave),
                x, cos, sin, interleave, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_with_norm_and_in_place(dtype):
    """Qwen3's q_norm then rotary in one launch; then in place (MLA's k_pe in the latent row)."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 6, 4, 48, generator=g).to(dtype)
    w = (1 + torch.randn(48, generator=g) * 0.1).to(dtype)
    cos, sin = _tables((3, 6), 24, dtype, g)
    got = rope(x, cos, sin, False, norm_weight=w, eps=1e-6, impl="triton")
    normed = reference.rms_norm(x, w, 1e-6)
    _rope_close(got, reference.rope(normed, cos, sin, False), normed, cos, sin, False, dtype, units=5.01)
    row = torch.randn(3, 6, 80, generator=g).to(dtype)
    want = reference.rope(row[..., 32:], cos, sin, True)
    before = row[..., 32:].clone()
    rope(row[..., 32:], cos, sin, True, out=row[..., 32:], impl="triton")
    _rope_close(row[..., 32:], want, before, cos, sin, True, dtype)


def test_rope_rejects_tables_that_do_not_cover_x():
    x = torch.randn(2, 5, 3, 16)
    cos = torch.randn(5, 8)
    with pytest.raises(ValueError, match="leading dims"):
        rope(x, cos, cos, False, impl="triton")
