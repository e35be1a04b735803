"""The drafter's fused proposal: q/k norm + rotary with in-kernel cos/sin, silu * up, the stacked
weights, and the whole fused `propose` against the plain torch one. Triton runs under the
interpreter on CPU (tests/kernels/conftest.py); the interpreter truncates float32 -> bfloat16
where a GPU rounds to nearest, so each bf16 rounding may be one unit off (test_norm_rope.py)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from treeflash import kernels  # noqa: E402
from treeflash.config import RopeConfig  # noqa: E402
from treeflash.kernels import reference  # noqa: E402
from treeflash.models.layers import Rotary  # noqa: E402

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16


def _units(dtype):
    return torch.finfo(dtype).eps


def _rotary(dtype, yarn=False) -> Rotary:
    rope = RopeConfig(theta=10000.0) if not yarn else RopeConfig(
        theta=10000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=128)
    return Rotary(rope, 64, interleave=False).to(dtype)  # module.to: inv_freq becomes dtype


def _tables_from_kernel(rot: Rotary, positions: torch.Tensor, dtype):
    """The kernel's own cos/sin: rotate x = (1, .., 1 | 0, .., 0) without a norm, so
    o1 = r(1 * c) - r(0 * s) = c and o2 = r(0 * c) + r(1 * s) = s, exactly."""
    half = rot.inv_freq.shape[0]
    x = torch.cat([torch.ones(half), torch.zeros(half)]).to(dtype)
    q = x.expand(*positions.shape, 1, 2 * half).contiguous()
    qo, _ = kernels.qk_norm_rope(q, q.clone(), positions, rot.inv_freq, None, None, 1e-6, 1e-6, False,
                                 rot.scale, impl="triton")
    return qo[..., 0, :half], qo[..., 0, half:]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
@pytest.mark.parametrize("yarn", [False, True])
def test_in_kernel_tables_are_rotary_cos_sin(dtype, yarn):
    """cos/sin from positions inside the kernel = Rotary.cos_sin's tables. Positions to 5000
    with a half inv_freq buffer: the product must be float32 (the 2026-12-03 bug, a bf16 product,
    is off by many units past 256). The interpreter's cos / sin are numpy's float32 ones, not
    torch's (they differ by a float32 unit in ~15% of these angles), so: exact against numpy's
    cos / sin of torch's float32 product (times the scale, rounded to fp16 as torch rounds:
    the arithmetic is then the same); against Rotary.cos_sin, a float32 unit (times the scale)
    in float32 and one unit of the result in the half types (the libraries' unit can cross a
    rounding boundary; bf16: the interpreter's truncating cast too)."""
    rot = _rotary(dtype, yarn)
    assert rot.inv_freq.dtype == dtype and (rot.scale != 1.0) == yarn
    g = torch.Generator().manual_seed(1)
    positions = torch.cat([torch.arange(0, 40), torch.randint(300, 5000, (40,), generator=g)]).view(2, 40)
    want_c, want_s = rot.cos_sin(positions, dtype)
    got_c, got_s = _tables_from_kernel(rot, positions, dtype)
    freqs = (positions[..., None].float() * rot.inv_freq).numpy()  # Rotary.cos_sin's product
    scale = np.float32(rot.scale)
    for got, want, fn in ((got_c, want_c, np.cos), (got_s, want_s, np.sin)):
        assert got.dtype == want.dtype == dtype
        same_math = torch.from_numpy(fn(freqs) * scale if yarn else fn(freqs))
        if dtype != BF16:
            assert torch.equal(got, same_math.to(dtype))
        err = (got.float() - want.float()).abs()
        if dtype == FP32:
            assert (err <= _units(FP32) * rot.scale).all()
        else:
            assert (err <= _units(dtype) * want.float().abs() * 1.01).all()
    if dtype == BF16:  # what the bf16 product would give: far outside the bound above
        bad = (positions[..., None] * rot.inv_freq).float().cos().to(dtype)
        assert ((bad.float() - want_c.float()).abs() > 4 * _units(dtype)).any()


def _qk_close(got, want, x, cos, sin, dtype, norm):
    """float32: to 1e-5 (numpy's cos/sin and rsqrt against torch's). Half types: the bound of
    test_norm_rope._rope_close in units of the rotation's terms |x1 c| + |x2 s| (x the normed
    input): two products and the sum (3), the norm's two roundings (2), and the tables'
    own rounding (2: c and s each a unit off under the interpreter)."""
    if dtype == FP32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    units = 3 + 2 * norm + 2 + 0.01
    xf, c, s = x.float().abs(), cos.float().abs().unsqueeze(-2), sin.float().abs().unsqueeze(-2)
    x1, x2 = xf.chunk(2, -1)
    terms = torch.cat([x1 * c + x2 * s, x2 * c + x1 * s], -1)
    assert ((got.float() - want.float()).abs() <= units * _units(dtype) * terms).all()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
@pytest.mark.parametrize("yarn", [False, True])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_in_place_on_qkv_slices(dtype, yarn, norm):
    """q and k as column slices of one [B, Q, (Hq + 2 Hkv) D] GEMM output, rotated in place in
    one launch; v untouched. Against the torch twin (rms_norm, then rope with Rotary's tables)."""
    g = torch.Generator().manual_seed(2)
    b, nq, hq, hkv, d = 2, 5, 4, 2, 64
    rot = _rotary(dtype, yarn)
    qkv = (torch.randn(b, nq, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    q = qkv[..., : hq * d].unflatten(-1, (hq, d))
    k = qkv[..., hq * d : (hq + hkv) * d].unflatten(-1, (hkv, d))
    v_before = qkv[..., (hq + hkv) * d :].clone()
    wq = (1 + torch.randn(d, generator=g) * 0.1).to(dtype) if norm else None
    wk = (1 + torch.randn(d, generator=g) * 0.1).to(dtype) if norm else None
    positions = torch.randint(0, 4000, (b, nq), generator=g)
    want_q, want_k = kernels.qk_norm_rope(q.clone(), k.clone(), positions, rot.inv_freq, wq, wk, 1e-6, 1e-5,
                                          False, rot.scale, impl="torch")
    cos, sin = rot.cos_sin(positions, dtype)  # the torch twin's tables are Rotary's, exactly
    torch.testing.assert_close(kernels.rope_tables(positions, rot.inv_freq, rot.scale, dtype), (cos, sin),
                               atol=0, rtol=0)
    normed_q = q.clone() if wq is None else reference.rms_norm(q, wq, 1e-6)
    normed_k = k.clone() if wk is None else reference.rms_norm(k, wk, 1e-5)
    q_in, k_in = q.clone(), k.clone()
    kernels.qk_norm_rope(q, k, positions, rot.inv_freq, wq, wk, 1e-6, 1e-5, False, rot.scale,
                         out_q=q, out_k=k, impl="triton")
    assert torch.equal(qkv[..., (hq + hkv) * d :], v_before)
    _qk_close(q, want_q, normed_q, cos, sin, dtype, norm)
    _qk_close(k, want_k, normed_k, cos, sin, dtype, norm)
    # out of place, interleaved pairs: the same kernel body as kernels.rope (test_norm_rope.py)
    got_q, got_k = kernels.qk_norm_rope(q_in, k_in, positions, rot.inv_freq, wq, wk, 1e-6, 1e-5, True,
                                        rot.scale, impl="triton")
    ref_q = reference.rope(q_in, cos, sin, True, norm_weight=wq, eps=1e-6)
    ref_k = reference.rope(k_in, cos, sin, True, norm_weight=wk, eps=1e-5)
    _qk_close(got_q, ref_q, _deinterleave(normed_q), cos, sin, dtype, norm)
    _qk_close(got_k, ref_k, _deinterleave(normed_k), cos, sin, dtype, norm)


def _deinterleave(x):
    return torch.cat([x[..., 0::2], x[..., 1::2]], -1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
@pytest.mark.parametrize("n", [48, 512, 3000])
def test_silu_mul_matches_torch(dtype, n):
    """silu(gate) * up on the two halves of one gate_up output. float32: to 1e-6 relative
    (numpy's exp against torch's; the division and product are the same IEEE operations).
    Half types: two roundings (the silu, then the product), each a unit at most under the
    interpreter's truncation -> 2 units of the result; fp16 rounds as torch: nearly all equal."""
    g = torch.Generator().manual_seed(n)
    gu = (torch.randn(3, 4, 2 * n, generator=g) * 4).to(dtype)
    gate, up = gu[..., :n], gu[..., n:]
    got = kernels.silu_mul(gate, up, impl="triton")
    want = torch.nn.functional.silu(gate) * up
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == FP32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        return
    bound = 2.01 * _units(dtype) * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((got.float() - want.float()).abs() <= bound).all()
    if dtype == FP16:
        assert (got == want).float().mean() > 0.99
    out = torch.empty_like(got)
    assert kernels.silu_mul(gate, up, out=out, impl="triton") is out and torch.equal(out, got)


# ---- the drafter ----------------------------------------------------------------------------

def _drafter(tmp_path, dtype, **kw):
    from helpers.drafter import target_heads, write_drafter
    from treeflash.models.drafter import DFlashDrafter

    path = write_drafter(tmp_path / "d", seed=5, **kw)
    raw = json.loads((path / "config.json").read_text())
    embed, head = target_heads(raw["vocab_size"], raw["hidden_size"])
    return DFlashDrafter.from_pretrained(path, embed, head, dtype=dtype)


def _shares(param, buf):
    """param's storage lies inside buf's (the re-homed parameter is a view of the stack)."""
    lo, n = buf.data_ptr(), buf.numel() * buf.element_size()
    return lo <= param.data_ptr() < lo + n


def test_stacked_weights_share_the_parameters_storage_and_follow_them(tmp_path):
    """The proposal's per-layer q/k/v stack, the append's all-layer k/v operand and the MLP's
    gate/up stack are the parameters' own storage (no second copy of the weights: a Kimi-sized
    drafter would hold its k/v three times and gate/up twice otherwise), and follow in-place
    updates, new tensors and an optimizer step."""
    from treeflash.models.drafter import _layered_qkv

    d = _drafter(tmp_path, FP32)
    attns = [layer.self_attn for layer in d.layers]
    attn, mlp = attns[0], d.layers[0].mlp
    ref = [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).clone() for a in attns]
    w, bias = _layered_qkv(d, attns)
    hq, hkv, dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
    assert bias is None and w.shape == (len(attns), (hq + 2 * hkv) * dh, d.cfg.hidden_size)
    assert all(torch.equal(w[i], ref[i]) for i in range(len(attns)))
    assert all(_shares(m.weight, w) for a in attns for m in (a.q_proj, a.k_proj, a.v_proj))
    assert _layered_qkv(d, attns)[0] is w  # cached
    kvw, kvb = d._kv_weight()
    assert kvb is None and kvw.data_ptr() == w[:, hq * dh:].data_ptr()  # a view, not a copy
    assert torch.equal(kvw[1], torch.cat([attns[1].k_proj.weight, attns[1].v_proj.weight]))
    gu = mlp.gate_up_weight()
    assert torch.equal(gu, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])) and mlp.gate_up_weight() is gu
    assert _shares(mlp.gate_proj.weight, gu) and _shares(mlp.up_proj.weight, gu)
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)  # in place: the stack is the same memory
        mlp.up_proj.weight.copy_(torch.ones_like(mlp.up_proj.weight))
    w2 = _layered_qkv(d, attns)[0]
    assert torch.equal(w2[0, hq * dh:(hq + hkv) * dh], attn.k_proj.weight)
    assert torch.equal(w2[0, hq * dh:(hq + hkv) * dh], 2 * ref[0][hq * dh:(hq + hkv) * dh])
    assert torch.equal(mlp.gate_up_weight()[mlp.gate_proj.out_features:], torch.ones_like(mlp.up_proj.weight))
    attn.v_proj.weight = torch.nn.Parameter(torch.zeros_like(attn.v_proj.weight))  # a new tensor
    w3 = _layered_qkv(d, attns)[0]
    assert torch.equal(w3[0, -attn.v_proj.out_features:], attn.v_proj.weight) and _shares(attn.v_proj.weight, w3)
    # training after re-homing: the optimizer's in-place step reaches the stack
    opt = torch.optim.SGD(d.parameters(), lr=0.5)
    x = torch.randn(3, d.cfg.hidden_size)
    (attn.k_proj(x).sum() + mlp(x).sum()).backward()
    opt.step()
    assert torch.equal(_layered_qkv(d, attns)[0][0, hq * dh:(hq + hkv) * dh], attn.k_proj.weight)
    assert torch.equal(mlp.gate_up_weight()[: mlp.gate_proj.out_features], mlp.gate_proj.weight)


