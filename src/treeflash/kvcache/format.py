"""The cache's row format: how one token's latent row of one layer is stored (`KVFormat`).

A row is D = kv_lora_rank + qk_rope_head_dim values: c_kv (the first v_dim = kv_lora_rank,
which are also the values V) then k_pe. Two formats:

- **auto** (the model's dtype): the D values as they are, D x 2 bytes in bf16 (1152 B at
  D = 576). The pool tensor is [layers, pages, page_size, D] of that dtype.
- **fp8_e4m3**: c_kv in FP8 e4m3 with one fp32 scale per 128 values, k_pe in bf16. The pool
  tensor is [layers, pages, page_size, row_bytes] uint8. A row, byte by byte (G =
  ceil(v_dim / 128) scale groups, R = D - v_dim rope values):

      bytes [0, v_dim)                     c_kv[j] / scale[j // 128] as e4m3 (one byte each)
      bytes [v_dim, v_dim + 4 G)           scale[g], fp32 little-endian, g = 0 .. G-1
      (zeros to the next multiple of 16)
      bytes [rope, rope + 2 R)             k_pe as bf16, rope = v_dim + 16 ceil(G / 4)
      then zero padding to a multiple of 16 bytes (v_dim % 16 == 0 is required)

  Kimi K2 / DeepSeek-V3 (v_dim 512, R 64): 512 + 16 + 128 = 656 bytes, no padding, 0.57 of the
  bf16 row: FlashMLA's (and vLLM's `fp8_ds_mla`) 656-byte layout, byte for byte. Every part
  starts at a multiple of 16 bytes (0, 512, 528) and the row stride 656 = 41 x 16, so each part
  of a tile is one TMA box over a strided view of the pool (the verify kernels' loads), and a
  row is one contiguous run (pages, defragmentation, the coarse view and the commit move bytes,
  never values). A layout that keeps the scales apart (a [pages, page_size, G] tensor beside the
  rows) would save nothing (the same 656 bytes a row) and give every page move a second tensor;
  scales after the rope would put c_kv's scales 128 bytes further from it for nothing. The
  padding only matters for small models (D 96, v_dim 64: 64 + 4 (+ 12) + 64 = 144 bytes).

The quantiser (`quantize_rows`): per group, scale = amax / 448 (fp32; 448 = e4m3's largest
finite value), q = clamp(x / scale, -448, 448) rounded to nearest even (torch's
`.to(torch.float8_e4m3fn)`), a group of zeros has scale 0 and codes 0. Decoding
(`dequantize_rows`): x = e4m3(q) x scale. The Triton encoder (`kernels/kv_ops._e4m3_code`)
writes the same bytes; the verify kernels decode inside their tiles and never build a 16-bit
copy of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 128  # c_kv values that share one scale
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8 = "fp8_e4m3"
# --kv-cache-dtype spellings (vLLM: auto, fp8, fp8_e4m3, fp8_ds_mla; SGLang: auto, fp8_e4m3)
KV_CACHE_DTYPES = {"auto": "auto", "fp8": FP8, "fp8_e4m3": FP8, "fp8_ds_mla": FP8, "fp8-e4m3": FP8}
_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
                "fp32": torch.float32, "float": torch.float32}


def scale_groups(v_dim: int) -> int:
    return -(-v_dim // GROUP)


def fp8_rope_offset(v_dim: int) -> int:
    """Byte offset of k_pe in an fp8_e4m3 row: after the codes and the scales, 16-byte aligned."""
    return v_dim + 16 * -(-scale_groups(v_dim) // 4)


def fp8_row_bytes(dim: int, v_dim: int) -> int:
    """Bytes of an fp8_e4m3 row of `dim` values whose first `v_dim` are quantised."""
    return -(-(fp8_rope_offset(v_dim) + 2 * (dim - v_dim)) // 16) * 16


@dataclass(frozen=True)
class KVFormat:
    """How the pool stores a row: `name` "auto" (the values in `dtype`) or "fp8_e4m3"
    (module docstring); `dim` values a row, the first `v_dim` quantised in fp8; `dtype` the
    values' dtype (the model's: what a decoded row is and what the kernels compute in)."""

    name: str
    dim: int
    v_dim: int
    dtype: torch.dtype

    @property
    def fp8(self) -> bool:
        return self.name == FP8

    @property
    def storage_dtype(self) -> torch.dtype:
        """The pool tensor's dtype."""
        return torch.uint8 if self.fp8 else self.dtype

    @property
    def row_elems(self) -> int:
        """The pool tensor's last dimension (bytes for fp8, values otherwise)."""
        return fp8_row_bytes(self.dim, self.v_dim) if self.fp8 else self.dim

    @property
    def row_bytes(self) -> int:
        """Bytes a token takes in one layer."""
        return self.row_elems * torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def label(self) -> str:
        """fp8_e4m3, or the model dtype's name (bfloat16, ...)."""
        return FP8 if self.fp8 else str(self.dtype).removeprefix("torch.")

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [..., dim] (any float dtype) in the pool's storage form: rounded to `dtype` first
        (what the model writes), then quantised for fp8 (`quantize_rows`)."""
        rows = rows.to(self.dtype)
        return quantize_rows(rows, self.v_dim) if self.fp8 else rows

    def decode(self, stored: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored rows [..., row_elems] as values [..., dim] in `dtype` (default: `self.dtype`)."""
        dtype = dtype or self.dtype
        if self.fp8:
            return dequantize_rows(stored, self.dim, self.v_dim, dtype)
        return stored.to(dtype)


