"""MoE router: the one-launch Triton kernel (interpreter on CPU) against its torch twin, and
Gate.forward on CPU against the routing code it replaced."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from treeflash.kernels import moe_gate  # noqa: E402
from treeflash.models.moe import Gate  # noqa: E402

# name: (scoring_func, topk_method, E, n_group, topk_group, top_k)
ROUTERS = {
    "deepseek-v3": ("sigmoid", "noaux_tc", 256, 8, 4, 8),
    "kimi-k2": ("sigmoid", "noaux_tc", 384, 1, 1, 8),
    "softmax-greedy": ("softmax", "greedy", 8, 1, 1, 2),
    "group-limited-greedy": ("softmax", "group_limited_greedy", 64, 8, 3, 6),
}


def _logits(t, e, seed):
    """Distinct logits (a permutation of a spread grid plus jitter): no ties in any ranking."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.linspace(-4.0, 4.0, e)
    rows = [grid[torch.randperm(e, generator=g)] for _ in range(t)]
    return torch.stack(rows) + torch.rand(t, e, generator=g) * (4.0 / e)  # [T, E]


def _by_id(w, ids):
    order = ids.argsort(-1)
    return w.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("t", [1, 5, 33])
def test_triton_matches_torch(router, norm, t):
    scoring, method, e, n_group, topk_group, k = ROUTERS[router]
    logits = _logits(t, e, seed=t * 7 + e)
    bias = (torch.rand(e, generator=torch.Generator().manual_seed(e)) - 0.5) * 0.1
    args = (logits, bias, scoring, method, n_group, topk_group, k, norm, 2.5)
    w_ref, ids_ref = moe_gate(*args, impl="torch")
    w, ids = moe_gate(*args, impl="triton")
    assert w.shape == ids.shape == (t, k) and w.dtype == torch.float32 and ids.dtype == torch.int64
    w, ids = _by_id(w, ids)
    w_ref, ids_ref = _by_id(w_ref, ids_ref)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)


def test_triton_strided_rows():
    """Logits as a column slice of a wider buffer (row stride != E)."""
    scoring, method, e, n_group, topk_group, k = ROUTERS["deepseek-v3"]
    wide = _logits(3, e + 16, seed=1)
    logits, bias = wide[:, :e], torch.zeros(e)
    args = (logits, bias, scoring, method, n_group, topk_group, k, True, 1.0)
    w, ids = _by_id(*moe_gate(*args, impl="triton"))
    w_ref, ids_ref = _by_id(*moe_gate(*args, impl="torch"))
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)


def _old_gate_forward(gate, x):
    """Gate.forward as it was before kernels.moe_gate (copied verbatim)."""
    cfg = gate.cfg
    logits = F.linear(x.float(), gate.weight.float())
    scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(-1)
    choice = scores
    if cfg.topk_method == "noaux_tc":
        choice = scores + gate.e_score_correction_bias.float()
    if cfg.topk_method != "greedy" and cfg.n_group > 1:
        t = choice.shape[0]
        grouped = choice.view(t, cfg.n_group, -1)
        if cfg.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
        else:
            group_scores = grouped.max(-1).values
        keep = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    ids = torch.topk(choice, cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


@dataclasses.dataclass(frozen=True)
class _Cfg:  # the fields Gate reads
    n_routed_experts: int
    hidden_size: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float


def _gate(router, dtype, norm=True):
    scoring, method, e, n_group, topk_group, k = ROUTERS[router]
    cfg = _Cfg(e, 64, k, n_group, topk_group, method, scoring, norm, 2.5)
    gate = Gate(cfg)
    g = torch.Generator().manual_seed(e)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(e, 64, generator=g).to(dtype))
        gate.e_score_correction_bias.copy_(torch.rand(e, generator=g) * 0.1)
    return gate.to(dtype) if dtype != torch.float32 else gate


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_forward_unchanged_on_cpu(router, dtype):
    gate = _gate(router, dtype)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        w, ids = gate(x)
        w_old, ids_old = _old_gate_forward(gate, x)
    assert torch.equal(ids, ids_old) and torch.equal(w, w_old)


def test_gate_weight_cache_follows_updates():
    gate = _gate("deepseek-v3", torch.bfloat16)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.no_grad():
        gate(x)
        gate.weight.mul_(-1)  # in place: bumps the version counter
        w, ids = gate(x)
        w_old, ids_old = _old_gate_forward(gate, x)
    assert torch.equal(ids, ids_old) and torch.equal(w, w_old)
    assert "_w32" not in gate.state_dict()


def test_gate_autograd_path():
    """With grad on, the weight gets gradients through the routing weights (the torch ops)."""
    gate = _gate("deepseek-v3", torch.float32)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    w, ids = gate(x)
    w_old, ids_old = _old_gate_forward(gate, x)
    assert torch.equal(ids, ids_old) and torch.equal(w, w_old)
    (w * torch.arange(w.shape[1])).sum().backward()  # w.sum() is constant when renormalised
    assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0


def test_gate_triton_impl_matches():
    """Gate with impl="triton" on CPU (interpreter) routes as the torch path."""
    gate = _gate("deepseek-v3", torch.bfloat16)
    gate.impl = "triton"
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    with torch.no_grad():
        w, ids = _by_id(*gate(x))
        w_old, ids_old = _by_id(*_old_gate_forward(gate, x))
    assert torch.equal(ids, ids_old)
    torch.testing.assert_close(w, w_old, atol=1e-6, rtol=0)
