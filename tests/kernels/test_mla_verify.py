"""MLA verify attention: Triton (interpreter on CPU) against the float64 torch reference."""

from __future__ import annotations

import inspect
import os
from dataclasses import replace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from treeflash.kernels import mla_verify as mv  # noqa: E402
from treeflash.kernels import mla_verify_attention, reference  # noqa: E402
from treeflash.kernels.mla_verify import (  # noqa: E402
    GATHERED,
    HOPPER,
    PORTABLE,
    PORTABLE_TREE,
    KernelConfig,
    combine,
    dispatch,
    mla_verify_attention_triton,
    plan_splits_waves,
    portable,
    tile,
)
from treeflash.kernels.mla_verify import plan as plan_mod  # noqa: E402
from treeflash.kernels.testing import (  # noqa: E402
    LSE_TOLERANCES,
    assert_close,
    random_paged_kv,
    random_tree_masks,
)


def _case(b_lens, n, h, d, v_dim, page_size, layout, tree, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.tensor(b_lens, dtype=torch.int32)
    kv = random_paged_kv([p + n for p in b_lens], d, page_size, dtype, layout, generator=g)
    q = torch.randn(len(b_lens), n, h, d, generator=g).to(dtype)
    if tree == "chain":
        mask = None
    else:
        mask = random_tree_masks(len(b_lens), n, g, bushy=tree == "bushy")
    return q, kv, prefix, mask


def _check(q, kv, prefix, mask, v_dim, dtype, **kw):
    scale = q.shape[-1] ** -0.5
    out, lse = mla_verify_attention_triton(q, kv.kv_cache, kv.page_table, prefix, mask, scale,
                                           v_dim, **kw)
    ref_out, ref_lse = reference.mla_verify_attention(
        q.double(), kv.kv_cache.double(), kv.page_table, prefix, mask, scale, v_dim)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype, "lse", LSE_TOLERANCES)


CASES = [
    # b_lens (prefix per request), N, H, D, v_dim, page_size, layout, tree
    ([37], 1, 4, 48, 32, 1, "scattered", "chain"),
    ([5, 70], 3, 2, 48, 32, 16, "contiguous", "bushy"),
    ([0, 23, 41], 17, 2, 48, 32, 4, "scattered", "bushy"),
    ([29], 17, 1, 48, 32, 64, "contiguous", "chain"),
    ([11, 3], 5, 3, 40, 32, 3, "scattered", "deep"),
    ([50], 4, 4, 32, 32, 8, "contiguous", "bushy"),  # no rope part: D == v_dim
]


