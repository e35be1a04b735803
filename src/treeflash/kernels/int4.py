"""Grouped symmetric INT4 weights (W4A16) in compressed-tensors' `pack-quantized` layout.

Kimi K2.5 / K2.6 publish their routed experts this way, and treeflash keeps them so in memory
(never a dequantized copy of the model). One projection W [N, K] (out, in) is stored as

    packed [N, K / 8] int32: value k of row n sits in word k // 8, bits 4 * (k % 8) .. + 3,
                             as the nibble q + 8 (offset binary, q in -8..7; the QAT uses -7..7)
    scale  [N, K / G] (bf16 as published): W[n, k] = q[n, k] * scale[n, k // G]

which is `compressed_tensors.compressors.pack_quantized.helpers.pack_to_int32(q, 4)` for a
little-endian host (tests/kernels/test_int4.py checks it against that library). Stacked experts
add a leading [E] dimension to both tensors. 0.5625 bytes a parameter at G = 32 with bf16 scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PACK = 8  # int4 values a 32-bit word


@dataclass(frozen=True)
class Int4Weight:
    """W [..., N, K] as `packed` [..., N, K / 8] int32 and `scale` [..., N, K / group_size]."""

    packed: torch.Tensor
    scale: torch.Tensor
    group_size: int

    def __post_init__(self):
        p, s, g = self.packed, self.scale, self.group_size
        if p.dtype != torch.int32:
            raise ValueError(f"packed INT4 weight must be int32, got {p.dtype}")
        if g < PACK or g % PACK:
            raise ValueError(f"group size must be a positive multiple of {PACK}, got {g}")
        if s.shape[:-1] != p.shape[:-1] or s.shape[-1] * g != p.shape[-1] * PACK:
            raise ValueError(f"scale {tuple(s.shape)} does not match packed {tuple(p.shape)} at group {g}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape [..., N, K]."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * PACK)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * 4 + self.scale.numel() * self.scale.element_size()

    def __getitem__(self, index) -> Int4Weight:
        """A view of some leading rows (e.g. one expert of a stack)."""
        return Int4Weight(self.packed[index], self.scale[index], self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W = q * scale in `dtype` (the reference path; the kernels never materialise it)."""
        q = unpack_int4(self.packed).to(torch.float32)  # [..., N, K]
        s = self.scale.to(torch.float32).repeat_interleave(self.group_size, dim=-1)
        return (q * s).to(dtype)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed [..., K / 8] int32 -> q [..., K] int8 in -8..7."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)  # [8]
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., K / 8, 8]; the mask undoes the sign
    return (nib - 8).to(torch.int8).flatten(-2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [..., K] integers in -8..7 (K a multiple of 8) -> packed [..., K / 8] int32."""
    if q.shape[-1] % PACK:
        raise ValueError(f"the packed dimension ({q.shape[-1]}) must be a multiple of {PACK}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("INT4 values must lie in -8..7")
    nib = (q.to(torch.int64) + 8).unflatten(-1, (-1, PACK))  # [..., K / 8, 8]
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    word = (nib << shifts).sum(-1)  # < 2^32, exact in int64
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def quantize_int4(w: torch.Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.bfloat16) -> Int4Weight:
    """Symmetric group quantisation as the published QAT does: scale = max|w| / 7 a group,
    q = round(w / scale) in -7..7. For building test and benchmark weights; a checkpoint's
    own scales are loaded as stored."""
    *lead, n, k = w.shape
    if k % group_size:
        raise ValueError(f"K = {k} is not a multiple of the group size {group_size}")
    groups = w.float().unflatten(-1, (k // group_size, group_size))
    scale = (groups.abs().amax(-1) / 7.0).to(scale_dtype)
    s32 = scale.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    q = torch.round(groups / s32).clamp(-7, 7).flatten(-2).to(torch.int8)
    return Int4Weight(pack_int4(q), scale, group_size)


@torch.no_grad()
def random_fill_(w: Int4Weight, std: float, generator: torch.Generator | None = None) -> None:
    """Fill `w` in place with uniform random nibbles and one scale that gives its entries a
    standard deviation of about `std` (uniform q in -8..7: 4.61); random benchmark weights."""
    bits = torch.randint(-(2**31), 2**31, w.packed.shape, generator=generator, device=w.packed.device)
    w.packed.copy_(bits.to(torch.int32))
    w.scale.fill_(std / 4.61)