def test_mixed_dtype_projections_are_not_rehomed(tmp_path):
    """A layer whose k_proj was cast alone keeps its dtype: the stack is a promoted copy."""
    from treeflash.models.drafter import _layered_qkv

    d = _drafter(tmp_path, FP32)
    attns = [layer.self_attn for layer in d.layers]
    attns[0].k_proj.to(torch.float64)
    w, _ = _layered_qkv(d, attns)
    assert attns[0].k_proj.weight.dtype == torch.float64 and w.dtype == torch.float64
    assert not _shares(attns[0].k_proj.weight, w)
    rows = attns[0].q_proj.out_features
    assert torch.equal(w[0, rows:rows + attns[0].k_proj.out_features], attns[0].k_proj.weight)


def test_rehomed_drafter_exports(tmp_path):
    """A drafter whose weights share the stacks' storage saves and loads back as it was (the
    export writes each tensor as its own copy: `cpu_copies`)."""
    from safetensors.torch import load_file, save_file

    from treeflash.bench.export import cpu_copies
    from treeflash.models.drafter import _layered_qkv

    d = _drafter(tmp_path, FP32)
    _layered_qkv(d, [layer.self_attn for layer in d.layers])
    d.layers[0].mlp.gate_up_weight()
    save_file(cpu_copies(d.state_dict()), str(tmp_path / "model.safetensors"))
    state = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(state[k], v) for k, v in d.state_dict().items())


