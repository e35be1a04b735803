"""MoE router: the one-launch Triton kernel (interpreter on CPU) against its torch twin, and
Gate.forward on CPU against the routing code it replaced."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from treeflash.kernels import moe_gate, moe_gate_fused  # noqa: E402
from treeflash.kernels.reference import routing_margin  # noqa: E402
from treeflash.models.moe import Gate  # noqa: E402
from treeflash.runtime import RuntimeOptions  # noqa: E402

pytestmark = pytest.mark.slow

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


@pytest.mark.parametrize("router", ["kimi-k2", "deepseek-v3"])
def test_triton_ranks_choices_of_either_sign(router):
    """A bias that pushes part of the choices below zero: the kernel's order-preserving keys
    must rank negative choices (flipped magnitude bits) below positive ones and among
    themselves as the floats do."""
    scoring, method, e, n_group, topk_group, k = ROUTERS[router]
    logits = _logits(4, e, seed=5)
    bias = torch.linspace(-1.2, 0.3, e)[torch.randperm(e, generator=torch.Generator().manual_seed(2))]
    args = (logits, bias, scoring, method, n_group, topk_group, k, True, 1.0)
    choice = logits.sigmoid() + bias
    assert (choice < 0).any() and (choice > 0).any()
    w, ids = _by_id(*moe_gate(*args, impl="triton"))
    w_ref, ids_ref = _by_id(*moe_gate(*args, impl="torch"))
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("router", ["kimi-k2", "softmax-greedy"])
def test_triton_breaks_ties_by_the_smaller_id(router):
    """Equal choices (logits drawn from three values): the picks are the best choices, ties
    going to the smaller expert id, in pick order, each with its own score (the torch twin's
    topk leaves tie order unspecified, so the expectation is built here)."""
    scoring, method, e, n_group, topk_group, k = ROUTERS[router]
    g = torch.Generator().manual_seed(11)
    logits = torch.tensor([-1.0, 0.5, 2.0])[torch.randint(0, 3, (3, e), generator=g)]
    logits[:, -1] = 0.5  # the last id ties with others of its value
    bias = torch.zeros(e)
    w, ids = moe_gate(logits, bias, scoring, method, n_group, topk_group, k, False, 1.0, impl="triton")
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(-1)
    for row in range(logits.shape[0]):
        order = sorted(range(e), key=lambda i: (-scores[row, i].item(), i))[:k]
        assert ids[row].tolist() == order
        torch.testing.assert_close(w[row], scores[row, order], atol=1e-6, rtol=0)


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
    """Gate with impl="triton" on CPU (interpreter) routes as the torch path (256 x 64 is a small
    router: the fused-logits kernel)."""
    gate = _gate("deepseek-v3", torch.bfloat16)
    gate.impl = "triton"
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    with torch.no_grad():
        w, ids = _by_id(*gate(x))
        w_old, ids_old = _by_id(*_old_gate_forward(gate, x))
    assert torch.equal(ids, ids_old)
    torch.testing.assert_close(w, w_old, atol=1e-6, rtol=0)


# ---- the logits GEMM folded in (moe_gate_fused; FUSED_LOGITS in kernels/moe_router.py) ----

# name: (scoring_func, topk_method, E, n_group, topk_group, top_k, hidden)
FUSED_ROUTERS = {
    "shipped-pair": ("sigmoid", "noaux_tc", 8, 2, 1, 2, 256),  # assets/target/config.json
    "noaux-tc-grouped": ("sigmoid", "noaux_tc", 64, 8, 3, 6, 384),  # hidden not a power of 2
    "softmax-greedy": ("softmax", "greedy", 8, 1, 1, 2, 256),
    "sigmoid-greedy-nonorm": ("sigmoid", "greedy", 16, 1, 1, 4, 512),  # 2 hidden chunks
    "group-limited-greedy": ("softmax", "group_limited_greedy", 64, 8, 3, 6, 128),
    "odd-experts": ("softmax", "greedy", 12, 1, 1, 3, 96),  # E not a power of 2 (masked tile)
}
MARGIN = 1e-4  # rows whose routing decision is closer than this may route differently


@pytest.mark.parametrize("router", list(FUSED_ROUTERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 37])  # 37: several chunks of rows, not a power of two
def test_fused_logits_matches_gemm_then_twin(router, dtype, t):
    """moe_gate_fused (Triton, interpreter) against F.linear(x.float(), w32) + the torch twin.

    Tolerance: weights within 5e-6 absolute (20 float32 ulps of the largest weight, 2.5 =
    routed_scaling_factor). The only difference is the float32 sum order of the hidden-long dot
    products (the kernel's chunked tree sum against cuBLAS's): each logit's rounding error is
    typically ~sqrt(hidden) * 2^-24 * sum|x_i w_i| (~1e-6 here; the worst-case bound, hidden
    times that, is never approached by random data), and the weights move by about
    routed_scaling_factor times the logits (sigmoid / softmax slopes <= 1/4, 1/2, the
    renormalisation at most doubling). Observed: <= 2.1e-6 (softmax over 64 experts), <= 4e-7
    for the shipped pair's router; the unfused kernel alone is within 1e-6 of its twin. A
    wrong expert, or logits from bf16-rounded x or tf32 products, would be off by > 1e-4.
    Ids must be equal on every row whose routing decision has a margin above 1e-4 (float64
    reference); rows closer than that (0-3 of 133 per config in a T = 1, 32, 100 run) may differ and, if they
    do, are left out of the weight check."""
    scoring, method, e, n_group, topk_group, k, hidden = FUSED_ROUTERS[router]
    g = torch.Generator().manual_seed(e * 1000 + hidden + t)
    x = (torch.randn(t, hidden, generator=g) * 2).to(dtype)
    w32 = torch.randn(e, hidden, generator=g) / hidden ** 0.5  # logits ~ N(0, 4)
    bias = (torch.rand(e, generator=g) - 0.5) * 0.2
    if t == 37:  # a row stride != hidden: x a column slice of a wider buffer
        x = torch.cat([x, torch.zeros(t, 8, dtype=dtype)], 1)[:, :hidden]
    norm = router != "sigmoid-greedy-nonorm"
    args = (bias, scoring, method, n_group, topk_group, k, norm, 2.5)
    logits = F.linear(x.float(), w32)
    w_ref, ids_ref = _by_id(*moe_gate(logits, *args, impl="torch"))
    w, ids = moe_gate_fused(x, w32, *args, impl="triton")
    assert w.shape == ids.shape == (t, k) and w.dtype == torch.float32 and ids.dtype == torch.int64
    w, ids = _by_id(w, ids)
    clear = routing_margin(logits, bias, scoring, method, n_group, topk_group, k) > MARGIN
    assert clear.float().mean() >= 0.9, clear.float().mean()  # the check keeps most rows
    same = (ids == ids_ref).all(-1)
    assert bool(same[clear].all()), torch.nonzero(~same & clear)
    torch.testing.assert_close(w[same], w_ref[same], atol=5e-6, rtol=0)


def test_fused_logits_torch_twin_is_unfused():
    """impl="torch" of moe_gate_fused is the GEMM + twin, bit for bit."""
    scoring, method, e, n_group, topk_group, k, hidden = FUSED_ROUTERS["shipped-pair"]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, hidden, generator=g).to(torch.bfloat16)
    w32, bias = torch.randn(e, hidden, generator=g) / 16, torch.rand(e, generator=g) * 0.1
    args = (bias, scoring, method, n_group, topk_group, k, True, 2.5)
    w, ids = moe_gate_fused(x, w32, *args, impl="torch")
    w_ref, ids_ref = moe_gate(F.linear(x.float(), w32), *args, impl="torch")
    assert torch.equal(w, w_ref) and torch.equal(ids, ids_ref)


def _counting(monkeypatch):
    import treeflash.kernels as K

    calls = {"moe_gate": 0, "moe_gate_fused": 0}
    for name in calls:
        fn = getattr(K, name)

        def wrapped(*a, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)

        monkeypatch.setattr(K, name, wrapped)
    return calls


@pytest.mark.parametrize("case", ["shipped-pair", "deepseek-v3", "kimi-k2", "kimi-k2-65-rows", "kimi-k2-split-off",
                                  "kimi-k2-16-rows-f32", "kimi-k2-16-rows-bf16", "grad", "cpu-default"])
def test_gate_picks_fused_path(monkeypatch, case):
    """Gate.forward folds the GEMM in on the Triton path: for a small router at any row count
    (the float32 weight copy, one program a row), for DeepSeek-V3 / Kimi-K2 sized routers at up
    to 4 rows, or SPLIT_MAX_ROWS with x and the weight in one 16-bit dtype (the weight as stored,
    the split launch). Longer forwards of those, 16 rows on a float32 weight,
    the runtime option split_router off, autograd and the CPU default keep the F.linear + moe_gate
    path (fused_gate off acts on CUDA only, through Gate._impl's impl="torch", as the CPU
    default's)."""
    import treeflash.kernels.moe_router as R

    options = RuntimeOptions(split_router=case != "kimi-k2-split-off")
    sizes = {"deepseek-v3": (256, 7168, 8, 8, 4), "kimi-k2": (384, 7168, 8, 1, 1)}
    e, hidden, k, n_group, topk_group = sizes.get(case[:7] if case.startswith("kimi") else case, (8, 256, 2, 2, 1))
    cfg = _Cfg(e, hidden, k, n_group, topk_group, "noaux_tc", "sigmoid", True, 2.5)
    gate = Gate(cfg, options)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(e, hidden, generator=g) / hidden ** 0.5)
        gate.e_score_correction_bias.copy_(torch.rand(e, generator=g) * 0.1)
    gate.impl = None if case == "cpu-default" else "triton"
    # Large routers: keep the interpreter out of the 256/384-expert kernels (the decision is
    # what is tested here; the kernels have their own tests).
    monkeypatch.setattr(R, "moe_gate_triton", lambda logits, *a: moe_gate(logits, *a, impl="torch"))
    split_weights = []

    def split(x, w, *a):
        split_weights.append(w)
        return moe_gate(F.linear(x.float(), w.float()), *a, impl="torch")

    monkeypatch.setattr(R, "moe_gate_split_triton", split)
    calls = _counting(monkeypatch)
    if case == "kimi-k2-16-rows-bf16":
        gate.to(torch.bfloat16)
    rows = {"kimi-k2-65-rows": 65, "kimi-k2-16-rows-f32": 16, "kimi-k2-16-rows-bf16": 16}.get(case, 3)
    x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    if case == "grad":
        gate(x)
    else:
        with torch.no_grad():
            gate(x)
    fused = case in ("shipped-pair", "deepseek-v3", "kimi-k2", "kimi-k2-16-rows-bf16")
    assert calls == {"moe_gate": int(not fused), "moe_gate_fused": int(fused)}, calls
    assert R.fused_logits_ok(e, hidden, k) == (e == 8)
    # the split launch reads the weight as stored (no float32 copy)
    assert [w is gate.weight for w in split_weights] == [True] * (fused and e > 8)


