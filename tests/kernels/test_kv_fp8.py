"""Writing fp8_e4m3 rows (`kvcache.format`): the Triton quantiser (interpreter on CPU) against
torch's float8_e4m3fn cast and the torch reference, through kv_write, mla_latent_prep, the
commit of accepted rows, defragmentation and the coarse view, over poisoned paged caches."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from treeflash import kernels  # noqa: E402
from treeflash.kernels import kv_commit, kv_write, reference  # noqa: E402
from treeflash.kernels.kv_ops import _bf16_code, _e4m3_code  # noqa: E402
from treeflash.kernels.testing import build_page_table, random_paged_kv  # noqa: E402
from treeflash.kvcache import KVPool  # noqa: E402
from treeflash.kvcache.coarse import coarse_kv  # noqa: E402
from treeflash.kvcache.defrag import compact, move_pages  # noqa: E402
from treeflash.kvcache.format import dequantize_rows, e4m3_codes, fp8_row_bytes, row_parts  # noqa: E402


@triton.jit
def _encode_kernel(X, E, B, N: tl.constexpr):
    o = tl.arange(0, N)
    x = tl.load(X + o)
    tl.store(E + o, _e4m3_code(tl.minimum(tl.maximum(x, -448.0), 448.0)).to(tl.uint8))
    tl.store(B + o, _bf16_code(x).to(tl.int16))


def test_encoders_equal_torch_casts():
    """Every e4m3 value, every midpoint between two (ties to even), subnormals, the saturation
    at +-448 and random magnitudes over 24 binades: the Triton encoder's bytes are torch's
    (`.clamp(-448, 448).to(torch.float8_e4m3fn)`); the bf16 encoder's bits are `.to(bfloat16)`'s
    (the interpreter's own casts misround both: fp8 where the mantissa carries, bf16 truncates)."""
    n = 1 << 14
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-14, 10, (n,), generator=g).float())
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    every = every[every.isfinite()].unique()
    mids = (every[1:] + every[:-1]) / 2
    special = torch.cat([every, mids, -mids, torch.tensor([0.0, -0.0, 500.0, -1e6, 1e-30, 447.99, 448.01])])
    x[:special.numel()] = special
    codes, bits = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.int16)
    _encode_kernel[(1,)](x, codes, bits, n)
    assert torch.equal(codes, e4m3_codes(x))
    assert torch.equal(bits, x.to(torch.bfloat16).view(torch.int16))


GEOMETRIES = [(96, 64, torch.float32), (576, 512, torch.bfloat16), (40, 32, torch.float16),
              (208, 192, torch.float32)]  # (D, v_dim, latents' dtype): one group, four, one, two (half full)


@pytest.mark.slow
@pytest.mark.parametrize("d,v,dtype", GEOMETRIES)
@pytest.mark.parametrize("page_size,layout", [(1, "scattered"), (16, "contiguous")])
def test_kv_write_fp8_equals_the_reference(d, v, dtype, page_size, layout):
    """The new rows' bytes (codes, scales, the zero gaps, bf16 k_pe) equal the torch quantiser's;
    every other slot (0xFF poison) is untouched; an all-zero row stays finite."""
    g = torch.Generator().manual_seed(d)
    start = [5, 0, 31]
    n = 7
    kv = random_paged_kv([s + n for s in start], d, page_size, torch.uint8, layout, generator=g, v_dim=v)
    lat = (torch.randn(3, n, d, generator=g) * 4).to(dtype)
    lat[1, 2] = 0
    start_t = torch.tensor(start, dtype=torch.int32)
    ours, ref = kv.kv_cache.clone(), kv.kv_cache.clone()
    kv_write(ours, kv.page_table, start_t, lat, impl="triton", v_dim=v)
    reference.kv_write(ref, kv.page_table, start_t, lat, v_dim=v)
    assert torch.equal(ours, ref)
    changed = (ours != kv.kv_cache).any(-1)
    assert changed.sum() <= 3 * n  # only the new rows' slots
    pos = torch.tensor(start)[:, None] + torch.arange(n)
    pages = kv.page_table.long().gather(1, pos // page_size)
    rows = ours[pages, pos % page_size]  # [B, N, row_bytes]
    back = dequantize_rows(rows, d, v, torch.float64)
    assert torch.isfinite(back).all() and (back[1, 2] == 0).all()


def test_kv_write_fp8_refusals():
    kv = random_paged_kv([9], 96, 4, torch.uint8, v_dim=64)
    lat = torch.randn(1, 2, 96)
    start = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs v_dim"):
        kv_write(kv.kv_cache, kv.page_table, start, lat, impl="triton")
    with pytest.raises(ValueError, match="rows of 144 bytes"):
        kv_write(kv.kv_cache[..., :128], kv.page_table, start, lat, impl="triton", v_dim=64)
    with pytest.raises(ValueError, match="needs v_dim"):
        reference.kv_write(kv.kv_cache, kv.page_table, start, lat)


R, HALF, QL = 64, 16, 24


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [False, True])
def test_mla_prep_fp8_stores_what_kv_write_stores(dtype, interleave):
    """The fused prep into an fp8 cache writes the bytes kv_write writes for the row the separate
    launches compute (norm, rotation: the same rounding), and decodes within one e4m3 step of
    the torch reference's (float32: the same codes but where rsqrt's last bit moves one; bf16: the
    interpreter truncates its products where torch rounds, as in test_mla_prep)."""
    g = torch.Generator().manual_seed(int(interleave))
    b, n = 2, 3
    a = torch.randn(b, n, QL + R + 2 * HALF, generator=g).to(dtype) * 3
    qa, latents = a[..., :QL], a[..., QL:]
    start = torch.tensor([5, 0], dtype=torch.int32)
    table = torch.randperm(16, generator=g).to(torch.int32).view(b, 8)
    cache = torch.full((16, 4, fp8_row_bytes(R + 2 * HALF, R)), 0xFF, dtype=torch.uint8)
    ang = torch.rand(b, n, HALF, generator=g) * 6
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    wkv = (1 + 0.2 * torch.randn(R, generator=g)).to(dtype)
    wq = (1 + 0.2 * torch.randn(QL, generator=g)).to(dtype)
    fused, separate, ref = cache.clone(), cache.clone(), cache.clone()
    got_q = kernels.mla_latent_prep(latents, fused, table, start, wkv, 1e-6, cos, sin, interleave, qa=qa,
                                    q_weight=wq, q_eps=1e-5, impl="triton")
    lat = latents.clone()
    kernels.rms_norm(lat[..., :R], wkv, 1e-6, out=lat[..., :R], impl="triton")
    kernels.rope(lat[..., R:], cos, sin, interleave, out=lat[..., R:], impl="triton")
    kv_write(separate, table, start, lat, impl="triton", v_dim=R)
    assert torch.equal(fused, separate)
    assert torch.equal(got_q, kernels.rms_norm(qa, wq, 1e-5, impl="triton"))
    kernels.mla_latent_prep(latents, ref, table, start, wkv, 1e-6, cos, sin, interleave, impl="torch")
    written = (fused != cache).any(-1)
    assert torch.equal(written, (ref != cache).any(-1)) and written.sum() == b * n
    ours, theirs = row_parts(fused[written], R + 2 * HALF, R), row_parts(ref[written], R + 2 * HALF, R)
    steps = (ours[0].view(torch.uint8).int() - theirs[0].view(torch.uint8).int()).abs()  # same sign
    assert steps.max() <= 1 and (steps > 0).float().mean() < 0.05
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # as test_mla_prep's reference comparison
    torch.testing.assert_close(ours[1], theirs[1], rtol=tol, atol=0)
    torch.testing.assert_close(ours[2].float(), theirs[2].float(), rtol=max(tol, 2 ** -8), atol=tol)


