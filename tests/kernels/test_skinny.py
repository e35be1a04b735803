"""kernels.skinny_linear (decode-size x W^T with K split across programs): the Triton kernel
(interpreter) against a float64 product and F.linear, with and without a bias, one split and
several (the last program to arrive sums them), odd sizes, into a strided out; its argument checks."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from treeflash import kernels  # noqa: E402
from treeflash.kernels import moe_gemm, skinny  # noqa: E402

TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # max |err| / max |ref|


def _rel(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,split", [(1, 40, 96, 1), (1, 70, 200, 3), (5, 33, 130, 2), (16, 64, 64, 1),
                                         (19, 100, 300, 4), (32, 8, 72, None)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(dtype, m, n, k, split, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = skinny.skinny_linear_triton(x, w, b, split=split)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (m, n)
    assert _rel(got, ref) < TOL[dtype]
    assert not moe_gemm._tile_counters(x.device, 1).any()  # the arrival counters left at zero
    assert torch.equal(skinny.skinny_linear_triton(x, w, b, split=split), got)  # one fixed order


def test_public_function_and_strided_operands():
    g = torch.Generator().manual_seed(1)
    big = torch.randn(3, 2 * 130, generator=g)
    x = big[:, :130]  # rows 260 apart, unit stride along K
    w = torch.randn(48, 130, generator=g)
    out = torch.full((3, 2 * 48), float("nan"))[:, :48]
    got = kernels.skinny_linear(x, w, out=out, impl="triton")
    assert got is out
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernels.skinny_linear(x, w, impl="torch"), F.linear(x, w))


def test_plan_fills_the_sms():
    # Kimi K2 TP8 shapes on 132 SMs: kv_a + q_a, q_b, o_proj
    for n, k in ((2112, 7168), (1536, 1536), (7168, 1024)):
        bn, split, chunk = skinny.plan(1, n, k, 132)
        tiles = -(-n // bn)
        assert split * chunk >= k > (split - 1) * chunk and chunk % 128 == 0
        assert tiles * split >= 132 or chunk == 128  # the SMs busy, or K cut as fine as allowed
    assert skinny.plan(1, 64, 128, 132)[1] == 1  # one BLOCK_K step: nothing to split


def test_rejects_bad_arguments():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="multiply"):
        kernels.skinny_linear(x, torch.randn(4, 9), impl="triton")
    with pytest.raises(ValueError, match="at most"):
        kernels.skinny_linear(torch.randn(33, 8), w, impl="triton")
    with pytest.raises(ValueError, match="dtype"):
        kernels.skinny_linear(x, w.double(), impl="triton")
    with pytest.raises(ValueError, match="unit stride"):
        kernels.skinny_linear(torch.randn(8, 2).t(), w, impl="triton")
