"""kernels.mla_latent_prep (MLA's kv norm + k_pe rotation + cache store + q_a norm in one launch):
the Triton kernel (interpreter) against the separate launches it replaces (bit for bit: the
same rounding) and against the torch reference, through the views MLA passes (latents and q_a
as column slices of the fused a-projection's output), over a shuffled paged cache whose other
slots stay NaN."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from treeflash import kernels  # noqa: E402

R, HALF, QL = 40, 4, 24  # c_kv, half of k_pe, q_lora (not powers of two)


def _case(dtype, cache_dtype, b=2, n=3, page_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(b, n, QL + R + 2 * HALF, generator=g).to(dtype) * 3  # [q_a | c_kv | k_pe]
    qa, latents = a[..., :QL], a[..., QL:]
    start = torch.tensor([5, 0, 9][:b], dtype=torch.int32)
    pages = 8
    table = torch.randperm(pages * b, generator=g).to(torch.int32).view(b, pages)
    cache = torch.full((pages * b, page_size, R + 2 * HALF), float("nan"), dtype=cache_dtype)
    ang = torch.rand(b, n, HALF, generator=g) * 6
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    wkv = (1 + 0.2 * torch.randn(R, generator=g)).to(dtype)
    wq = (1 + 0.2 * torch.randn(QL, generator=g)).to(dtype)
    return qa, latents, start, table, cache, cos, sin, wkv, wq


def _separate(qa, latents, start, table, cache, cos, sin, wkv, wq, interleave):
    """What MLA ran before: two norms, a rotation, a store (each one Triton launch)."""
    lat = latents.clone()
    kernels.rms_norm(lat[..., :R], wkv, 1e-6, out=lat[..., :R], impl="triton")
    kernels.rope(lat[..., R:], cos, sin, interleave, out=lat[..., R:], impl="triton")
    kernels.kv_write(cache, table, start, lat, impl="triton")
    return kernels.rms_norm(qa, wq, 1e-5, impl="triton")


@pytest.mark.slow
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("interleave", [False, True])
def test_prep_equals_the_separate_launches(dtype, cache_dtype, interleave):
    qa, latents, start, table, cache, cos, sin, wkv, wq = _case(dtype, cache_dtype, seed=int(interleave))
    before = latents.clone()
    want_cache = cache.clone()
    want_q = _separate(qa, latents, start, table, want_cache, cos, sin, wkv, wq, interleave)
    got_q = kernels.mla_latent_prep(latents, cache, table, start, wkv, 1e-6, cos, sin, interleave,
                                    qa=qa, q_weight=wq, q_eps=1e-5, impl="triton")
    assert torch.equal(latents, before)  # read only
    assert torch.equal(got_q, want_q)
    written = ~torch.isnan(want_cache)
    assert written.sum() == 2 * 3 * (R + 2 * HALF)  # only the new rows' slots
    assert torch.equal(torch.isnan(cache), ~written)
    assert torch.equal(cache[written], want_cache[written])
    # and against the torch reference (its own rounding order: half types within an ulp or two)
    ref_cache = torch.full_like(cache, float("nan"))
    ref_q = kernels.mla_latent_prep(latents, ref_cache, table, start, wkv, 1e-6, cos, sin, interleave,
                                    qa=qa, q_weight=wq, q_eps=1e-5, impl="torch")
    tol = 1e-6 if cache_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cache[written].float(), ref_cache[written].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_q.float(), ref_q.float(), rtol=tol, atol=tol)


def test_prep_without_q_and_into_a_given_out():
    qa, latents, start, table, cache, cos, sin, wkv, wq = _case(torch.float32, torch.float32, b=1, n=1)
    want = cache.clone()
    _separate(qa, latents, start[:1], table, want, cos, sin, wkv, wq, False)
    assert kernels.mla_latent_prep(latents, cache, table, start[:1], wkv, 1e-6, cos, sin, False,
                                   impl="triton") is None
    assert torch.equal(torch.isnan(cache), torch.isnan(want))
    assert torch.equal(cache[~torch.isnan(cache)], want[~torch.isnan(want)])
    out = torch.full((1, 1, 2 * QL), float("nan"))[..., :QL]
    got = kernels.mla_latent_prep(latents, cache, table, start[:1], wkv, 1e-6, cos, sin, False,
                                  qa=qa, q_weight=wq, q_eps=1e-5, qa_out=out, impl="triton")
    assert got is out and torch.equal(out, kernels.rms_norm(qa, wq, 1e-5, impl="triton"))


def test_prep_rejects_bad_arguments():
    qa, latents, start, table, cache, cos, sin, wkv, wq = _case(torch.float32, torch.float32)
    call = kernels.mla_latent_prep
    with pytest.raises(ValueError, match="cos / sin"):
        call(latents, cache, table, start, wkv, 1e-6, cos[:, :1], sin[:, :1], False, impl="triton")
    with pytest.raises(ValueError, match="kv_weight"):
        call(latents, cache, table, start, wkv.double(), 1e-6, cos, sin, False, impl="triton")
    with pytest.raises(ValueError, match="start_lens"):
        call(latents, cache, table, start.long(), wkv, 1e-6, cos, sin, False, impl="triton")
    with pytest.raises(ValueError, match="q_weight"):
        call(latents, cache, table, start, wkv, 1e-6, cos, sin, False, qa=qa, impl="triton")
    with pytest.raises(ValueError, match="kv_cache"):
        call(latents, cache[..., :R], table, start, wkv, 1e-6, cos, sin, False, impl="triton")
