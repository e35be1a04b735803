"""Rotary tables in a half-precision model: the angles stay float32 products."""

from __future__ import annotations

import torch

from treeflash.config import RopeConfig
from treeflash.models.layers import Rotary


def test_bf16_model_keeps_float32_angles_at_long_positions():
    """module.to(bf16) turns the inv_freq buffer into bf16; an integer position times it must
    still be a float32 product. Folding the .float() into the multiply (2026-12-03) made it a bf16
    product: positions past 256 rounded, and the shipped pair's acceptance fell 3.39 -> 2.33 on
    the H200 before this test existed."""
    rot = Rotary(RopeConfig(theta=10000.0), 64, interleave=False).to(torch.bfloat16)
    assert rot.inv_freq.dtype == torch.bfloat16
    pos = torch.tensor([[3, 300, 4097, 30001]])
    cos, sin = rot.cos_sin(pos, torch.float32)
    angles = pos[..., None].double() * rot.inv_freq.double()
    torch.testing.assert_close(cos.double(), angles.cos(), atol=2e-3, rtol=0)
    torch.testing.assert_close(sin.double(), angles.sin(), atol=2e-3, rtol=0)
