"""Shared building blocks: RMSNorm, rotary embeddings (default and YaRN), SwiGLU MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from treeflash import kernels
from treeflash.config import RopeConfig, yarn_mscale
from treeflash.runtime import DEFAULT, RuntimeOptions


def fused(options: RuntimeOptions, x: torch.Tensor, *params: torch.Tensor) -> str | None:
    """The fused norm/rotary kernels' impl for x, or None for the plain torch ops: Triton on
    CUDA at inference (autograd needs the torch ops), unless `options.fused_norm` is off;
    `options.fused_kernels` pins it ("triton" on CPU tensors: the interpreter)."""
    if options.fused_kernels is not None:
        return options.fused_kernels
    if not x.is_cuda or not options.fused_norm:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return None
    return "triton"


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as the reference does)."""

    def __init__(self, dim: int, eps: float = 1e-6, options: RuntimeOptions = DEFAULT):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.options = options

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, out=out,
                                impl=fused(self.options, x, self.weight) or "torch")

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), one launch on the fused path."""
        return kernels.rms_norm(x, self.weight, self.eps, residual=residual,
                                impl=fused(self.options, x, self.weight) or "torch")


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale ("attention factor") for `rope`."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freqs = rope.theta**exponents
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    if rope.attention_factor is not None:
        attn_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attn_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attn_factor = yarn_mscale(factor)
    orig = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attn_factor


class Rotary(nn.Module):
    """cos/sin tables for arbitrary (tree) positions; `apply` rotates the last dim."""

    def __init__(self, rope: RopeConfig, dim: int, interleave: bool, options: RuntimeOptions = DEFAULT):
        super().__init__()
        inv_freq, self.scale = rope_inv_freq(rope, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleave = interleave
        self.options = options

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., dim/2] in dtype, computed in float32. A scale of 1
        (YaRN with mscale == mscale_all_dim) is not multiplied (a launch a call). The explicit
        .float() stays: in a bf16 model `inv_freq` is bf16 (module.to converts buffers), and
        an integer tensor times it would be a bf16 product, positions past 256 rounded (the
        H200 pair, 2026-12-03: acceptance 3.39 -> 2.33 when the cast was folded into the multiply)."""
        freqs = positions[..., None].float() * self.inv_freq  # [..., dim/2] float32
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              out: torch.Tensor | None = None, norm: RMSNorm | None = None) -> torch.Tensor:
        """x [..., T, (heads,) dim]; cos/sin [..., T, dim/2] broadcast over a heads axis if present.

        Interleaved checkpoints rotate pairs (x0, x1), (x2, x3)...; the result is laid out
        de-interleaved (evens then odds), exactly as the reference does. Queries and keys
        get the same layout, so their dot products are unchanged. `norm`: an RMSNorm over
        the last dim applied first (one launch with the rotation on the fused path); `out`
        receives the result (it may alias x).
        """
        impl = fused(self.options, x, *(() if norm is None else (norm.weight,)))
        lead = x.shape[:-2] if x.dim() == cos.dim() + 1 else x.shape[:-1]
        if tuple(cos.shape[:-1]) != tuple(lead) or (norm is not None and norm.weight.dtype != x.dtype):
            impl = None  # broadcast tables or a promoting norm: the torch ops handle them
        return kernels.rope(x, cos, sin, self.interleave, out=out,
                            norm_weight=None if norm is None else norm.weight,
                            eps=1e-6 if norm is None else norm.eps, impl=impl or "torch")


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def set_options(model: nn.Module, options: RuntimeOptions) -> None:
    """Hand `options` to every module of `model` that chooses an implementation (those built
    with one keep it as `.options`): an A/B run switches a built model without reloading it."""
    for m in model.modules():
        if hasattr(m, "options"):
            m.options = options