def parse_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    """"auto" or "fp8_e4m3" for a --kv-cache-dtype value of a `dtype` model: auto, the model
    dtype's own name, or an fp8 spelling (`KV_CACHE_DTYPES`). Anything else is a ValueError
    naming the choices (another 16-bit dtype than the model's: the cache holds the model's)."""
    name = str(kv_cache_dtype).strip().lower()
    if _DTYPE_NAMES.get(name) == dtype:
        return "auto"
    kind = KV_CACHE_DTYPES.get(name)
    if kind is None:
        why = ("the model's dtype is " + str(dtype).removeprefix("torch.")) if name in _DTYPE_NAMES else (
            "fp8_e5m2 is not implemented (e4m3 with per-128 scales keeps 3 mantissa bits)"
            if "e5m2" in name else "unknown")
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: {why}; expected auto (the model's dtype) or "
                         f"fp8_e4m3 (also fp8, fp8_ds_mla)")
    return kind


def kv_tokens(budget_bytes: int, layers: int, fmt: KVFormat) -> int:
    """Tokens whose KV rows (`layers` layers of `fmt`) fit in `budget_bytes`."""
    return max(int(budget_bytes), 0) // (layers * fmt.row_bytes)


def capacity_line(fmt: KVFormat, layers: int, budget_bytes: int, what: str) -> str:
    """'fp8_e4m3 rows: 656 B a token a layer x 61 layers = 39.1 KiB a token; 80.0 GB (what)
    hold 2,096,000 tokens (bfloat16: 1,193,000; 1.76x)': the tokens `budget_bytes` hold under
    this format and under the other one (fp8 against the model dtype, or back)."""
    other = KVFormat("auto" if fmt.fp8 else FP8, fmt.dim, fmt.v_dim, fmt.dtype)
    mine, theirs = kv_tokens(budget_bytes, layers, fmt), kv_tokens(budget_bytes, layers, other)
    per = layers * fmt.row_bytes
    return (f"{fmt.label} rows: {fmt.row_bytes} B a token a layer x {layers} layers = {per / 1024:.1f} KiB a "
            f"token; {budget_bytes / 1e9:.1f} GB ({what}) hold {mine:,} tokens ({other.label}: {theirs:,}; "
            f"{mine / max(theirs, 1):.2f}x)")


def kv_format(kv_cache_dtype: str, dim: int, v_dim: int, dtype: torch.dtype) -> KVFormat:
    """The format `kv_cache_dtype` names (`parse_kv_cache_dtype`) for rows of `dim` values (the
    first `v_dim` = c_kv) of a `dtype` model."""
    kind = parse_kv_cache_dtype(kv_cache_dtype, dtype)
    if not 0 < v_dim <= dim:
        raise ValueError(f"v_dim {v_dim} must be in 1 .. dim {dim}")
    if kind == FP8 and v_dim % 16:
        raise ValueError(f"an fp8_e4m3 cache needs kv_lora_rank % 16 == 0, got {v_dim}")
    return KVFormat(kind, dim, v_dim, dtype)


