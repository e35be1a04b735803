"""kernels.argmax (one program a row, Triton interpreter) against torch.argmax: ties (the first
maximum wins, across chunk boundaries too), dtypes, a vocabulary over several chunks."""

from __future__ import annotations

import pytest
import torch

from treeflash import kernels
from treeflash.sampling import choose_tokens_batch, greedy_tokens


@pytest.mark.slow
@pytest.mark.parametrize("shape, dtype", [
    ((2, 7, 4096), torch.float32), ((1, 32, 4096), torch.bfloat16), ((3, 5000), torch.float16),
    ((1, 2, 20000), torch.bfloat16), ((4, 1, 37), torch.float32),
])
def test_argmax_equals_torch(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g)
    x = (x * 2).round().to(dtype)  # coarse values: many ties for the maximum
    assert torch.equal(kernels.argmax(x, impl="triton"), x.argmax(-1))


def test_argmax_first_maximum_across_chunks():
    x = torch.zeros(3, 9000)
    x[0, [5, 4100, 8999]] = 1.0  # chunks of 4096: the first chunk's index wins
    x[1, [4096, 8192]] = 2.0
    x[2, 8999] = 3.0
    assert kernels.argmax(x, impl="triton").tolist() == [5, 4096, 8999] == x.argmax(-1).tolist()


def test_greedy_tokens_is_argmax_on_cpu():
    x = torch.randn(2, 5, 64)
    assert torch.equal(greedy_tokens(x), x.argmax(-1))
    params = [type("P", (), {"greedy": True})()] * 2
    assert torch.equal(choose_tokens_batch(x, params, [None, None]), x.argmax(-1))