def test_gate_fused_matches_unfused():
    """Gate.forward on the fused path (impl="triton", interpreter) routes as the torch ops."""
    cfg = _Cfg(8, 256, 2, 2, 1, "noaux_tc", "sigmoid", True, 2.5)  # the shipped pair's router
    gate = Gate(cfg).to(torch.bfloat16)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        gate.weight.copy_((torch.randn(8, 256, generator=g) / 16).to(torch.bfloat16))
        gate.e_score_correction_bias.copy_(torch.rand(8, generator=g) * 0.1)
    x = torch.randn(32, 256, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        w_old, ids_old = _by_id(*_old_gate_forward(gate, x))
        gate.impl = "triton"
        w, ids = _by_id(*gate(x))
    assert torch.equal(ids, ids_old)
    torch.testing.assert_close(w, w_old, atol=5e-6, rtol=0)


@pytest.mark.parametrize("e, shape", [(8, (1, 2)), (8, (32, 2)), (12, (37, 3)), (384, (33, 8)), (256, (1030, 8))])
def test_expert_counts_one_launch_matches_the_torch_ops(e, shape):
    """kernels.expert_counts (Triton, interpreter: one program's histogram over blocks of ids)
    against the torch path (zero_, scatter_add_ of ones, add): equal counts, the running total
    accumulated over two forwards, and `last` overwritten (not accumulated) by the second."""
    from treeflash import kernels

    g = torch.Generator().manual_seed(e + shape[0])
    runs = {impl: (torch.full((e,), 7, dtype=torch.long), torch.zeros(e, dtype=torch.long))
            for impl in ("torch", "triton")}
    for _ in range(2):
        ids = torch.randint(0, e, shape, generator=g)
        ids[0, 0] = e - 1  # the last expert is counted (the bins reach E - 1)
        for impl, (last, total) in runs.items():
            kernels.expert_counts(ids, last, total, impl=impl)
        assert torch.equal(runs["triton"][0], runs["torch"][0])
        assert torch.equal(runs["triton"][1], runs["torch"][1])
        assert int(runs["triton"][0].sum()) == ids.numel()
    assert int(runs["triton"][1].sum()) == 2 * ids.numel()


# ---- large routers at decode / verify sizes: the split launch (moe_gate_split_triton) ----

# name: (scoring_func, topk_method, E, n_group, topk_group, top_k, hidden); hidden cut short of
# 7168 to keep the interpreter quick, not a multiple of the chunk
SPLIT_ROUTERS = {
    "kimi-k2": ("sigmoid", "noaux_tc", 384, 1, 1, 8, 1000),
    "deepseek-v3": ("sigmoid", "noaux_tc", 256, 8, 4, 8, 1000),
    "softmax-groups": ("softmax", "group_limited_greedy", 64, 8, 3, 6, 700),
    "odd-experts": ("sigmoid", "greedy", 100, 1, 1, 4, 600),  # E not a multiple of the expert block
}


@pytest.mark.parametrize("router", list(SPLIT_ROUTERS))
@pytest.mark.parametrize("dtype, t", [(torch.bfloat16, 1), (torch.bfloat16, 3), (torch.bfloat16, 7),
                                      (torch.bfloat16, 64), (torch.float32, 1), (torch.float32, 4)])
def test_split_launch_matches_gemm_then_twin(router, dtype, t):
    """moe_gate_split_triton (interpreter) against F.linear(x.float(), w.float()) + the torch twin:
    the weight read in its own dtype and upcast (exact), float32 products and sums in the kernel's
    order (<= 4 rows: broadcast sums; 7 / 64 rows: the dot over 16-row groups, on the GPU the
    tensor cores' exact bf16 products), so the same tolerance and margin rule as the
    one-program-a-row kernel above."""
    from treeflash.kernels.moe_router import moe_gate_split_triton, plan_router_split

    scoring, method, e, n_group, topk_group, k, hidden = SPLIT_ROUTERS[router]
    assert plan_router_split(t, e, hidden, 64)["nsplit"] > 1  # the partials' sum is exercised
    g = torch.Generator().manual_seed(e * 1000 + hidden + t)
    x = (torch.randn(t, hidden, generator=g) * 2).to(dtype)
    w = (torch.randn(e, hidden, generator=g) / hidden ** 0.5).to(dtype)
    if t == 7:  # row strides != hidden: slices of wider buffers
        x = torch.cat([x, torch.zeros(t, 8, dtype=dtype)], 1)[:, :hidden]
        w = torch.cat([w, torch.zeros(e, 24, dtype=dtype)], 1)[:, :hidden]
    bias = (torch.rand(e, generator=g) - 0.5) * 0.2
    args = (bias, scoring, method, n_group, topk_group, k, True, 2.5)
    logits = F.linear(x.float(), w.float())
    w_ref, ids_ref = _by_id(*moe_gate(logits, *args, impl="torch"))
    wt, ids = moe_gate_split_triton(x, w, *args)
    assert wt.shape == ids.shape == (t, k) and wt.dtype == torch.float32 and ids.dtype == torch.int64
    wt, ids = _by_id(wt, ids)
    clear = routing_margin(logits, bias, scoring, method, n_group, topk_group, k) > MARGIN
    assert clear.float().mean() >= 0.9, clear.float().mean()
    same = (ids == ids_ref).all(-1)
    assert bool(same[clear].all()), torch.nonzero(~same & clear)
    torch.testing.assert_close(wt[same], w_ref[same], atol=5e-6, rtol=0)


def test_split_launch_leaves_its_counters_at_zero():
    """The arrival counters are back at zero after each call (the last routing program resets
    them), so back-to-back calls of other sizes route as fresh ones, deterministically."""
    from treeflash.kernels.device import tile_counters as _tile_counters
    from treeflash.kernels.moe_router import moe_gate_split_triton

    scoring, method, e, n_group, topk_group, k, hidden = SPLIT_ROUTERS["kimi-k2"]
    g = torch.Generator().manual_seed(21)
    w = (torch.randn(e, hidden, generator=g) / hidden ** 0.5).to(torch.bfloat16)
    bias = torch.rand(e, generator=g) * 0.1
    args = (bias, scoring, method, n_group, topk_group, k, True, 2.5)
    xs = [torch.randn(t, hidden, generator=g).to(torch.bfloat16) for t in (2, 9)]
    outs = []
    for x in xs + xs:
        outs.append(moe_gate_split_triton(x, w, *args))
        assert _tile_counters(x.device, 2)[:2].tolist() == [0, 0]
    for first, again in zip(outs[:2], outs[2:]):
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_split_plan_covers_the_hidden_dim():
    """Every chunk of the plan is non-empty and together they cover hidden once; Kimi K2 on 132
    SMs is 12 expert blocks x 14 chunks of 512 (168 logits programs)."""
    from treeflash.kernels.moe_router import SPLIT_MAX_ROWS, plan_router_split, split_logits_ok

    assert plan_router_split(1, 384, 7168, 132) == dict(
        n_eblk=12, nsplit=14, n_rgrp=1, BLOCK_T=1, BLOCK_E=32, K_CHUNK=512, NSPLIT_P2=16, USE_DOT=False)
    for t in (1, 2, 4, 5, 16, 33, SPLIT_MAX_ROWS):
        for e, hidden, sms in ((384, 7168, 132), (256, 7168, 132), (256, 7168, 78), (64, 700, 64), (8, 100, 4)):
            p = plan_router_split(t, e, hidden, sms)
            assert (p["nsplit"] - 1) * p["K_CHUNK"] < hidden <= p["nsplit"] * p["K_CHUNK"], (t, e, hidden, p)
            assert p["USE_DOT"] == (t > 4) and p["BLOCK_E"] * p["K_CHUNK"] <= 32 * 512
            assert (p["n_rgrp"] - 1) * p["BLOCK_T"] < t <= p["n_rgrp"] * p["BLOCK_T"] and p["BLOCK_T"] <= 16
            assert p["nsplit"] <= p["NSPLIT_P2"] <= 16
    bf, f32 = torch.bfloat16, torch.float32
    assert split_logits_ok(SPLIT_MAX_ROWS, 384, 8, bf, bf) and not split_logits_ok(SPLIT_MAX_ROWS + 1, 384, 8, bf, bf)
    assert split_logits_ok(4, 384, 8, bf, f32) and not split_logits_ok(5, 384, 8, bf, f32)  # mixed: FMA rows only
    assert split_logits_ok(4, 384, 8, f32, f32) and not split_logits_ok(5, 384, 8, f32, f32)
    assert not split_logits_ok(0, 384, 8, bf, bf) and not split_logits_ok(1, 1024, 8, bf, bf)
