"""kernels.topk_logprobs: the Triton kernel (interpreter) against its torch twin, tokens exactly
and values to a few float32 ulps; the twin against torch's log_softmax + topk; ties (the lower
token id first); routing of what the kernel does not take.

The interpreter runs one program per row at ~0.1 s for a 4096-wide row, so the grid below is
chosen, not crossed: every shape, dtype and k appears, not every combination."""

from __future__ import annotations

import pytest
import torch

from treeflash import kernels
from treeflash.kernels import reference, topk_lp

# lp = (x - max) - log(sum exp(x - max)): the interpreter's numpy exp/log and torch's vectorised
# ones differ by an ulp or so in the sum's log, shifting every value of a row by the same few
# float32 ulps of |lse| (lse ~ 10 for V = 4096, so ~1e-6 absolute).
VALUE_TOL = {"rtol": 1e-6, "atol": 4e-6}


def _check(x: torch.Tensor, k: int) -> None:
    got_lp, got_tok = kernels.topk_logprobs(x, k, impl="triton")
    want_lp, want_tok = reference.topk_logprobs(x, k)
    assert got_lp.dtype == torch.float32 and got_tok.dtype == torch.long
    assert got_tok.shape == want_tok.shape == (*x.shape[:-1], k)
    assert torch.equal(got_tok, want_tok)
    torch.testing.assert_close(got_lp, want_lp, **VALUE_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("shape, dtype, k", [
    ((1, 15, 4096), torch.float32, 31),  # the shipped pair's drafter block, ddtree-31
    ((4, 16, 4096), torch.bfloat16, 8),
    ((2, 3, 1000), torch.float16, 127),  # V not a power of two: 24 padding lanes
    ((2, 3, 1000), torch.float32, 1),  # the chain (dflash)
    ((1, 1, 16384), torch.bfloat16, 8),  # the largest V the kernel takes
    ((3, 5), torch.float32, 5),  # k = V: every lane, 11 padding lanes never chosen
])
def test_kernel_equals_twin(shape, dtype, k):
    g = torch.Generator().manual_seed(sum(shape) + k)
    _check((3 * torch.randn(shape, generator=g)).to(dtype), k)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 8, 31, 127])
def test_ties_lower_token_first(k):
    g = torch.Generator().manual_seed(k)
    x = (2 * torch.randn(2, 2, 4096, generator=g)).round()  # ~9 distinct values: ties everywhere
    x[0, 0] = 0.0  # one value: the top k are tokens 0..k-1
    x[1, 1, 4000:] = 100.0  # 96 tied winners, at the end of the row (k = 127 goes past them)
    _check(x, k)
    lp, tok = kernels.topk_logprobs(x, k, impl="triton")
    assert tok[0, 0].tolist() == list(range(k))
    assert tok[1, 1, :min(k, 96)].tolist() == list(range(4000, 4000 + min(k, 96)))
    assert (lp[..., 1:] <= lp[..., :-1]).all()


@pytest.mark.slow
def test_peaked_rows():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4096, generator=g)
    x[0, 17] = 80.0  # one token takes all the mass: lp 0 there, ~-80 elsewhere
    x[1, [5, 9]] = 60.0  # two equal peaks
    x[2] *= 1e-3  # nearly flat: lp ~ -log(4096) everywhere
    _check(x, 31)
    lp, tok = kernels.topk_logprobs(x, 31, impl="triton")
    assert tok[0, 0] == 17 and lp[0, 0] == 0.0
    assert tok[1, :2].tolist() == [5, 9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_twin_equals_torch_topk_without_ties(dtype):
    """On rows of distinct logits the twin is torch's log_softmax + topk, values bit for bit."""
    g = torch.Generator().manual_seed(3)
    if dtype == torch.float32:
        x = 4 * torch.randn(3, 4096, generator=g)
    else:  # 2048 consecutive bit patterns from 2**-3 (16 binades in bf16, 2 in fp16), and negated
        pos = (torch.arange(2048, dtype=torch.int16) + {torch.bfloat16: 0x3E00, torch.float16: 0x3000}[dtype])
        row = torch.cat([pos.view(dtype), -pos.view(dtype)])
        x = torch.stack([row[torch.randperm(4096, generator=g)] for _ in range(3)])
    assert all(r.unique().numel() == 4096 for r in x)
    for k in (1, 8, 31, 127):
        lp, tok = reference.topk_logprobs(x, k)
        want = torch.log_softmax(x.float(), -1).topk(k)
        assert torch.equal(lp, want.values) and torch.equal(tok, want.indices)


def _plain(x, k):
    return torch.log_softmax(x.float(), dim=-1).topk(k, dim=-1)


def test_unsupported_goes_to_torch(monkeypatch):
    """impl=None on CUDA takes torch's log_softmax + topk where the kernel does not apply, and when
    fused=False, the runtime option fused_topk=0 (CPU tensors stand in for CUDA ones here: is_cuda is patched)."""
    def no_kernel(*args):
        raise AssertionError("the kernel was launched")

    launcher = topk_lp.topk_logprobs_triton
    monkeypatch.setattr(topk_lp, "topk_logprobs_triton", no_kernel)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(1, 2, topk_lp.MAX_VOCAB + 1, generator=g)
    narrow = torch.randn(2, 300, generator=g)
    for x, k in ((wide, 8), (narrow, topk_lp.MAX_K + 1), (narrow[:, ::2], 8)):  # (last: a strided row)
        assert not topk_lp.supported(x, k)
        got, want = kernels.topk_logprobs(x, k), _plain(x, k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert topk_lp.supported(narrow, topk_lp.MAX_K)
    with pytest.raises(AssertionError, match="launched"):  # supported: the kernel
        kernels.topk_logprobs(narrow, 8)
    got, want = kernels.topk_logprobs(narrow, 8, fused=False), _plain(narrow, 8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    monkeypatch.undo()
    with pytest.raises(ValueError, match="unsupported"):
        launcher(wide, 8)


def test_default_on_cpu_is_torch():
    """CPU tensors keep torch's ops (the build's tokens on CPU are as before the kernel)."""
    x = torch.randn(2, 50)
    lp, tok = kernels.topk_logprobs(x, 4)
    want = _plain(x, 4)
    assert torch.equal(lp, want[0]) and torch.equal(tok, want[1])
