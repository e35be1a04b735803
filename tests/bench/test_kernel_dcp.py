"""`bench kernel --dcp N` (`bench/kernel_dcp.py`) on CPU at tiny shapes: the harness builds one DCP
rank's layer with the right shapes (its dealt share, N x its heads, the step's rows), the layer's
merge is exact against `merge_torch`, its output is the attention of the group's heads over the
share, and a section's JSON rows hold every field `benchmarks/dcp_model_table.py` reads. The timing
itself (a CUDA graph over the layers) is GPU-only."""

from __future__ import annotations

import argparse

import pytest
import torch

from helpers.scripts import load_benchmark_script
from treeflash.bench import kernel, kernel_dcp
from treeflash.bench.kernel_dcp import RankShape
from treeflash.kernels import reference
from treeflash.models import dcp


def args_for(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    kernel.add_arguments(p)
    a = p.parse_args(["--dcp", "4", "--contexts", "1k,640", "--dcp-rows", "1,3", "--dcp-heads", "2",
                      "--layers", "3", "--graph-replays", "1"])
    a.bw, a.peak = 3e12, 8e14
    for k, v in kw.items():
        setattr(a, k, v)
    return a


@pytest.mark.parametrize("context, share", [(1024, 256), (640, 192), (700, 192)])
def test_a_rank_reads_its_dealt_share(context, share):
    # page 64 dealt over 4 ranks: rank 0 holds positions [0, 64), [256, 320), ...
    assert RankShape.of(context, 4, 2, 3).share == share
    assert RankShape.of(context, 1, 2, 3).share == context


@pytest.mark.parametrize("rows", [1, 3])
def test_the_rank_layer_has_the_groups_heads_over_its_share_and_an_exact_merge(rows):
    shape = RankShape.of(1024, 4, 2, rows)
    call, inp = kernel_dcp.rank_layer(shape, 2, "cpu", torch.float32)
    kv, table, prefix, mask = inp["kv"], inp["table"], inp["prefix"], inp["mask"]
    assert kv.shape == (2, -(-(256 + rows) // 64) + 1, 64, 576) and table.shape == (1, -(-(256 + rows) // 64))
    assert prefix.tolist() == [256] and inp["q"].shape == (1, rows, 2, 576)
    assert (mask is None) == (rows == 1) and (mask is None or mask.shape == (1, rows, rows))
    assert inp["shared"].prefix_lens.tolist() == [1024] and inp["local"].prefix_lens.tolist() == [256]
    q_all = dcp.gather_heads(inp["q"], 4, None)
    assert q_all.shape == (1, rows, 8, 576)
    want_out, want_lse = reference.mla_verify_attention(q_all, kv[1], table, prefix, mask, kernel_dcp.SCALE, 512)
    send = dcp.pack_send(want_out, want_lse, 4)
    assert send.shape == (4, 1, rows, 2, 512 + 1)  # float32: the LSE's bits in one column
    out_torch, lse_torch = dcp.merge_torch(*dcp.unpack(send, 512))
    out_triton, lse_triton = dcp.merge(send, 512, "triton")  # the GPU's one launch (interpreted)
    torch.testing.assert_close(out_triton, out_torch, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_triton, lse_torch, rtol=1e-6, atol=1e-6)
    got = call(1)  # (layer 1: the second cache)
    assert "settle" not in inp["shared"].dcp_cache  # one row is at its owner's row already; a verify's rows wait
    assert got.shape == (1, rows, 2, 512)
    torch.testing.assert_close(got, out_torch, rtol=1e-6, atol=1e-6)
    # the modelled parts are the rank's own head groups: part s is heads s*2 .. of the group's
    for s in range(4):
        torch.testing.assert_close(dcp.unpack(send, 512)[0][s], want_out[:, :, 2 * s:2 * s + 2])


def test_dcp1_is_the_verify_kernel_over_the_whole_context():
    shape = RankShape.of(640, 1, 2, 3)
    call, inp = kernel_dcp.rank_layer(shape, 2, "cpu", torch.float32)
    want, _ = reference.mla_verify_attention(inp["q"], inp["kv"][0], inp["table"], inp["prefix"], inp["mask"],
                                             kernel_dcp.SCALE, 512)
    assert inp["prefix"].tolist() == [640]
    torch.testing.assert_close(call(2), want)  # layer 2 cycles to cache 0


def test_distinct_caches_cap_the_memory_and_keep_two():
    one_m = RankShape.of(1 << 20, 1, 8, 32)
    assert kernel_dcp.distinct_caches(one_m, 61, 8.0) == 6  # 1.2 GB a layer
    assert kernel_dcp.distinct_caches(RankShape.of(1 << 17, 8, 8, 32), 61, 8.0) == 61  # 19 MB a layer
    assert kernel_dcp.distinct_caches(one_m, 61, 0.1) == 2


def test_the_section_writes_every_field(capsys):
    a = args_for()
    rows = kernel_dcp.dcp_section(a, "cpu", kernel_dcp.wall_timer, impl="torch")
    assert [(r["context"], r["rows"], r["mode"]) for r in rows] == [
        (1024, 1, "off"), (1024, 3, "ddtree"), (640, 1, "off"), (640, 3, "ddtree")]
    for r in rows:
        for key, size in (("dcp1", 1), ("dcpN", 4)):
            f = r[key]
            assert "error" not in f, f
            assert f["size"] == size and f["query_heads"] == 2 * size and f["rows"] == r["rows"]
            assert f["layers"] == 3 and f["us_per_layer"] > 0 and f["floor_us"] > 0
            assert isinstance(f["within_floor_plus_5us"], bool) and f["x_floor"] > 0
            # the floor: the share's bf16 bytes, the same flops at DCP 1 and N (N x heads, 1/N keys)
            assert f["bytes"] == f["share"] * 1152
            assert f["flops"] == 2 * r["rows"] * 2 * size * f["share"] * 1088
        assert {"verify_us_per_layer", "dcp_glue_us_per_layer"} <= r["dcpN"].keys()
    assert "DCP4 rank" in capsys.readouterr().out


def test_dcp_is_refused_unless_positive():
    p = argparse.ArgumentParser()
    kernel.add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--dcp", "0"])


def test_the_table_composes_the_dcp_step_from_dcp1s_and_the_ranks_attention(tmp_path, capsys):
    import json

    table = load_benchmark_script("dcp_model_table")
    a = args_for(contexts="1k,3k")
    kern = {"gpu": "cpu", "args": {"dcp": 4, "layers": 3}, "ceilings": {"bytes_per_s": a.bw, "flops_per_s": a.peak},
            "dcp": kernel_dcp.dcp_section(a, "cpu", kernel_dcp.wall_timer, impl="torch")}
    step = {1024: 10.0, 3072: 14.0}  # ms a step at DCP 1: 2 ms per +1k
    sweep = {"dcp": 1, "cuda_graphs": False, "preset": "tiny",
             "runs": [{"context": c, "mode": m, "layers_reported": 61, "ms_per_step": step[c] + (m == "ddtree"),
                       "rows_verified": 1 if m == "off" else 3} for c in step for m in ("off", "ddtree")]}
    (tmp_path / "k.json").write_text(json.dumps(kern))
    (tmp_path / "s.json").write_text(json.dumps(sweep))
    assert table.main([str(tmp_path / "k.json"), str(tmp_path / "s.json"), "--collective-us", "30",
                       "--out", str(tmp_path / "t.json")]) == 0
    res = json.loads((tmp_path / "t.json").read_text())
    assert res["composed"] and res["dcp"] == 4 and not res["sweep_cuda_graphs"]
    assert [(r["context"], r["mode"]) for r in res["rows"]] == [(c, m) for c in step for m in ("off", "ddtree")]
    for r, k in zip(res["rows"], kern["dcp"], strict=True):
        assert r["rows"] == r["sweep_rows"] == k["rows"]
        want = (step[r["context"]] + (r["mode"] == "ddtree") + 61 * (k["dcpN"]["us_per_layer"]
                - k["dcp1"]["us_per_layer"]) / 1e3 + 61 * 30 / 1e3)
        assert r["dcpN_ms_per_step_composed"] == pytest.approx(want)
        assert r["dcpN_collectives_ms"] == pytest.approx(1.83)
    for mode, s in res["slopes"].items():
        assert s["dcp1_ms_per_1k"] == pytest.approx(2.0) and s["dcp1_over_N"] == pytest.approx(0.5)
        rs = [r for r in res["rows"] if r["mode"] == mode]
        extra = [61 * (r["dcpN_attention_us_per_layer"] - r["dcp1_attention_us_per_layer"]) / 1e3 for r in rs]
        assert s["dcpN_ms_per_1k"] == pytest.approx(2.0 + (extra[1] - extra[0]) / 2)
    md = (tmp_path / "t.md").read_text()
    assert "COMPOSED" in md and "EAGER" in md and "DCP4 / DCP1" in md
    with pytest.raises(SystemExit, match="DCP 1 `bench sweep`"):
        table.build(kern, sweep | {"dcp_modelled": True}, 30)


def test_the_section_stops_timing_new_contexts_past_its_budget(capsys):
    rows = kernel_dcp.dcp_section(args_for(budget_s=1e-9), "cpu", kernel_dcp.wall_timer, impl="torch")
    assert [r["context"] for r in rows] == [1024, 1024]  # the first context, then the budget is spent
    assert "budget: skipped dcp 640" in capsys.readouterr().out