def _features(d, t, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, d.cfg.num_taps * d.cfg.hidden_size, generator=g)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
MIXED = ("sliding_attention", "full_attention", "sliding_attention")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("batch, static", [(1, True), (1, False), (2, False)])
@pytest.mark.parametrize("yarn", [False, True])
def test_fused_propose_matches_torch_propose(tmp_path, dtype, batch, static, yarn):
    """fused_kernels="triton" (the CUDA path's kernels, interpreted) against the plain torch ops,
    the same drafter and caches; positions past 256 (a bf16 rotary product would show there).
    float32: 2e-5 (test_drafter.py's tolerance against the z-lab reference: rounding only).
    bf16: the two paths differ by bf16 roundings (the interpreter's truncation, the stacked
    GEMMs' order), which three layers carry into the logits. The scale of that is the bf16
    torch path's own distance from the float32 model (what bf16 rounding does to these
    logits); the fused path may differ from the torch path by twice that: the interpreter's
    truncating casts err up to a unit where round-to-nearest errs half of one (seen, seeded:
    1.1-1.8 x)."""
    from treeflash.models.layers import set_options
    from treeflash.runtime import RuntimeOptions

    kw = dict(layer_types=MIXED, sliding_window=5, block_size=6, max_position_embeddings=8192)
    if yarn:
        kw["rope_scaling"] = YARN
    model = _drafter(tmp_path, dtype, **kw)
    lengths = [40, 17][:batch]
    base = 700  # the committed context sits at positions base .. base + t - 1
    caches = []
    for i, t in enumerate(lengths):
        c = model.new_cache()
        model.extend(c, _features(model, t, seed=10 + i), torch.arange(base, base + t))
        caches.append(c)
    bonus = torch.tensor([5, 9][:batch])
    start = torch.tensor([base + t for t in lengths])

    def run(impl, m=model):
        set_options(m, RuntimeOptions(fused_kernels=impl))
        return m.propose(caches if m is model else fp32_caches, bonus, start, static=static)

    got, want = run("triton"), run(None)
    assert got.shape == want.shape == (batch, 5, 64) and got.dtype == want.dtype == dtype
    if dtype == FP32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        return
    fp32 = _drafter(tmp_path, FP32, **kw)
    fp32_caches = []
    for i, t in enumerate(lengths):
        c = fp32.new_cache()
        fp32.extend(c, _features(fp32, t, seed=10 + i), torch.arange(base, base + t))
        fp32_caches.append(c)
    truth = run(None, fp32)
    bf16_err = (want.float() - truth).abs().max()
    assert (got.float() - want.float()).abs().max() <= 2 * bf16_err