@pytest.mark.slow
@pytest.mark.parametrize("b_lens,n,h,d,v_dim,page_size,layout,tree", CASES)
def test_matches_reference_fp32(b_lens, n, h, d, v_dim, page_size, layout, tree):
    q, kv, prefix, mask = _case(b_lens, n, h, d, v_dim, page_size, layout, tree, torch.float32, 0)
    _check(q, kv, prefix, mask, v_dim, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    q, kv, prefix, mask = _case([45, 9], 3, 4, 48, 32, 1, "scattered", "bushy", dtype, 1)
    _check(q, kv, prefix, mask, 32, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [1, 2, 7, 40])
def test_split_counts_agree(num_splits):
    """Direct path (1 split), a few splits, and more splits than blocks (empty splits)."""
    q, kv, prefix, mask = _case([60, 17], 3, 2, 48, 32, 4, "scattered", "bushy", torch.float32, 2)
    _check(q, kv, prefix, mask, 32, torch.float32, num_splits=num_splits)


@pytest.mark.slow
def test_deepseek_dims_bf16():
    """D = 576 (512 + 64), v_dim = 512, the DeepSeek-V3 / Kimi-K2 latent."""
    q, kv, prefix, mask = _case([21, 6], 2, 2, 576, 512, 16, "contiguous", "chain",
                                torch.bfloat16, 3)
    _check(q, kv, prefix, mask, 512, torch.bfloat16, num_splits=2)


def test_prefill_chunk_causal_multi_tile():
    """A causal chunk over several M tiles, so causal tiles stop at their last node."""
    q, kv, prefix, mask = _case([9], 24, 2, 48, 32, 16, "scattered", "chain", torch.float32, 4)
    _check(q, kv, prefix, mask, 32, torch.float32, num_splits=1)


@pytest.mark.slow
def test_bigger_tiles_and_strided_q():
    """Non-contiguous q (a view) and a 32 x 32 tile of the gathered kernel, even split plan."""
    q, kv, prefix, mask = _case([33, 12], 3, 4, 48, 32, 2, "scattered", "bushy", torch.float32, 5)
    wide = torch.randn(q.shape[0], q.shape[1], q.shape[2], 64)
    wide[..., :48] = q
    _check(wide[..., :48], kv, prefix, mask, 32, torch.float32,
           config=KernelConfig(GATHERED, 32, 32, 4, 1, wave_plan=False), num_splits=3)


def test_chain_mask_equals_none():
    q, kv, prefix, _ = _case([19], 5, 2, 48, 32, 4, "contiguous", "chain", torch.float32, 6)
    chain = torch.tril(torch.ones(5, 5, dtype=torch.bool))[None]
    a = mla_verify_attention_triton(q, kv.kv_cache, kv.page_table, prefix, None, 0.2, 32)
    b = mla_verify_attention_triton(q, kv.kv_cache, kv.page_table, prefix, chain, 0.2, 32)
    assert_close(a[0], b[0], torch.float32)
    assert_close(a[1], b[1], torch.float32, "lse")


def test_public_dispatch():
    q, kv, prefix, mask = _case([13], 2, 2, 48, 32, 4, "scattered", "bushy", torch.float32, 7)
    t = mla_verify_attention(q, kv.kv_cache, kv.page_table, prefix, mask, 0.2, 32, impl="triton")
    r = mla_verify_attention(q, kv.kv_cache, kv.page_table, prefix, mask, 0.2, 32)
    assert_close(t[0], r[0], torch.float32)
    assert_close(t[1], r[1], torch.float32, "lse")


PORTABLE_CONFIGS = {
    "portable": KernelConfig(PORTABLE, 16, 16, 4, 1),
    "portable-tma": KernelConfig(PORTABLE, 16, 16, 4, 1, tma=True),
    "portable-tma-bn4": KernelConfig(PORTABLE, 16, 4, 4, 1, tma=True),  # several tiles per page
    "portable-32x32": KernelConfig(PORTABLE, 32, 32, 4, 1, tma=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PORTABLE_CONFIGS))
@pytest.mark.parametrize("b_lens,n,h,d,v_dim,page_size,layout,tree", CASES)
def test_portable_matches_reference_fp32(name, b_lens, n, h, d, v_dim, page_size, layout, tree):
    """The portable kernel: full tiles (pointer or TMA; one page id per tile or gathered) +
    masked tail + tree."""
    q, kv, prefix, mask = _case(b_lens, n, h, d, v_dim, page_size, layout, tree, torch.float32, 9)
    _check(q, kv, prefix, mask, v_dim, torch.float32, config=PORTABLE_CONFIGS[name])


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [None, 1, 3, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_portable_half_precision_and_splits(num_splits, dtype):
    """Long enough for many full tiles per split, a tail tile, and empty splits (40)."""
    q, kv, prefix, mask = _case([150, 37], 5, 3, 48, 32, 16, "contiguous", "bushy", dtype, 10)
    _check(q, kv, prefix, mask, 32, dtype, config=PORTABLE_CONFIGS["portable-tma"], num_splits=num_splits)
    q, kv, prefix, mask = _case([150, 37], 5, 3, 48, 32, 1, "scattered", "chain", dtype, 11)
    _check(q, kv, prefix, mask, 32, dtype, config=PORTABLE_CONFIGS["portable"], num_splits=num_splits)


@pytest.mark.slow
def test_portable_deepseek_dims_and_prefill_chunk():
    """D = 576 / v_dim = 512 through TMA tiles, and a causal chunk over several M tiles."""
    q, kv, prefix, mask = _case([40, 7], 2, 2, 576, 512, 16, "contiguous", "chain",
                                torch.bfloat16, 12)
    _check(q, kv, prefix, mask, 512, torch.bfloat16, config=PORTABLE_CONFIGS["portable-tma"], num_splits=2)
    q, kv, prefix, mask = _case([33], 24, 2, 48, 32, 16, "scattered", "chain", torch.float32, 13)
    _check(q, kv, prefix, mask, 32, torch.float32, config=PORTABLE_CONFIGS["portable-tma"], num_splits=1)


def test_plan_splits_waves_fills_whole_waves():
    """16 M tiles on 132 SMs: 8 splits (128 programs, one wave), not the even plan's 9 (144: two
    waves)."""
    assert plan_splits_waves(1, 1024, 65600, 64, 32, 132)[0] == 8
    assert plan_splits_waves(1, 8192, 65600, 64, 32, 132)[0] == 1  # 128 tiles: no split, direct
    # 4 M tiles at 256k: 33 splits fill all 132 SMs in the same one wave (0.977 of 32's cost);
    # the 3% rule alone kept 32 (128 programs); two waves for 2% stay refused (8 M tiles)
    assert plan_splits_waves(1, 256, 262208, 64, 64, 132)[0] == 33
    assert plan_splits_waves(1, 256, 262208, 64, 64, 132, fill_gain=0.97)[0] == 32
    assert plan_splits_waves(1, 512, 262208, 64, 64, 132)[0] == 16
    s, chunk = plan_splits_waves(1, 8, 262208, 16, 64, 132)
    assert s * 16 <= 132 * 16 and chunk % 64 == 0 and s * chunk >= 262208
    for cap in (1, 7, 64, 1000, 70001):  # every position covered, chunks whole tiles
        s, chunk = plan_splits_waves(3, 40, cap, 16, 16, 4)
        assert s >= 1 and chunk % 16 == 0 and s * chunk >= cap and (s - 1) * chunk < cap


def test_dispatch_table_on_sm90(monkeypatch):
    """The table's choices on sm_90, without a GPU (the H200 decisions of 2026-12-02/03,
    DESIGN_NOTES.md 1.1-1.2): the Hopper kernel for every row and node count over whole 64-key
    pages in 16-bit with D 576 / v_dim 512; other pages and head dims as on another GPU."""
    monkeypatch.delenv("TREEFLASH_VERIFY_KERNEL", raising=False)
    bf16 = torch.bfloat16
    hop = KernelConfig(HOPPER, 64, 64, 4, 1, tma=True)
    assert dispatch(8, bf16, "sm_90", 64) == hop  # 8 heads x 1 node: ahead of the 16-row tile
    assert dispatch(1024, bf16, "sm_90", 64) == hop
    assert dispatch(1024, bf16, "sm_90", None) == hop  # unknown layout: contiguous
    assert dispatch(1024 * 64, bf16, "sm_90", 64, nodes=1024) == hop  # a prefill chunk
    assert dispatch(264, torch.float16, "sm_90", 128) == hop
    assert dispatch(264, bf16, "sm_90", 64, head=(96, 64)).impl == PORTABLE_TREE  # other dims
    assert dispatch(1024, bf16, "sm_90", 32) == KernelConfig(PORTABLE, 64, 32, 8, 5, tma=True)
    assert dispatch(8, bf16, "sm_90", 1) == KernelConfig(PORTABLE, 16, 64, 8, 5)  # 8 x 1 gathered
    assert dispatch(1024, torch.float32, "sm_90", 64) == KernelConfig(GATHERED, 16, 32, 4, 1, wave_plan=False)


def test_dispatch_table_elsewhere(monkeypatch):
    """Another GPU (and sm_90 off whole 64-key pages): the portable tree kernel above 16 rows
    for trees of up to 256 nodes over whole tiles, the gathered kernel (wave plan) above 16
    rows where the portable kernel's tile would gather rows, the portable kernel for the rest;
    fp32 the gathered kernel with the even plan; the interpreter's tiles 16 x 16."""
    monkeypatch.delenv("TREEFLASH_VERIFY_KERNEL", raising=False)
    bf16 = torch.bfloat16
    for m_rows, page in ((1024, 1), (64, 1), (8192, 1), (1024, 16)):  # 16 % 32: gathered too
        for gpu in ("sm_90", "gpu"):
            assert dispatch(m_rows, bf16, gpu, page) == KernelConfig(GATHERED, 64, 64, 8, 2), (m_rows, page)
    assert dispatch(264, bf16, "gpu", 64) == KernelConfig(PORTABLE_TREE, 64, 64, 8, 4, tma=True)
    assert dispatch(264, bf16, "gpu", 64, nodes=33).impl == PORTABLE_TREE
    assert dispatch(8, bf16, "gpu", 64) == KernelConfig(PORTABLE, 16, 64, 8, 5)
    prefill = dispatch(4096 * 8, bf16, "gpu", 64, nodes=4096)  # the tree kernel is not for prefill
    assert prefill == KernelConfig(PORTABLE, 64, 32, 8, 5, tma=True)
    for gpu in ("sm_90", "gpu"):
        assert dispatch(1024, torch.float32, gpu, 64) == KernelConfig(GATHERED, 16, 32, 4, 1, wave_plan=False)
    assert dispatch(8, bf16, "interpreter", 64) == KernelConfig(PORTABLE, 16, 16, 4, 1)
    assert dispatch(264, bf16, "interpreter", 64) == KernelConfig(PORTABLE_TREE, 16, 16, 4, 1)
    assert dispatch(1024 * 64, bf16, "interpreter", 64, nodes=1024).impl == PORTABLE
    assert dispatch(20, bf16, "interpreter", 1) == KernelConfig(GATHERED, 16, 16, 4, 1)
    assert mv.gpu_kind(torch.device("cpu")) == "interpreter"


def test_verify_kernel_override(monkeypatch):
    """TREEFLASH_VERIFY_KERNEL=portable (a bug-report override) runs the table without its
    Hopper row: on sm_90 what another GPU runs. auto, unset or empty: the table. Any other value
    (the old generation names among them) is a ValueError naming the valid ones."""
    bf16 = torch.bfloat16
    monkeypatch.setenv("TREEFLASH_VERIFY_KERNEL", "portable")
    for m_rows, page, nodes in ((264, 64, None), (8, 64, None), (1024 * 64, 64, 1024), (264, 1, None),
                                (264, 32, None), (8, None, None)):
        assert dispatch(m_rows, bf16, "sm_90", page, nodes) == dispatch(m_rows, bf16, "gpu", page, nodes)
    assert dispatch(264, bf16, "sm_90", 64).impl == PORTABLE_TREE
    for bad in ("v5c", "v5b", "v4", "v3", "hopper", "Portable", " auto"):
        monkeypatch.setenv("TREEFLASH_VERIFY_KERNEL", bad)
        with pytest.raises(ValueError, match="auto, portable"):
            dispatch(264, bf16, "sm_90", 64)
    for unset in ("", "auto"):
        monkeypatch.setenv("TREEFLASH_VERIFY_KERNEL", unset)
        assert dispatch(264, bf16, "sm_90", 64).impl == HOPPER


@pytest.mark.slow
def test_default_dispatch_gathered_with_the_wave_plan(monkeypatch):
    """Default path under the interpreter: page 1 with 20 rows runs the gathered kernel with the
    wave plan, page 16 the portable tree kernel (whole 16-key interpreter tiles); both exact,
    both through plan_splits_waves."""
    assert dispatch(20, torch.bfloat16, "interpreter", 1) == KernelConfig(GATHERED, 16, 16, 4, 1)
    assert dispatch(20, torch.bfloat16, "interpreter", 16).impl == PORTABLE_TREE
    plans = []
    monkeypatch.setattr(plan_mod, "plan_splits_waves",
                        lambda *a, **k: plans.append(a) or plan_splits_waves(*a, **k))
    for page, layout in ((1, "scattered"), (16, "contiguous")):
        q, kv, prefix, mask = _case([90, 13], 5, 4, 48, 32, page, layout, "bushy",
                                    torch.bfloat16, 14)
        _check(q, kv, prefix, mask, 32, torch.bfloat16)
    assert len(plans) == 2


TREE_CONFIGS = {
    "tree": KernelConfig(PORTABLE_TREE, 16, 16, 4, 1),  # pointer tiles: one page id, or gathered
    "tree-tma": KernelConfig(PORTABLE_TREE, 16, 16, 4, 1, tma=True),
    "tree-tma-bn4": KernelConfig(PORTABLE_TREE, 16, 4, 4, 1, tma=True),  # several tiles per page
    "tree-32x32": KernelConfig(PORTABLE_TREE, 32, 32, 4, 1, tma=True),
}


def _count_tree_launches(monkeypatch) -> list:
    """Record every launch of the portable tree kernel (so a silent fallback to the portable
    kernel fails the test)."""
    launches, run = [], portable._portable_tree_kernel.run
    monkeypatch.setattr(portable._portable_tree_kernel, "run",
                        lambda *a, **k: launches.append(k["BLOCK_N"]) or run(*a, **k))
    return launches


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TREE_CONFIGS))
@pytest.mark.parametrize("b_lens,n,h,d,v_dim,page_size,layout,tree", CASES)
def test_tree_kernel_matches_reference_fp32(name, b_lens, n, h, d, v_dim, page_size, layout, tree,
                                            monkeypatch):
    """The portable tree kernel: masked tiles (prefix tail + tree) first, then full tiles
    (pointer or TMA; one page id per tile or gathered rows), S once, two value-half accumulators."""
    launches = _count_tree_launches(monkeypatch)
    q, kv, prefix, mask = _case(b_lens, n, h, d, v_dim, page_size, layout, tree, torch.float32, 9)
    _check(q, kv, prefix, mask, v_dim, torch.float32, config=TREE_CONFIGS[name])
    assert launches == [TREE_CONFIGS[name].block_n]


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [None, 1, 3, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tree_kernel_half_precision_and_splits(num_splits, dtype):
    """Many full tiles per split, a tail tile, splits with no masked key at all (the masked
    loop's first, empty tile) and empty splits (40)."""
    q, kv, prefix, mask = _case([150, 37], 5, 3, 48, 32, 16, "contiguous", "bushy", dtype, 10)
    _check(q, kv, prefix, mask, 32, dtype, config=TREE_CONFIGS["tree-tma"], num_splits=num_splits)
    q, kv, prefix, mask = _case([150, 37], 5, 3, 48, 32, 1, "scattered", "chain", dtype, 11)
    _check(q, kv, prefix, mask, 32, dtype, config=TREE_CONFIGS["tree"], num_splits=num_splits)


@pytest.mark.slow
def test_tree_kernel_whole_tile_splits_and_deepseek_dims():
    """Prefix 128 = 8 full 16-key tiles in 3 splits of whole tiles: the first two splits end
    inside the prefix on a tile boundary (no tail, no tree key). Then D = 576 / v_dim = 512
    through TMA tiles (value halves of 256) and a causal chunk over several M tiles."""
    q, kv, prefix, mask = _case([128], 5, 4, 48, 32, 16, "contiguous", "bushy", torch.float32, 15)
    chunk = plan_mod.plan_splits(1, 20, kv.page_table.shape[1] * 16, TREE_CONFIGS["tree"], 4, 3)[1]
    assert chunk % 16 == 0 and 2 * chunk <= 128, chunk
    _check(q, kv, prefix, mask, 32, torch.float32, config=TREE_CONFIGS["tree"], num_splits=3)
    q, kv, prefix, mask = _case([40, 7], 2, 2, 576, 512, 16, "contiguous", "chain",
                                torch.bfloat16, 12)
    _check(q, kv, prefix, mask, 512, torch.bfloat16, config=TREE_CONFIGS["tree-tma"], num_splits=2)
    q, kv, prefix, mask = _case([33], 24, 2, 48, 32, 16, "scattered", "chain", torch.float32, 13)
    _check(q, kv, prefix, mask, 32, torch.float32, config=TREE_CONFIGS["tree-32x32"], num_splits=1)


def test_tree_kernel_runs_the_portable_kernel_below_32_value_columns(monkeypatch):
    """v_dim 16 (halves of 8 columns cannot feed a dot): the tree config runs the portable
    kernel on its tile, exactly."""
    launches = _count_tree_launches(monkeypatch)
    q, kv, prefix, mask = _case([21, 9], 3, 2, 24, 16, 4, "scattered", "bushy", torch.float32, 16)
    _check(q, kv, prefix, mask, 16, torch.float32, config=TREE_CONFIGS["tree"])
    assert launches == []


def test_tiles_and_the_tree_kernel_rows(monkeypatch):
    """`tile`: the tree kernel's 64x64 x 8 warps x 4 stages TMA tile, the portable kernel's
    16-row tile up to 16 rows; on a GPU without the Hopper kernel the tree kernel runs exactly
    above 16 rows over whole 64-key tiles, never fp32."""
    monkeypatch.delenv("TREEFLASH_VERIFY_KERNEL", raising=False)
    bf16 = torch.bfloat16
    assert tile(PORTABLE_TREE, 264, bf16, "gpu") == KernelConfig(PORTABLE_TREE, 64, 64, 8, 4, tma=True)
    assert tile(PORTABLE, 16, bf16, "gpu") == KernelConfig(PORTABLE, 16, 64, 8, 5)
    assert tile(PORTABLE, 17, bf16, "gpu") == KernelConfig(PORTABLE, 64, 32, 8, 5, tma=True)
    for m_rows in (8, 17, 264, 1024, 8192):
        for page in (None, 1, 16, 32, 64, 128):
            impl = dispatch(m_rows, bf16, "gpu", page).impl
            assert (impl == PORTABLE_TREE) == (m_rows > 16 and (page is None or page % 64 == 0)), (m_rows, page)
            assert dispatch(m_rows, torch.float32, "gpu", page).impl == GATHERED


def test_compile_report_reads_the_hot_loop():
    """The sm_90 report's SASS reader (`bench kernel --compile-report`): the shortest
    backward loop holding MMA and async loads, with its spills, wgmma waits and barriers."""
    from treeflash.bench.kernel_report import _hot_loop

    def line(addr, text):
        return f"        /*{addr:04x}*/                   {text} ;      /* 0x0000 */"

    outer = [(0x100, "UTMALDG.2D [UR4], [UR6]"), (0x110, "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], RZ")]
    hot = [(0x200, "UTMALDG.2D [UR4], [UR6]"),
           (0x210, "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT"),
           (0x220, "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR10], R24, gsb0"),
           (0x230, "WARPGROUP.DEPBAR.LE gsb0, 0x0"), (0x240, "BAR.SYNC.DEFER_BLOCKING 0x0"),
           (0x250, "LDL R2, [R1+0x8]"), (0x260, "STL [R1+0x8], R2"), (0x270, "@P0 BRA 0x200")]
    tail = [(0x280, "@P1 BRA 0x100"), (0x290, "EXIT")]
    sass = "\n".join(line(a, t) for a, t in outer + hot + tail)
    assert _hot_loop(sass) == {"instructions": 8, "LDL": 1, "STL": 1, "mma": 2, "wgmma_waits": 1,
                               "barriers": 1}
    assert _hot_loop(line(0x10, "FADD R1, R1, R2"))["instructions"] == 0  # no loop: zeros


def test_compile_report_signatures_match_the_kernels():
    """Every compile-report row names its kernel's arguments exactly, in order (constexprs
    included): a renamed argument (`chunk` -> `chunk_max`) made every row fail
    to compile on the sm_90 report while nothing on the CPU noticed."""
    from treeflash.bench.kernel_report import REPORT_TILES, _report_source

    for impl, bm, bn, _warps, _stages, tma, page in REPORT_TILES:
        fn, sig, cx = _report_source(impl, bm, bn, tma, page)
        assert list(sig) == list(fn.arg_names), (impl, bm, bn, tma, page)
        assert all(sig[k] == "constexpr" for k in cx)
        params = inspect.signature(fn.fn).parameters  # (the interpreter's wrapper, too)
        constexprs = {k for k, v in params.items() if "constexpr" in str(v.annotation)}
        assert constexprs == set(cx), (impl, bm, bn, constexprs ^ set(cx))


@pytest.mark.slow
def test_tree_kernel_masked_loop_over_several_tiles():
    """More masked keys than one BLOCK_T tile: the prefix tail plus an 80-node tree, and a
    150-node causal chunk whose M tiles stop at their last row's node."""
    from treeflash.kernels.mla_verify.portable import BLOCK_T

    q, kv, prefix, mask = _case([37, 5], 80, 1, 48, 32, 16, "scattered", "bushy", torch.float32, 17)
    assert 80 + 37 % 16 > BLOCK_T
    _check(q, kv, prefix, mask, 32, torch.float32, config=TREE_CONFIGS["tree-tma"], num_splits=2)
    q, kv, prefix, mask = _case([20], 150, 1, 48, 32, 16, "contiguous", "chain", torch.bfloat16, 18)
    _check(q, kv, prefix, mask, 32, torch.bfloat16, config=TREE_CONFIGS["tree-32x32"], num_splits=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tree", "tree-tma"])
def test_tree_kernel_value_dim_not_a_power_of_two(name):
    """v_dim 48 in halves of 32: the upper half is masked past v_dim (pointer tiles) or read
    as zeros past the descriptor's v_dim columns (TMA); rope 8 columns in a 16-wide block."""
    q, kv, prefix, mask = _case([77, 3], 6, 3, 56, 48, 16, "contiguous", "bushy", torch.float32, 19)
    _check(q, kv, prefix, mask, 48, torch.float32, config=TREE_CONFIGS[name], num_splits=2)


@pytest.mark.slow
@pytest.mark.parametrize("config", [KernelConfig(GATHERED, 16, 16, 4, 1, wave_plan=False),
                                    KernelConfig(PORTABLE, 16, 16, 4, 1),
                                    KernelConfig(PORTABLE_TREE, 16, 16, 4, 1, tma=True)],
                         ids=["gathered", "portable", "portable_tree-tma"])
@pytest.mark.parametrize("splits", [None, 3, 7])
def test_page_table_wider_than_the_requests(config, splits):
    """A CUDA graph's page table is a power-of-two bucket, up to twice (here four times) the
    pages a request holds. Splits are planned on that width, but each request's own keys are
    cut evenly over them (`_fit_chunk`), and the combine must read exactly the splits that
    ran: a combine still counting with the planned chunk drops partials and fails here."""
    q, kv, prefix, mask = _case([90, 13], 5, 4, 48, 32, 16, "contiguous", "bushy", torch.float32, 21)
    pt = kv.page_table
    pad = torch.full((pt.shape[0], 3 * pt.shape[1]), kv.kv_cache.shape[0] + 5, dtype=pt.dtype)
    wide = replace(kv, page_table=torch.cat([pt, pad], 1))  # padding out of range: never read
    _check(q, wide, prefix, mask, 32, torch.float32, config=config, num_splits=splits)


@pytest.mark.slow
def test_hopper_q_rows_and_cpu_fallback():
    """The Hopper kernel reads Q by TMA only when q is one [B x N x H, D] row block; on CPU / the
    interpreter it is never launched: a Hopper config there runs the table without it, exactly."""
    from treeflash.kernels.mla_verify.hopper import _q_rows_tma_ok

    bf16 = torch.bfloat16
    q = torch.randn(2, 5, 4, 576).to(bf16)
    assert _q_rows_tma_ok(q)
    assert not _q_rows_tma_ok(q.transpose(1, 2).contiguous().transpose(1, 2))  # [B, H, N, D]
    assert not _q_rows_tma_ok(torch.randn(2, 5, 4, 580).to(bf16)[..., :576])  # rows 1160 B apart
    q, kv, prefix, mask = _case([90, 13], 5, 4, 48, 32, 16, "contiguous", "bushy", bf16, 15)
    assert not mv._hopper_supported(q, kv.kv_cache, 32, 0.1)
    _check(q, kv, prefix, mask, 32, bf16, config=tile(HOPPER, 20, bf16, "sm_90"), num_splits=3)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("direct", [False, True])
def test_hopper_launch_binds_the_kernel_arguments(monkeypatch, tree, direct):
    """hopper.launch's call against `_hopper_kernel`'s own signature, without a GPU: every
    argument is one the kernel takes, each runtime argument once, the constexprs as the call
    asks (Q by TMA for a row-block q, the mask, the output path). The sm_90 compile of the same
    signature is `benchmarks/compile_v5.py` / `benchmarks/sass_hashes.py`."""
    from treeflash.kernels.mla_verify import hopper
    from treeflash.kernels.mla_verify.plan import Call

    if hopper.gluon is None:
        pytest.skip("no Gluon in this Triton")
    names = hopper._hopper_kernel.arg_names
    calls = []

    class Grid:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    monkeypatch.setattr(hopper, "_hopper_kernel", Grid())
    monkeypatch.setattr(hopper, "tma_descriptors", lambda q, kv, n, h, q_tma: ("kv_desc", "q_desc"))
    b, n, h = 2, 3, 8
    q = torch.randn(b, n, h, 576).to(torch.bfloat16)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    pt = torch.zeros(b, 2, dtype=torch.int32)
    pl = torch.tensor([70, 5], dtype=torch.int32)
    mask = torch.ones(b, n, n, dtype=torch.bool) if tree else None
    out = torch.empty(b, n, h, 512, dtype=torch.bfloat16)
    lse = torch.empty(b, n, h)
    po, plse = torch.empty(b, n * h, 2, 512, dtype=torch.bfloat16), torch.empty(b, n * h, 2)
    splits = 1 if direct else 2
    hopper.launch(Call(q, kv, pt, pl, mask, q if mask is None else mask, out, lse, po, plse, 0.1, h, n,
                       n * h, 512, 576, 64, splits, direct, 512, 64))
    ((g, args, kw),) = calls
    assert g == (1, splits, b)
    bound = dict(zip(names, args))
    assert len(args) <= len(names)
    launch_opts = {"num_warps"}
    assert set(kw) - launch_opts <= set(names) - set(bound), sorted(set(kw) - set(names))
    assert kw["num_warps"] == hopper.NUM_WARPS
    assert bound["kv_desc"] == "kv_desc" and bound["q_desc"] == "q_desc"
    assert bound["H"] == h and bound["N"] == n and bound["M"] == n * h
    assert bound["s_tb"] == (n * n if tree else 0) and bound["s_tn"] == (n if tree else 0)
    assert (kw["IS_CAUSAL"], kw["DIRECT"], kw["Q_TMA"]) == (not tree, direct, True)
    assert kw["PAGE_SIZE"] == 64
    required = [x for x in names if x not in bound]
    assert sorted(required) == sorted(set(kw) - launch_opts)  # nothing left unset


@pytest.mark.slow
def test_all_splits_combine_reads_every_slot():
    """The combine as launched after the Hopper kernel (ALL_SPLITS): every split slot of a row is
    read, empty ones included (a request shorter than the planned splits leaves slots with LSE
    -inf and zero values, as the Hopper kernel writes them), and float64 partials over its key
    chunks (`hopper._split_bounds`: 64-key-aligned chunks of prefix + N) combine to the
    reference, over all splits at once, at `combine.hopper_tiles`' tiles and in one-warp steps."""
    import triton

    d, v_dim, scale, splits = 48, 32, 48 ** -0.5, 5
    for b_lens, n, h, tree in (([300, 6], 5, 8, "bushy"), ([900], 17, 3, "chain")):
        q, kv, prefix, mask = _case(b_lens, n, h, d, v_dim, 16, "scattered", tree, torch.float32, 23)
        m_rows, b = n * h, len(b_lens)
        po = torch.full((b, m_rows, splits, v_dim), float("nan"), dtype=torch.float64)
        plse = torch.full((b, m_rows, splits), float("nan"), dtype=torch.float64)
        for bi, p in enumerate(b_lens):
            total = p + n
            pos = torch.arange(total)
            rows_all = kv.kv_cache[kv.page_table[bi, pos // kv.kv_cache.shape[1]].long(),
                                   pos % kv.kv_cache.shape[1]].double()
            node = torch.arange(m_rows) // h
            j = pos - p
            tree_ok = j[None, :] <= node[:, None] if mask is None else mask[bi][node][:, j.clamp(min=0)]
            visible = (j[None, :] < 0) | tree_ok
            s2 = (q[bi].reshape(m_rows, d).double() @ rows_all.T) * scale / torch.log(torch.tensor(2.0))
            s2 = s2.masked_fill(~visible, float("-inf"))
            chunk = triton.cdiv(triton.cdiv(total, splits), 64) * 64
            for s in range(splits):
                k0, k1 = min(s * chunk, total), min(s * chunk + chunk, total)
                sc = s2[:, k0:k1]
                mx = sc.max(1).values if k1 > k0 else torch.full((m_rows,), float("-inf"))
                mx_safe = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
                pr = torch.exp2(sc - mx_safe[:, None])
                ls = pr.sum(1)
                o = pr @ rows_all[k0:k1, :v_dim]
                po[bi, :, s] = o / torch.where(ls == 0, torch.ones_like(ls), ls)[:, None]
                plse[bi, :, s] = torch.where(ls == 0, torch.full_like(ls, float("-inf")),
                                             mx_safe + torch.log2(ls))
        if b > 1:  # request 2 (11 keys) fills split 0 only: four empty slots a row
            assert torch.isinf(plse[1, :, 1:]).all() and (po[1, :, 1:] == 0).all()
        ref_out, ref_lse = reference.mla_verify_attention(
            q.double(), kv.kv_cache.double(), kv.page_table, prefix, mask, scale, v_dim)
        hopper_tiles = combine.hopper_tiles(splits, v_dim, b * m_rows, 1)
        assert hopper_tiles[2] == (1 if b * m_rows >= 64 else 4)
        # all splits in one step, the Hopper tiles, and 4 splits x 16 columns a step (two steps)
        for block_s, block_vc, warps in ((triton.next_power_of_2(splits), v_dim, 4), hopper_tiles, (4, 16, 1)):
            out = torch.empty(b, n, h, v_dim, dtype=torch.float32)
            lse = torch.empty(b, n, h, dtype=torch.float32)
            combine._combine_kernel[(m_rows, triton.cdiv(v_dim, block_vc), b)](
                po.float(), plse.float(), prefix, out, lse, h, n, m_rows, v_dim, splits,
                out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
                BLOCK_S=block_s, BLOCK_VC=block_vc, BLOCK_N=64, ALL_SPLITS=True, num_warps=warps)
            assert torch.isfinite(out).all()
            assert_close(out, ref_out, torch.float32)
            assert_close(lse, ref_lse, torch.float32, "lse", LSE_TOLERANCES)


def test_bench_variants():
    """The bench's variants: "auto" is the table itself, every other one an implementation at the
    tile the table gives it on sm_90 (the Hopper kernel) or another GPU; the generation-numbered
    variants (v2 .. v6) are gone."""
    from treeflash.bench.kernel_checks import VARIANTS

    bf16 = torch.bfloat16
    assert VARIANTS["auto"](256) == {}
    assert VARIANTS["hopper"](256)["config"] == dispatch(256, bf16, "sm_90", 64)
    assert VARIANTS["hopper-direct"](8) == {"config": dispatch(8, bf16, "sm_90", 64), "num_splits": 1}
    assert VARIANTS["portable_tree"](256)["config"] == dispatch(256, bf16, "gpu", 64)
    assert VARIANTS["portable"](8)["config"] == dispatch(8, bf16, "gpu", 64)
    assert VARIANTS["gathered"](256)["config"] == dispatch(256, bf16, "gpu", 1)
    assert not [name for name in VARIANTS if name.startswith("v")]


def test_combine_tiles():
    """After the Hopper kernel the combine's tiles and warps are the H200 sweep's winners
    (`combine.hopper_tiles`); after the portable kernels one pass over the splits, 32 columns
    under 64 rows; after the gathered kernel 64 splits x 64 columns a step."""
    ht = combine.hopper_tiles
    assert ht(8, 512, 1024, 132) == (8, 512, 1)  # 64 x 16, 8 splits
    assert ht(4, 512, 2048, 132) == (4, 512, 1)  # 64 x 32, 4 splits
    assert ht(33, 512, 256, 132) == (32, 128, 1)  # 8 x 32, 33 splits
    assert ht(65, 512, 128, 132) == (32, 128, 1)  # 8 x 16, 65 splits
    assert ht(129, 512, 64, 132) == (32, 64, 1)  # 64 x 1: 512 programs, not 256
    assert ht(129, 512, 8, 132) == (256, 32, 4)  # 8 x 1: all splits, 4 warps
    assert ht(3, 16, 64, 4) == (4, 16, 1)  # tiny test dims stay inside block_v
    assert combine.tiles(HOPPER, 33, 512, 256, 132) == ht(33, 512, 256, 132)
    assert combine.tiles(PORTABLE, 129, 512, 8, 132) == (256, 32, 4)
    assert combine.tiles(PORTABLE_TREE, 5, 512, 1024, 132) == (8, 64, 4)
    assert combine.tiles(GATHERED, 129, 512, 1024, 132) == (64, 64, 4)
