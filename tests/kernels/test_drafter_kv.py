"""The drafter's one-launch cache append (kernels/drafter_kv.py): the Triton kernel (interpreter
on CPU) against its torch twin, both against `LayerKV.write_at` (the slots and kept rows), and
`DFlashDrafter.extend_static`'s fused path against its per-layer path (impl="torch").

Tolerances. Slots, positions and v are moved, not computed: equal bits everywhere, and every
slot an append does not write keeps its bits. k is computed: fp32 to 1e-5 (numpy's cos/sin and
rsqrt under the interpreter against torch's, a unit or two of float32); fp16 within the same
unit bound as bf16; bf16 within `UNITS` units (bf16 eps) of the terms |x1 c| + |x2 s| of each
rotated element, as tests/kernels/test_norm_rope.py bounds the fused norm + rotary (5.01: two
roundings of the norm, the two products and the sum), plus one for cos/sin, which the kernel
rounds to bf16 itself: the interpreter truncates float32 -> bf16 where torch (and a GPU) rounds,
so a unit per rounding. The twin runs torch's ops of the per-layer path: equal bits to it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from treeflash import kernels  # noqa: E402
from treeflash.kernels import drafter_kv, reference  # noqa: E402
from treeflash.models.drafter_cache import LayerKV  # noqa: E402
from treeflash.models.layers import set_options  # noqa: E402
from treeflash.runtime import RuntimeOptions  # noqa: E402

UNITS = 6.01
H, D = 2, 16


def _inv_freq(dtype):
    return (1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)).to(dtype)


def _rows(t, n_layers, dtype, g):
    kv = (torch.randn(t, n_layers * 2 * H * D, generator=g) * 3).to(dtype)
    weights = [(1 + 0.2 * torch.randn(D, generator=g)).to(dtype) for _ in range(n_layers)]
    return kv, weights


def _caches(specs, dtype, start, g):
    """(k, v, pos, ring) per layer from (capacity, ring) specs: random K/V, positions < start."""
    out = []
    for cap, ring in specs:
        k = torch.randn(H, cap, D, generator=g).to(dtype)
        v = torch.randn(H, cap, D, generator=g).to(dtype)
        pos = torch.randint(-1, max(start, 1), (cap,), generator=g)
        out.append((k, v, pos, ring))
    return out


def _clone(caches):
    return [(k.clone(), v.clone(), p.clone(), ring) for k, v, p, ring in caches]


def _run(impl, kv, start, first, count, caches, weights, dtype, scale=1.0):
    layers = [(k, v, p, w, ring) for (k, v, p, ring), w in zip(caches, weights, strict=True)]
    kernels.drafter_kv_write(kv, torch.tensor([start]), torch.tensor(first), None if count is None else
                             torch.tensor([count]), layers, _inv_freq(dtype), scale, False, 1e-6, impl=impl)


def _terms(kv, layer, w, start, rows, dtype, scale=1.0, inv=None, h=H):
    """|x1 c| + |x2 s| per element of the rotated k rows `rows` of `layer` ([h, len(rows), D],
    D = the k_norm weight's size); inv: inv_freq (None: this file's)."""
    inv = _inv_freq(dtype) if inv is None else inv
    k = kv[rows].unflatten(-1, (-1, 2, h, w.numel()))[:, layer, 0]  # [rows, h, D]
    xn = reference.rms_norm(k, w, 1e-6).float().abs().transpose(0, 1)
    f = (start + rows)[:, None].float() * inv
    c, s = (f.cos() * scale).to(dtype).float().abs(), (f.sin() * scale).to(dtype).float().abs()
    x1, x2 = xn.chunk(2, -1)
    return torch.cat([x1 * c + x2 * s, x2 * c + x1 * s], -1)


def _check_k(got, want, before, kv, layer, w, start, want_pos, dtype, scale=1.0, inv=None, h=H):
    """Unwritten slots (want_pos < start) keep their bits (`before`, None: all are written);
    written ones within the bound."""
    old = want_pos < start
    if before is not None:
        assert torch.equal(got[:, old], before[:, old]) and torch.equal(want[:, old], before[:, old])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    slots = (~old).nonzero()[:, 0]
    terms = _terms(kv, layer, w, start, want_pos[slots] - start, dtype, scale, inv, h)
    err = (got[:, slots].float() - want[:, slots].float()).abs()
    assert (err <= UNITS * torch.finfo(dtype).eps * terms).all(), (err / (torch.finfo(dtype).eps * terms)).max()


# (capacity, ring) per layer: a full layer, rings of 3 and 8 (smaller and larger than some
# appends), an empty ring (window 1: skipped) and a second full layer: 5 layers, two launches
SPECS = [(40, False), (3, True), (8, True), (0, True), (24, False)]
FIRST = [5, 2, 6, 0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t, count", [(1, None), (1, 1), (16, None), (16, 2), (16, 16), (16, 3), (16, 5),
                                      (6, None), (6, 4), (6, 1), (16, 9)])
def test_kernel_matches_twin(dtype, t, count):
    """count None: every row (a ring of 3 under 16 rows keeps the last 3, as write_at's last
    write does); count < T; count >= a ring's capacity (3, 8: rows count-C..count-1 in slots
    0..C-1); T = 1 and 16; wrap-around of the rings from first slots 2 and 6."""
    g = torch.Generator().manual_seed(t * 100 + (count or 0))
    start = 1234
    kv, weights = _rows(t, len(SPECS), dtype, g)
    caches = _caches(SPECS, dtype, start, g)
    got, want = _clone(caches), _clone(caches)
    _run("triton", kv, start, FIRST, count, got, weights, dtype)
    _run("torch", kv, start, FIRST, count, want, weights, dtype)
    for i, ((kg, vg, pg, _), (kw, vw, pw, _), (k0, _, _, _)) in enumerate(zip(got, want, caches, strict=True)):
        assert torch.equal(pg, pw), f"layer {i}: positions"
        assert torch.equal(vg, vw), f"layer {i}: v"
        _check_k(kg, kw, k0, kv, i, weights[i], start, pw, dtype)
    n = t if count is None else count
    assert int((want[0][2] >= start).sum()) == n  # the full layer took exactly the kept rows


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_and_fp32_inv_freq_in_bf16(dtype):
    """A rotary scale != 1 (YaRN's attention factor) multiplies cos/sin before their rounding;
    positions past 256 keep float32 angles (inv_freq in the model dtype, widened)."""
    g = torch.Generator().manual_seed(5)
    start, specs = 30001, [(20, False), (5, True)]
    kv, weights = _rows(7, 2, dtype, g)
    caches = _caches(specs, dtype, start, g)
    got, want = _clone(caches), _clone(caches)
    _run("triton", kv, start, [3, 4], None, got, weights, dtype, scale=1.1)
    _run("torch", kv, start, [3, 4], None, want, weights, dtype, scale=1.1)
    for i, ((kg, vg, pg, _), (kw, vw, pw, _), (k0, _, _, _)) in enumerate(zip(got, want, caches, strict=True)):
        assert torch.equal(pg, pw) and torch.equal(vg, vw)
        _check_k(kg, kw, k0, kv, i, weights[i], start, pw, dtype, scale=1.1)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 4, 9], ids=["full", "w1-empty-ring", "w4-ring3", "w9-ring8"])
def test_slots_are_write_at(impl, dtype, window):
    """A run of appends (fixed T = 6, masked to counts, through ring wraps, appends of a whole
    ring or more, and a full layer's growth) against LayerKV.write_at of the same k / v: every
    slot's position and v equal bits, k the twin's bits (the same torch ops) or within the
    bound (the kernel)."""
    rows, g = 6, torch.Generator().manual_seed(0)
    ours = LayerKV(H, D, window, torch.device("cpu"), dtype)
    plain = LayerKV(H, D, window, torch.device("cpu"), dtype)
    n = 0
    inv = _inv_freq(dtype)
    for step, t in enumerate((1, 6, 2, 3, 5, 1, 4, 6, 6, 2, 3, 1, 5)):
        kv, (w,) = _rows(rows, 1, dtype, g)
        count = None if step % 4 == 3 and window is None else t  # unmasked appends too (full layer)
        first = ours.reserve(rows)
        assert plain.reserve(rows) == first
        before = ours.k.clone()
        layer = [(ours.k, ours.v, ours.pos, w, window is not None)]
        cnt = None if count is None else torch.tensor([count])
        kernels.drafter_kv_write(kv, torch.tensor([n]), torch.tensor([first]), cnt, layer, inv, 1.0, False, 1e-6,
                                 impl=impl)
        # the per-layer path: Rotary.cos_sin, the norm + rotary, write_at
        positions = n + torch.arange(rows)
        freqs = positions[:, None].float() * inv
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        k = reference.rope(kv[:, :H * D].unflatten(-1, (H, D)), cos, sin, False, norm_weight=w, eps=1e-6)
        v = kv[:, H * D:].unflatten(-1, (H, D))
        plain.write_at(torch.tensor(first), k.transpose(0, 1), v.transpose(0, 1), positions, cnt)
        t_kept = rows if count is None else t
        ours.advance(t_kept)
        plain.advance(t_kept)
        n += t_kept
        assert torch.equal(ours.pos, plain.pos) and torch.equal(ours.v, plain.v)
        if impl == "torch":
            assert torch.equal(ours.k, plain.k)
        else:
            _check_k(ours.k, plain.k, before, kv, 0, w, n - t_kept, plain.pos, dtype)
            ours.k.copy_(plain.k)  # the next step's unwritten slots: compare from equal bits
    assert (ours.n, ours.head) == (plain.n, plain.head)


# ---- DFlashDrafter.extend_static ------------------------------------------------------------
def _drafter(dtype, layer_types, window, bias=False):
    from helpers.drafter import drafter_config, random_state_dict, target_heads
    from treeflash.config import DrafterConfig
    from treeflash.models.drafter import DFlashDrafter

    raw = drafter_config(layer_types=layer_types, sliding_window=window, block_size=6, attention_bias=bias)
    sd = random_state_dict(raw, seed=3)
    if bias:
        g = torch.Generator().manual_seed(4)
        for i in range(len(layer_types)):
            for name, n in (("q", 4), ("k", 2), ("v", 2), ("o", 0)):
                rows = 32 if name == "o" else n * 8
                sd[f"layers.{i}.self_attn.{name}_proj.bias"] = 0.1 * torch.randn(rows, generator=g)
    embed, head = target_heads(64, 32)
    return DFlashDrafter.from_state_dict(DrafterConfig.from_hf(raw), sd, embed, head, dtype=dtype)


def _stacked_gemm_is_exact(drafter, ctx):
    """The batched k/v GEMM over every layer (`_layers_linear` on the shared q/k/v stack)
    equals the per-layer ones bit for bit (CPU's GEMMs here do)."""
    from treeflash.models.drafter import _layers_linear

    w, b = drafter._kv_weight()
    per_layer = [torch.cat([F.linear(ctx, m.weight, m.bias) for m in (layer.self_attn.k_proj,
                                                                      layer.self_attn.v_proj)], -1)
                 for layer in drafter.layers]
    return torch.equal(_layers_linear(ctx, w, b), torch.stack(per_layer))


def _compare(drafter, caches, feats, start):
    """Per fused mode, the fused path's cache against the per-layer path's, after an append at
    `start`: n / head / capacity, positions and v equal; k equal ("torch") or, for the slots
    this append wrote, within the bound ("triton"), then made equal for the next append."""
    for mode in ("torch", "triton"):
        set_options(drafter, RuntimeOptions(fused_kernels=mode))
        with torch.no_grad():
            ctx = drafter.hidden_norm(drafter.fc(feats))
            # the equalities below assume the stacked GEMM rounds as the per-layer ones
            assert _stacked_gemm_is_exact(drafter, ctx)
            kv = torch.cat([F.linear(ctx, m.weight, m.bias) for layer in drafter.layers
                            for m in (layer.self_attn.k_proj, layer.self_attn.v_proj)], -1)
        a_cache, b_cache = caches[mode, "per-layer"], caches[mode, "fused"]
        assert a_cache.seq_len == b_cache.seq_len
        for i, (a, b) in enumerate(zip(a_cache.layers, b_cache.layers, strict=True)):
            assert (a.n, a.head, a.capacity) == (b.n, b.head, b.capacity)
            assert torch.equal(a.pos, b.pos), (mode, i)
            assert torch.equal(a.v, b.v), (mode, i)
            if mode == "torch":
                assert torch.equal(a.k, b.k), i
                continue
            new = a.pos >= start  # this append's slots; every other slot as before
            assert torch.equal(a.k[:, ~new], b.k[:, ~new]), i
            _check_k(b.k[:, new], a.k[:, new], None, kv, i, drafter.layers[i].self_attn.k_norm.weight, start,
                     a.pos[new], feats.dtype, drafter.rotary.scale, drafter.rotary.inv_freq,
                     drafter.cfg.num_key_value_heads)
            b.k.copy_(a.k)  # compare the next append from equal bits


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_extend_static_fused_matches_per_layer_path(dtype, masked, bias):
    """Appends of a block of 6 rows (masked to counts 1..6 through rings of 3 that wrap and are
    overwritten whole; or unmasked, rings of 8) and a full layer that grows, per fused mode
    (RuntimeOptions.fused_kernels): "torch" (the CPU ops), the fused path (stacked GEMM + twin) gives the
    per-layer path's bits; "triton" (what CUDA runs: the per-layer path with the fused norm and
    rotary kernels), the fused path with the kernel the same slots, positions and v, and k
    within the bound (the kernel's own cos/sin are its only other rounding)."""
    types = ("sliding_attention", "full_attention", "sliding_attention")
    drafter = _drafter(dtype, types, 4 if masked else 9, bias)
    rows = drafter.block_size
    width = drafter.cfg.num_taps * drafter.cfg.hidden_size
    g = torch.Generator().manual_seed(9)
    runs = [(mode, path) for mode in ("torch", "triton") for path in ("per-layer", "fused")]
    caches = {run: drafter.new_cache() for run in runs}
    n = 0
    for t in (4, 1, 3, 6, 6, 6, 2, 5):  # rings of 3 wrap, are overwritten whole; the full layer grows
        feats = torch.randn(rows, width, generator=g).to(dtype)
        count = torch.tensor([t]) if masked else None
        kept = t if masked else rows
        for (mode, path), cache in caches.items():
            set_options(drafter, RuntimeOptions(fused_kernels=mode))
            first = torch.tensor(cache.reserve(rows))
            drafter.extend_static(cache, feats, torch.tensor([n]), first, count,
                                  impl="torch" if path == "per-layer" else None)
            cache.advance(kept)
        _compare(drafter, caches, feats, n)
        n += kept
    assert max(kv.capacity for kv in caches["triton", "fused"].layers) > 16  # the full layer grew


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_shares_the_fused_path(dtype):
    """extend() (prefill, the eager steps) through the fused append, masked to all its rows:
    append()'s slots, n and head, through a prefill longer than the rings of 3 (the last rows
    kept), default and given positions, and a full layer that grows."""
    types = ("sliding_attention", "full_attention", "sliding_attention")
    drafter = _drafter(dtype, types, 4, False)
    width = drafter.cfg.num_taps * drafter.cfg.hidden_size
    g = torch.Generator().manual_seed(2)
    runs = [(mode, path) for mode in ("torch", "triton") for path in ("per-layer", "fused")]
    caches = {run: drafter.new_cache() for run in runs}
    n = 0
    for step, t in enumerate((11, 1, 5, 2, 16, 3)):
        feats = torch.randn(t, width, generator=g).to(dtype)
        for (mode, path), cache in caches.items():
            set_options(drafter, RuntimeOptions(fused_kernels=mode))
            positions = None if step % 2 else torch.arange(n, n + t)
            drafter.extend(cache, feats, positions, impl="torch" if path == "per-layer" else None)
        _compare(drafter, caches, feats, n)
        n += t
    assert caches["triton", "fused"].layers[0].capacity == 3
    assert max(kv.capacity for kv in caches["triton", "fused"].layers) > 16


@pytest.mark.slow
def test_extend_static_uses_one_write_launch(monkeypatch):
    """The fused path: fc, hidden_norm, one k/v GEMM and kernels.drafter_kv_write once."""
    drafter = _drafter(torch.float32, ("sliding_attention", "full_attention"), 8)
    set_options(drafter, RuntimeOptions(fused_kernels="triton"))
    calls = []
    real = drafter_kv.drafter_kv_write_triton

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(drafter_kv, "drafter_kv_write_triton", spy)
    gemms = []
    real_linear, real_bmm = F.linear, torch.bmm
    monkeypatch.setattr(F, "linear", lambda *a, **k: gemms.append(("linear", a[1].shape)) or real_linear(*a, **k))
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: gemms.append(("bmm", a[1].shape)) or real_bmm(*a, **k))
    cache = drafter.new_cache()
    first = torch.tensor(cache.reserve(6))
    drafter.extend_static(cache, torch.randn(6, 64), torch.tensor([0]), first, torch.tensor([4]))
    assert len(calls) == 1
    assert calls[0][0].shape == (2, 6, 2 * 2 * 8)  # [L, T, 2 Hkv D], the batched GEMM's output
    assert gemms == [("linear", (32, 64)), ("bmm", (2, 32, 2 * 2 * 8))]  # fc, then every layer's k and v


@pytest.mark.slow
def test_kv_write_takes_the_batched_layout():
    """kernels.drafter_kv_write on [L, T, 2 Hkv D] with a layer stride that is not T x 2 Hkv D
    (a strided view, as the shared q/k/v stack's GEMM may give) writes what the [T, L x 2 Hkv D]
    form of the same values writes: both impls."""
    g = torch.Generator().manual_seed(5)
    n_layers, t, h, d = 3, 5, 2, 8
    big = torch.randn(n_layers, t, 3 * 2 * h * d, generator=g)
    kv3 = big[:, :, 2 * h * d:4 * h * d]  # layer stride 3 x its row: not a contiguous block
    kv2 = kv3.permute(1, 0, 2).reshape(t, -1).contiguous()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    for impl in ("torch", "triton"):
        outs = []
        for kv in (kv2, kv3):
            layers = [(torch.zeros(h, 8, d), torch.zeros(h, 8, d), torch.full((8,), -1, dtype=torch.long),
                       torch.ones(d), ring) for ring in (False, True, False)]
            kernels.drafter_kv_write(kv, torch.tensor([7]), torch.tensor([1, 2, 0]), None, layers, inv_freq,
                                     1.0, False, 1e-6, impl=impl)
            outs.append(layers)
        for a, b in zip(*outs, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3], strict=True)), impl
        assert (outs[1][0][2] >= 0).sum() == t  # the rows were written
    with pytest.raises(ValueError, match="unit column stride"):
        kernels.drafter_kv_write(big[:, :, ::2][:, :, :2 * h * d], torch.tensor([0]), torch.tensor([0, 0, 0]),
                                 None, outs[0], inv_freq, 1.0, False, 1e-6, impl="torch")


def test_kv_weight_follows_weight_changes():
    drafter = _drafter(torch.float32, ("full_attention",) * 2, None)
    w0, _ = drafter._kv_weight()
    assert drafter._kv_weight()[0].data_ptr() == w0.data_ptr()  # cached: a view of the same stack
    with torch.no_grad():
        drafter.layers[1].self_attn.v_proj.weight.mul_(2)
    w1, _ = drafter._kv_weight()
    assert torch.equal(w1[1, -16:], drafter.layers[1].self_attn.v_proj.weight)
    drafter.layers[1].self_attn.v_proj.weight = torch.nn.Parameter(torch.ones(16, 32))  # a new tensor
    assert torch.equal(drafter._kv_weight()[0][1, -16:], torch.ones(16, 32))
