"""MLA verify attention over fp8_e4m3 rows (`kvcache.format`): every implementation (Triton
interpreter on CPU) against the float64 reference on the decoded cache, over caches whose
unused slots are 0xFF bytes (codes, scales and k_pe NaN), trees, chains, odd lengths and
batches; the dispatch table's fp8 rows; the Hopper fp8 kernel's launch without a GPU."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from treeflash.kernels import mla_verify_attention, reference  # noqa: E402
from treeflash.kernels.mla_verify import (  # noqa: E402
    GATHERED,
    HOPPER,
    PORTABLE,
    PORTABLE_TREE,
    KernelConfig,
    dispatch,
    mla_verify_attention_triton,
    portable,
    tile,
)
from treeflash.kernels.testing import (  # noqa: E402
    LSE_TOLERANCES,
    assert_close,
    random_paged_kv,
    random_tree_masks,
)

FP8 = torch.uint8  # a cache of fp8_e4m3 rows


def _case(b_lens, n, h, d, v_dim, page_size, layout, tree, q_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    kv = random_paged_kv([p + n for p in b_lens], d, page_size, FP8, layout, generator=g, v_dim=v_dim)
    q = torch.randn(len(b_lens), n, h, d, generator=g).to(q_dtype)
    mask = None if tree == "chain" else random_tree_masks(len(b_lens), n, g, bushy=tree == "bushy")
    return q, kv, torch.tensor(b_lens, dtype=torch.int32), mask


def _check(q, kv, prefix, mask, v_dim, **kw):
    """Against the float64 reference over the decoded rows (the fp8 cache decoded exactly)."""
    scale = q.shape[-1] ** -0.5
    out, lse = mla_verify_attention_triton(q, kv.kv_cache, kv.page_table, prefix, mask, scale, v_dim, **kw)
    ref_out, ref_lse = reference.mla_verify_attention(q.double(), kv.kv_cache, kv.page_table, prefix, mask,
                                                      scale, v_dim)
    assert out.dtype == q.dtype and torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close(out, ref_out, q.dtype)
    assert_close(lse, ref_lse, q.dtype, "lse", LSE_TOLERANCES)


CASES = [
    # b_lens (prefix per request), N, H, D, v_dim, page_size, layout, tree
    ([37], 1, 4, 48, 32, 1, "scattered", "chain"),
    ([5, 70], 3, 2, 48, 32, 16, "contiguous", "bushy"),
    ([0, 23, 41], 17, 2, 48, 32, 4, "scattered", "bushy"),
    ([29], 17, 1, 48, 32, 64, "contiguous", "chain"),
    ([11, 3], 5, 3, 40, 32, 3, "scattered", "deep"),
    ([50], 4, 4, 32, 32, 8, "contiguous", "bushy"),  # no rope part: D == v_dim
]
CONFIGS = {
    "gathered": KernelConfig(GATHERED, 16, 16, 4, 1, wave_plan=False),
    "portable": KernelConfig(PORTABLE, 16, 16, 4, 1),
    "portable-tma": KernelConfig(PORTABLE, 16, 16, 4, 1, tma=True),
    "tree": KernelConfig(PORTABLE_TREE, 16, 16, 4, 1),
    "tree-tma": KernelConfig(PORTABLE_TREE, 16, 16, 4, 1, tma=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("b_lens,n,h,d,v_dim,page_size,layout,tree", CASES)
def test_every_implementation_matches_the_reference_fp32(name, b_lens, n, h, d, v_dim, page_size, layout, tree):
    """fp32 q: the dots in float32 over the decoded rows (float32 products code x scale)."""
    q, kv, prefix, mask = _case(b_lens, n, h, d, v_dim, page_size, layout, tree, torch.float32, 9)
    _check(q, kv, prefix, mask, v_dim, config=CONFIGS[name])


@pytest.mark.slow
@pytest.mark.parametrize("name,q_dtype", [(name, torch.bfloat16) for name in sorted(CONFIGS)]
                         + [("tree-tma", torch.float16), ("portable", torch.float16)])
def test_half_precision_queries_and_splits(name, q_dtype):
    """16-bit q: decoded to q's dtype in the tile; many full tiles per split, a tail, empty splits."""
    q, kv, prefix, mask = _case([150, 37], 5, 3, 48, 32, 16, "contiguous", "bushy", q_dtype, 10)
    for splits in (None, 40):
        _check(q, kv, prefix, mask, 32, config=CONFIGS[name], num_splits=splits)


