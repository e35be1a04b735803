"""`bench kernel --kv-dtype fp8` pieces that run without a GPU: the dtype list, the bytes of a
row (the floor), the correctness pass on small cases under the Triton interpreter (the GPU run
is `benchmarks/gpu_fp8_kv.sh`), and the fp8-against-bf16 table."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from treeflash.bench import kernel_fp8  # noqa: E402
from treeflash.bench.kernel import floor_s  # noqa: E402


def test_dtype_list_and_row_bytes():
    assert kernel_fp8.kv_dtypes("bf16,fp8") == ["bf16", "fp8"]
    assert kernel_fp8.kv_dtypes("fp8_e4m3, auto") == ["fp8", "bf16"]
    with pytest.raises(ValueError, match="expected bf16, fp8"):
        kernel_fp8.kv_dtypes("int8")
    assert (kernel_fp8.row_bytes("bf16"), kernel_fp8.row_bytes("fp8")) == (1152, 656)
    args = argparse.Namespace(bw=4.24e12, peak=779e12)
    bf, b_bytes, _ = floor_s(189440, 1, 8, args, "bf16")
    fp, f_bytes, _ = floor_s(189440, 1, 8, args, "fp8")
    assert f_bytes == 189440 * 656 and b_bytes / f_bytes == pytest.approx(1152 / 656)
    assert bf / fp == pytest.approx(1152 / 656)  # N = 1: both byte-bound
    assert floor_s(65536, 16, 64, args, "fp8")[0] == floor_s(65536, 16, 64, args, "bf16")[0]  # flop-bound


@pytest.mark.slow
def test_correctness_pass_runs_on_small_cases():
    """The same code the GPU pass runs, on CPU tensors and small shapes: every case ok, and the
    quantising writes equal their torch twins byte for byte."""
    cases = [([70], 3, 4, 64, "contiguous", "bushy", torch.bfloat16, None),
             ([45, 9], 2, 2, 1, "scattered", "chain", torch.float32, None),
             ([30, 65], 5, 4, 64, "scattered", "bushy", torch.bfloat16, "portable_tree"),
             ([30], 1, 8, 64, "contiguous", "chain", torch.bfloat16, 3)]
    results = kernel_fp8.check_gpu_fp8(argparse.Namespace(check_only=""), device="cpu", cases=cases)
    assert len(results) == len(cases) + 3 and all(r["ok"] for r in results), results


def test_fill_fp8_writes_decodable_rows():
    kv = torch.zeros(2, 3, 4, 656, dtype=torch.uint8)
    kernel_fp8.fill_fp8(kv, torch.Generator().manual_seed(0), chunk_rows=5)
    from treeflash.kvcache.format import dequantize_rows

    back = dequantize_rows(kv.view(-1, 656), 576, 512)
    assert torch.isfinite(back).all() and 0.5 < back.std() < 1.5


def test_speedup_table():
    rows = [{"mode": "contiguous", "h": 8, "n": 1, "tree": "chain", "context": 189440, "kv_dtype": d,
             "step_ms": ms, "frac_floor": f} for d, ms, f in (("bf16", 0.060, 0.85), ("fp8", 0.036, 0.80))]
    table = kernel_fp8.speedup_table(rows + [{"h": 8, "n": 1, "tree": "chain", "context": 1, "error": "x"}])
    assert "   1.67" in table and "185k" in table