def test_commit_moves_fp8_rows_as_bytes():
    """kv_commit over a 3-layer fp8 pool: the accepted rows' bytes move, as the reference moves them."""
    g = torch.Generator().manual_seed(3)
    prefix, n = [9, 0, 22], 11
    kvs = [random_paged_kv([p + n for p in prefix], 96, 4, torch.uint8, "scattered",
                           generator=torch.Generator().manual_seed(7), v_dim=64) for _ in range(3)]
    pool = torch.stack([k.kv_cache for k in kvs])
    pool[1:] = torch.where(pool[1:] == 0xFF, pool[1:], torch.randint(0, 255, pool[1:].shape, generator=g,
                                                                      dtype=torch.uint8))
    table = kvs[0].page_table
    accept = torch.tensor([[0, 2, 3, 7, 10], [0, 1, 2, 3, 4], [0, 5, 6, 0, 0]])
    num = torch.tensor([5, 3, 3])
    prefix_t = torch.tensor(prefix, dtype=torch.int32)
    ours, ref = pool.clone(), pool.clone()
    kv_commit(ours, table, prefix_t, accept, num, impl="triton")
    reference.kv_commit(ref, table, prefix_t, accept, num)
    assert torch.equal(ours, ref) and not torch.equal(ours, pool)


def test_defrag_and_coarse_view_of_an_fp8_pool():
    """Pages move across all layers byte for byte; the compacted page-1 request read through its
    64-row coarse view is the same rows."""
    pool = KVPool(2, 256, 1, 96, torch.bfloat16, "cpu", scattered=True, kv_cache_dtype="fp8", v_dim=64)
    assert pool.kv.shape == (2, 256, 1, 144)
    pages = pool.allocator.allocate(100)
    g = torch.Generator().manual_seed(5)
    pool.kv[:, pages] = pool.format.encode(torch.randn(2, 100, 1, 96, generator=g))
    before = pool.kv[:, pages].clone()
    src, dst = pages[:3], [p for p in range(256) if p not in pages][:3]
    kv = pool.kv.clone()
    move_pages(kv, src, dst)
    assert torch.equal(kv[:, dst], pool.kv[:, src])
    compact(pool, [pages])
    assert torch.equal(pool.kv[:, pages], before) and pages == list(range(100))
    view = coarse_kv(pool.kv, 64)  # [2, 4, 64, 144]
    assert view.shape == (2, 4, 64, 144) and torch.equal(view[:, 0], before[:, :64, 0])


def test_page_table_padding_is_never_written():
    """A request's table padded far out of range: kv_write touches only its own rows."""
    cache = torch.full((6, 4, 144), 0xFF, dtype=torch.uint8)
    table = build_page_table([[2, 5]])
    kv_write(cache, table, torch.tensor([6], dtype=torch.int32), torch.randn(1, 2, 96), impl="triton", v_dim=64)
    assert (cache != 0xFF).any(-1).sum() == 2
