"""The fp8_e4m3 row format (`kvcache.format`): its bytes, its quantiser against torch's own
float8_e4m3fn cast, the names it accepts, and what a pool of it holds."""

from __future__ import annotations

import pytest
import torch

from treeflash.kvcache import KVPool
from treeflash.kvcache.format import (
    E4M3_MAX,
    GROUP,
    dequantize_rows,
    fp8_rope_offset,
    fp8_row_bytes,
    kv_format,
    parse_kv_cache_dtype,
    quantize_rows,
    row_parts,
)


def test_kimi_row_is_flashmla_656_bytes():
    """512 e4m3 codes, 4 fp32 scales, 64 bf16 rope values: 656 bytes, every part 16-aligned."""
    assert fp8_row_bytes(576, 512) == 656 and fp8_rope_offset(512) == 528
    assert fp8_row_bytes(576, 512) % 16 == 0 and 1152 / 656 > 1.7
    assert fp8_row_bytes(96, 64) == 144  # the shipped pair: 64 + 4 (+12) + 64
    assert fp8_row_bytes(40, 32) == 64


def test_bytes_are_codes_scales_rope_padding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=g) * 7
    rows = quantize_rows(x, 64)
    assert rows.shape == (3, 144) and rows.dtype == torch.uint8
    amax = x[:, :64].abs().amax(-1)
    scale = rows[:, 64:68].contiguous().view(torch.float32)[:, 0]
    assert torch.equal(scale, amax / E4M3_MAX)
    codes = (x[:, :64] / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(rows[:, :64], codes.view(torch.uint8))
    assert (rows[:, 68:80] == 0).all() and (rows[:, 144 - 0:] == 0).all()
    assert torch.equal(rows[:, 80:144].contiguous().view(torch.bfloat16), x[:, 64:].to(torch.bfloat16))


def test_per_128_groups_and_their_extremes():
    """Each 128 values have their own scale; the largest magnitude of a group codes to +-448;
    an all-zero group has scale 0 and codes 0 (decodes to 0, no NaN)."""
    x = torch.randn(2, 576)
    x[:, :512] *= torch.tensor([1e-3, 1.0, 30.0, 0.0]).repeat_interleave(GROUP)
    x[0, 5] = -7.0  # group 0's amax
    rows = quantize_rows(x, 512)
    codes, scales, rope = row_parts(rows, 576, 512)
    assert scales.shape == (2, 4)
    assert scales[0, 0] == 7.0 / E4M3_MAX and scales[0, 3] == 0
    assert codes[0, 5].float() == -E4M3_MAX
    assert (codes[:, 384:512].float() == 0).all()
    back = dequantize_rows(rows, 576, 512, torch.float64)
    assert torch.isfinite(back).all() and (back[:, 384:512] == 0).all()


def test_quantiser_round_trip_error():
    """Decoded c_kv within half an e4m3 step of each value (3 mantissa bits: |x| 2^-4), or of
    the subnormal step scale x 2^-9 near zero; k_pe within bf16 rounding."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 576, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 2)
    back = dequantize_rows(quantize_rows(x, 512), 576, 512, torch.float64)
    scale = x[:, :512].abs().reshape(64, 4, 128).amax(-1).double().repeat_interleave(128, -1) / E4M3_MAX
    err = (back[:, :512] - x[:, :512].double()).abs()
    bound = torch.maximum(x[:, :512].double().abs() * 2.0 ** -4, scale * 2.0 ** -10) * 1.0001
    assert (err <= bound).all()
    assert torch.allclose(back[:, 512:], x[:, 512:].double(), rtol=2 ** -8, atol=0)


def test_decode_in_float32_is_the_float64_product_rounded():
    x = torch.randn(8, 576) * 3
    rows = quantize_rows(x, 512)
    assert torch.equal(dequantize_rows(rows, 576, 512, torch.float32),
                       dequantize_rows(rows, 576, 512, torch.float64).float())


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "FP8_E4M3", "fp8_ds_mla", " fp8 "])
def test_fp8_spellings(name):
    assert parse_kv_cache_dtype(name, torch.bfloat16) == "fp8_e4m3"
    fmt = kv_format(name, 576, 512, torch.bfloat16)
    assert fmt.fp8 and fmt.row_bytes == 656 and fmt.storage_dtype == torch.uint8 and fmt.label == "fp8_e4m3"


def test_auto_and_the_model_dtype_name():
    for name, dtype in (("auto", torch.float32), ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                        ("float32", torch.float32)):
        fmt = kv_format(name, 576, 512, dtype)
        assert not fmt.fp8 and fmt.row_elems == 576 and fmt.storage_dtype == dtype
    assert kv_format("auto", 576, 512, torch.bfloat16).row_bytes == 1152


@pytest.mark.parametrize("name, why", [("fp8_e5m2", "fp8_e5m2 is not implemented"),
                                       ("float16", "the model's dtype is bfloat16"),
                                       ("int8", "unknown")])
def test_refusals_name_the_choices(name, why):
    with pytest.raises(ValueError, match=why) as e:
        parse_kv_cache_dtype(name, torch.bfloat16)
    assert "expected auto" in str(e.value) and "fp8_e4m3" in str(e.value)


def test_fp8_needs_a_quantised_part_of_whole_16s():
    with pytest.raises(ValueError, match="kv_lora_rank % 16"):
        kv_format("fp8", 44, 36, torch.bfloat16)


def test_pool_of_fp8_rows_and_its_capacity():
    """A Kimi-geometry pool (61 layers, D 576, v 512) in fp8 takes 656 of bf16's 1152 bytes a
    token a layer: the same memory holds 1.76x the tokens."""
    bf16 = KVPool(61, 4, 64, 576, torch.bfloat16, "cpu", v_dim=512)
    fp8 = KVPool(61, 4, 64, 576, torch.bfloat16, "cpu", kv_cache_dtype="fp8_e4m3", v_dim=512)
    assert fp8.kv.shape == (61, 4, 64, 656) and fp8.kv.dtype == torch.uint8 and fp8.dtype == torch.bfloat16
    assert bf16.bytes_per_token == 61 * 1152 and fp8.bytes_per_token == 61 * 656
    budget = 80 << 30
    ratio = (budget // fp8.bytes_per_token) / (budget // bf16.bytes_per_token)
    assert ratio >= 1.7
    assert fp8.capacity_tokens == bf16.capacity_tokens == 256
    with pytest.raises(ValueError, match="needs v_dim"):
        KVPool(2, 4, 64, 576, torch.bfloat16, "cpu", kv_cache_dtype="fp8")


def test_format_encode_decode():
    fmt = kv_format("fp8", 96, 64, torch.bfloat16)
    x = torch.randn(5, 96)
    stored = fmt.encode(x)
    assert torch.equal(stored, quantize_rows(x.to(torch.bfloat16), 64))
    assert fmt.decode(stored).dtype == torch.bfloat16
    auto = kv_format("auto", 96, 64, torch.float32)
    assert torch.equal(auto.decode(auto.encode(x)), x)


def test_capacity_line_kimi_geometry():
    """The doctor's and serve's figure: Kimi K2's 61 layers of 576-value rows in 80 GB."""
    from treeflash.kvcache.format import capacity_line, kv_tokens

    fp8 = kv_format("fp8_e4m3", 576, 512, torch.bfloat16)
    auto = kv_format("auto", 576, 512, torch.bfloat16)
    budget = 80 * 10**9
    assert kv_tokens(budget, 61, fp8) == budget // (61 * 656) and kv_tokens(budget, 61, auto) == budget // (61 * 1152)
    assert kv_tokens(budget, 61, fp8) / kv_tokens(budget, 61, auto) >= 1.7
    line = capacity_line(fp8, 61, budget, "free on a test GPU")
    assert line.startswith("fp8_e4m3 rows: 656 B a token a layer x 61 layers = 39.1 KiB a token; 80.0 GB")
    assert f"hold {budget // (61 * 656):,} tokens (bfloat16: {budget // (61 * 1152):,}; 1.76x)" in line
