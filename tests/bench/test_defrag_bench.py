"""`bench kernel --defrag` on the CPU (interpreter; the timing replaced): the scattered request,
compacted, read through its page-1 table and through its coarse page-64 view, and the page-64
pool in order all give the same answer, and the coarse view is what the kernel reads."""

from __future__ import annotations

import os
import types

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from treeflash.bench import kernel as bk  # noqa: E402


@pytest.mark.slow
def test_defrag_section_layouts_agree(monkeypatch):
    from treeflash.kernels import mla_verify  # the section imports its kernel at call time

    page_sizes = []

    orig = mla_verify.mla_verify_attention_triton

    def spy(q, kv_cache, *a, **kw):
        page_sizes.append(kv_cache.shape[1])
        return orig(q, kv_cache, *a, **kw)

    monkeypatch.setattr(mla_verify, "mla_verify_attention_triton", spy)
    def one_call(fn, layers, replays):  # stands in for the CUDA-graph timing
        fn(0)
        return [1.0] * replays

    monkeypatch.setattr(bk, "_time_graph", one_call)
    args = types.SimpleNamespace(defrag="300", layers=1, graph_replays=1, bw=4.24e12, peak=779e12)
    out = bk.defrag(args, device="cpu")
    assert out["before_runs"] > 100 and out["after_runs"] == 1 and out["pages_moved"] > 0
    assert out["outputs_identical"] and out["coarse"] and out["coarse_equals_contiguous"]
    assert out["coarse_max_abs_diff"] < 2e-2  # bf16: another kernel, the same attention
    # scattered page 1, compacted page 1, then the coarse view and the page-64 pool: 64 rows a page
    assert page_sizes == [1, 1, 1, 1, 64, 64, 64, 64], page_sizes