@pytest.mark.slow
def test_tree_kernel_is_the_one_that_runs(monkeypatch):
    """A silent fallback to the portable kernel would still pass the tree configs: count launches."""
    launches, run = [], portable._portable_tree_kernel.run
    monkeypatch.setattr(portable._portable_tree_kernel, "run",
                        lambda *a, **k: launches.append(k["KV_FP8"]) or run(*a, **k))
    q, kv, prefix, mask = _case([29, 13], 5, 3, 48, 32, 16, "contiguous", "bushy", torch.bfloat16, 3)
    _check(q, kv, prefix, mask, 32, config=CONFIGS["tree-tma"], num_splits=2)
    assert launches == [True]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["portable-tma", "tree-tma", "gathered"])
def test_deepseek_geometry(name):
    """D 576 / v_dim 512: 656-byte rows, four scale groups, TMA boxes over the codes and k_pe."""
    q, kv, prefix, mask = _case([40, 7], 4, 2, 576, 512, 16, "contiguous", "bushy", torch.bfloat16, 12)
    assert kv.kv_cache.shape[-1] == 656
    _check(q, kv, prefix, mask, 512, config=CONFIGS[name], num_splits=2)


@pytest.mark.slow
def test_default_dispatch_over_fp8_rows():
    """impl=None: the table's choice for the interpreter (page 1: gathered; page 16: the tree
    kernel above 16 rows), and the public function's torch path on the same cache."""
    for page, layout in ((1, "scattered"), (16, "contiguous")):
        q, kv, prefix, mask = _case([90, 13], 5, 4, 48, 32, page, layout, "bushy", torch.bfloat16, 14)
        _check(q, kv, prefix, mask, 32)
        t = mla_verify_attention(q, kv.kv_cache, kv.page_table, prefix, mask, 0.2, 32, impl="triton")
        r = mla_verify_attention(q, kv.kv_cache, kv.page_table, prefix, mask, 0.2, 32, impl="torch")
        assert_close(t[0], r[0], torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("config", [CONFIGS["gathered"], CONFIGS["portable"], CONFIGS["tree-tma"]],
                         ids=["gathered", "portable", "tree-tma"])
def test_page_table_wider_than_the_requests(config):
    """A CUDA graph's bucketed table: splits planned on its width, padding out of range, never read."""
    q, kv, prefix, mask = _case([90, 13], 5, 4, 48, 32, 16, "contiguous", "bushy", torch.float32, 21)
    pt = kv.page_table
    pad = torch.full((pt.shape[0], 3 * pt.shape[1]), kv.kv_cache.shape[0] + 5, dtype=pt.dtype)
    _check(q, replace(kv, page_table=torch.cat([pt, pad], 1)), prefix, mask, 32, config=config, num_splits=7)


def test_fp8_rows_must_match_the_head():
    q, kv, prefix, mask = _case([9], 2, 2, 48, 32, 4, "contiguous", "chain", torch.float32, 1)
    with pytest.raises(ValueError, match="rows of 96 bytes, got 80"):
        mla_verify_attention_triton(q, kv.kv_cache, kv.page_table, prefix, mask, 0.1, 16)


def test_dispatch_table_fp8_rows(monkeypatch):
    """sm_90: the Hopper fp8 kernel above 16 rows over whole 64-key pages at D 576 / v 512; at
    most 16 rows the portable kernel's 16-row tile; other pages and GPUs as for 16-bit caches;
    TREEFLASH_VERIFY_KERNEL=portable drops the Hopper rows."""
    monkeypatch.delenv("TREEFLASH_VERIFY_KERNEL", raising=False)
    hop = KernelConfig(HOPPER, 64, 64, 4, 1, tma=True)
    bf16 = torch.bfloat16
    for rows, nodes in ((17, None), (128, None), (1024, None), (1024 * 64, 1024)):
        assert dispatch(rows, FP8, "sm_90", 64, nodes) == hop, rows
    assert dispatch(8, FP8, "sm_90", 64) == KernelConfig(PORTABLE, 16, 64, 8, 5)
    assert dispatch(16, FP8, "sm_90", 64) == KernelConfig(PORTABLE, 16, 64, 8, 5)
    assert dispatch(8, bf16, "sm_90", 64).impl == HOPPER  # 16-bit: the Hopper kernel at 8 rows
    assert dispatch(264, FP8, "sm_90", 64, head=(96, 64)).impl == PORTABLE_TREE
    for rows, page in ((1024, 1), (64, 1), (1024, 16)):
        assert dispatch(rows, FP8, "sm_90", page) == dispatch(rows, bf16, "gpu", page)
    for rows, page in ((264, 64), (8, 64), (1024, 1)):
        assert dispatch(rows, FP8, "gpu", page) == dispatch(rows, bf16, "gpu", page)
    assert dispatch(264, FP8, "interpreter", 64) == KernelConfig(PORTABLE_TREE, 16, 16, 4, 1)
    monkeypatch.setenv("TREEFLASH_VERIFY_KERNEL", "portable")
    assert dispatch(1024, FP8, "sm_90", 64) == dispatch(1024, bf16, "gpu", 64)


def test_fp32_queries_over_fp8_rows_take_the_fp32_row(monkeypatch):
    """The dots run in q's dtype: fp32 q over fp8 rows is the fp32 row (gathered, even plan)."""
    from treeflash.kernels import mla_verify as mv

    seen, real = [], mv._launch_split
    monkeypatch.setattr(mv, "_launch_split", lambda call, cfg: seen.append(cfg) or real(call, cfg))
    q, kv, prefix, mask = _case([20], 3, 2, 48, 32, 4, "contiguous", "bushy", torch.float32, 2)
    _check(q, kv, prefix, mask, 32)
    assert [c.impl for c in seen] == [GATHERED] and not seen[0].wave_plan


@pytest.mark.slow
def test_hopper_fp8_cpu_fallback_and_support():
    """Off sm_90 (here: CPU) the Hopper fp8 kernel is never launched: a Hopper config runs the
    table without it, exactly; `supported` wants bf16 q and 656-byte rows."""
    from treeflash.kernels.mla_verify import hopper_fp8

    q, kv, prefix, mask = _case([90, 13], 5, 4, 48, 32, 16, "contiguous", "bushy", torch.bfloat16, 15)
    assert not hopper_fp8.supported(q, kv.kv_cache, 32, 0.1)
    _check(q, kv, prefix, mask, 32, config=tile(HOPPER, 20, FP8, "sm_90"), num_splits=3)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("direct", [False, True])
def test_hopper_fp8_launch_binds_the_kernel_arguments(monkeypatch, tree, direct):
    """hopper_fp8.launch's call against `_hopper_fp8_kernel`'s own signature, without a GPU: every
    argument one the kernel takes, each runtime argument once, the cache's bytes as KV8, the
    constexprs as the call asks. Its sm_90 compile is `benchmarks/compile_v5.py` (`compile_fp8`)."""
    from treeflash.kernels.mla_verify import hopper, hopper_fp8
    from treeflash.kernels.mla_verify.plan import Call

    if hopper.gluon is None:
        pytest.skip("no Gluon in this Triton")
    names = hopper_fp8._hopper_fp8_kernel.arg_names
    calls = []

    class Grid:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    monkeypatch.setattr(hopper_fp8, "_hopper_fp8_kernel", Grid())
    monkeypatch.setattr(hopper_fp8, "descriptors", lambda q, kv, n, h, q_tma: ("rope_desc", "q_desc"))
    b, n, h = 2, 3, 8
    q = torch.randn(b, n, h, 576).to(torch.bfloat16)
    kv = torch.zeros(4, 64, 656, dtype=torch.uint8)
    pt = torch.zeros(b, 2, dtype=torch.int32)
    pl = torch.tensor([70, 5], dtype=torch.int32)
    mask = torch.ones(b, n, n, dtype=torch.bool) if tree else None
    out = torch.empty(b, n, h, 512, dtype=torch.bfloat16)
    lse = torch.empty(b, n, h)
    po, plse = torch.empty(b, n * h, 2, 512, dtype=torch.bfloat16), torch.empty(b, n * h, 2)
    splits = 1 if direct else 2
    hopper_fp8.launch(Call(q, kv, pt, pl, mask, q if mask is None else mask, out, lse, po, plse, 0.1, h, n,
                           n * h, 512, 576, 64, splits, direct, 512, 64))
    ((g, args, kw),) = calls
    assert g == (1, splits, b)
    bound = dict(zip(names, args))
    assert kw["num_warps"] == hopper.NUM_WARPS
    assert bound["KV8"] is kv and bound["rope_desc"] == "rope_desc" and bound["q_desc"] == "q_desc"
    assert bound["H"] == h and bound["N"] == n and bound["M"] == n * h
    assert bound["s_tb"] == (n * n if tree else 0) and bound["s_tn"] == (n if tree else 0)
    assert (kw["IS_CAUSAL"], kw["DIRECT"], kw["Q_TMA"], kw["PAGE_SIZE"]) == (not tree, direct, True, 64)
    required = [x for x in names if x not in bound]
    assert sorted(required) == sorted(set(kw) - {"num_warps"})


def test_hopper_fp8_descriptors_cover_the_rope_bytes():
    """The rope view the loader's TMA reads: bytes 528..655 of every row as bf16 [rows, 64],
    16-byte aligned with a 656-byte stride (the descriptor itself needs a GPU's Triton)."""
    from treeflash.kernels.mla_verify import hopper_fp8

    kv = torch.zeros(3, 64, 656, dtype=torch.uint8)
    flat = kv.view(-1, 656)
    rope = flat[:, hopper_fp8.ROPE_OFF:hopper_fp8.ROPE_OFF + 128].view(torch.bfloat16)
    assert rope.shape == (192, 64) and rope.stride() == (328, 1)
    assert (rope.data_ptr() - kv.data_ptr()) % 16 == 0 and hopper_fp8.ROW_BYTES == 656