def is_fp8_rows(kv_cache: torch.Tensor) -> bool:
    """Whether a cache tensor holds fp8_e4m3 rows (uint8 storage) rather than values."""
    return kv_cache.dtype == torch.uint8


def check_fp8_rows(kv_cache: torch.Tensor, dim: int, v_dim: int) -> None:
    """Raise ValueError unless `kv_cache` [..., row_bytes] uint8 holds fp8 rows of (dim, v_dim)."""
    want = fp8_row_bytes(dim, v_dim)
    if kv_cache.shape[-1] != want:
        raise ValueError(f"an fp8_e4m3 cache of D {dim}, v_dim {v_dim} has rows of {want} bytes, "
                         f"got {kv_cache.shape[-1]}")
    if v_dim % 16:
        raise ValueError(f"fp8_e4m3 rows need v_dim % 16 == 0, got {v_dim}")


def e4m3_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 x -> float8_e4m3fn bytes (uint8), saturating at +-448, rounded to nearest even."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def quantize_rows(x: torch.Tensor, v_dim: int) -> torch.Tensor:
    """The spec of the quantiser: rows x [..., D] (any float dtype) -> fp8_e4m3 rows
    [..., fp8_row_bytes(D, v_dim)] uint8 (module docstring: per-128 amax scales, e4m3 codes,
    k_pe rounded to bf16, zero padding)."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    g = scale_groups(v_dim)
    c = torch.zeros(*lead, g * GROUP, dtype=torch.float32, device=x.device)
    c[..., :v_dim] = x[..., :v_dim].float()
    c = c.view(*lead, g, GROUP)
    # A tensor divisor: CUDA torch turns `tensor / python_float` into a multiply by the
    # reciprocal (1 ulp off a correctly rounded divide), the CPU divides; the kernels divide.
    amax = c.abs().amax(-1)
    scale = amax / torch.full_like(amax, E4M3_MAX)  # [..., G] float32
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale[..., None] > 0, c / safe[..., None], torch.zeros_like(c))
    out = torch.zeros(*lead, fp8_row_bytes(d, v_dim), dtype=torch.uint8, device=x.device)
    out[..., :v_dim] = e4m3_codes(q.reshape(*lead, g * GROUP)[..., :v_dim])
    out[..., v_dim:v_dim + 4 * g] = scale.contiguous().view(torch.uint8)
    rope = x[..., v_dim:].to(torch.bfloat16).contiguous()
    r0 = fp8_rope_offset(v_dim)
    out[..., r0:r0 + 2 * (d - v_dim)] = rope.view(torch.uint8)
    return out


def row_parts(rows: torch.Tensor, dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [..., v_dim] float8_e4m3fn, scales [..., G] float32, k_pe [..., D - v_dim] bf16)
    of fp8 rows [..., row_bytes] uint8 (views where the strides allow, else copies)."""
    g = scale_groups(v_dim)
    codes = rows[..., :v_dim].view(torch.float8_e4m3fn)
    scales = rows[..., v_dim:v_dim + 4 * g].contiguous().view(torch.float32)
    r0 = fp8_rope_offset(v_dim)
    rope = rows[..., r0:r0 + 2 * (dim - v_dim)].contiguous().view(torch.bfloat16)
    return codes, scales, rope


def dequantize_rows(rows: torch.Tensor, dim: int, v_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8_e4m3 rows [..., row_bytes] uint8 -> values [..., dim] in `dtype`: code x scale
    (exact in float64; rounded once in float32 and narrower), then k_pe."""
    codes, scales, rope = row_parts(rows, dim, v_dim)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    per_col = scales.to(acc).repeat_interleave(GROUP, dim=-1)[..., :v_dim]
    c_kv = codes.to(acc) * per_col
    return torch.cat([c_kv, rope.to(acc)], dim=-1).to(dtype)


__all__ = ["E4M3_MAX", "FP8", "GROUP", "KV_CACHE_DTYPES", "KVFormat", "check_fp8_rows", "dequantize_rows",
           "e4m3_codes", "fp8_rope_offset", "fp8_row_bytes", "is_fp8_rows", "capacity_line", "kv_format", "kv_tokens",
           "parse_kv_cache_dtype",
           "quantize_rows", "row_parts",
           "scale_groups"]
