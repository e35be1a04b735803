"""The kimi-k2.6-tp8 preset (issue 41, item 5): one GPU's TP8 slice of Kimi K2.6 as published (INT4
routed experts, the K2.6 DFlash drafter's geometry), the default preset of `bench sweep` and
`doctor`; its tiny twin built the same way runs on the CPU; sweep rows say their expert format
and the floors count INT4 experts' bytes as stored."""

from __future__ import annotations

import json

import pytest
import torch

from treeflash import costs, memory
from treeflash.bench import published
from treeflash.bench.presets import DEFAULT_PRESET, PRESETS, build_preset, preset_memory
from treeflash.cli import main, make_parser
from treeflash.config import DrafterConfig, ModelConfig
from treeflash.kernels.int4 import Int4Weight

CPU = torch.device("cpu")


def configs(name: str) -> tuple[ModelConfig, DrafterConfig]:
    return ModelConfig.from_hf(PRESETS[name].target), DrafterConfig.from_hf(PRESETS[name].drafter)


@pytest.mark.slow
def test_the_k26_slice_has_the_published_geometry():
    cfg, dcfg = configs("kimi-k2.6-tp8")
    full = ModelConfig.from_hf(published.K26_CONFIG)
    assert (cfg.num_attention_heads * 8, cfg.moe_intermediate_size * 8, cfg.vocab_size * 8) == \
        (full.num_attention_heads, full.moe_intermediate_size, full.vocab_size) == (64, 2048, 163840)
    assert cfg.n_routed_experts == 384 and cfg.latent_dim == 576 and cfg.hidden_size == 7168
    assert cfg.int4_expert_layers == (1, 2, 3) and cfg.int4_group_size == 32  # every MoE layer kept
    assert (dcfg.num_hidden_layers, dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim) == \
        (6, 64, 8, 128)
    assert dcfg.block_size == 8 and dcfg.target_layer_ids == (0, 1, 1, 2, 2, 3)  # 1/12/24/35/47/58 of 61
    assert [dcfg.window(i) for i in range(6)] == [4096] * 6 and dcfg.is_causal is False
    assert dcfg.mask_token_id == 163838 - 7 * 20480  # the mask's row in the last vocabulary shard
    assert cfg.eos_token_ids == (163585 - 7 * 20480,)
    assert dcfg.rope.rope_type == "yarn" and dcfg.rope.factor == 64 and dcfg.rope.beta_fast == 32
    assert ModelConfig.from_hf(PRESETS["kimi-k2-tp8"].target).int4_expert_layers == ()  # the bf16 twin stays


def test_the_default_preset_of_sweep_and_doctor():
    parser = make_parser()
    assert DEFAULT_PRESET == "kimi-k2.6-tp8"
    assert parser.parse_args(["bench", "sweep", "--preset"]).preset == DEFAULT_PRESET
    assert parser.parse_args(["doctor", "--preset", "--context", "8k"]).preset == DEFAULT_PRESET
    assert parser.parse_args(["bench", "sweep", "--preset", "kimi-k2-tp8"]).preset == "kimi-k2-tp8"


@pytest.mark.slow
def test_the_estimate_counts_int4_experts_as_stored():
    """Bytes of the 4-layer slice, by hand: bf16 tensors at 2 B, INT4 experts at 0.5625 B a parameter."""
    h, v = 7168, 20480
    attn = h * 1536 + 1536 + 1536 * 8 * 192 + h * 576 + 512 + 512 * 8 * 256 + 8 * 128 * h  # + the latent norms
    moe = 384 * h * 2 + 3 * h * 256 * 2 + 384 * 3 * h * 256 * 9 // 16 + 384 * 4  # router, shared, experts, bias
    target = 2 * v * h * 2 + 4 * (attn + 2 * h) * 2 + h * 2 + 3 * h * 2304 * 2 + 3 * moe + 32 * 4
    layer = h * 8192 + 2 * h * 1024 + 8192 * h + 3 * h * 18432 + 2 * 128 + 2 * h
    drafter = (6 * h * h + 2 * h + 6 * layer) * 2 + 64 * 4
    plan = preset_memory("kimi-k2.6-tp8", CPU, torch.bfloat16, 262144)
    assert plan.weights == target + drafter and plan.int4_experts
    assert plan.kv == (262144 + 128) * 4 * 576 * 2 + 6 * 4095 * (2 * 8 * 128 * 2 + 8)
    assert "routed experts INT4, the rest in bfloat16" in plan.describe()


@pytest.mark.slow
def test_the_real_preset_is_refused_before_building_where_it_does_not_fit(monkeypatch, capsys):
    import treeflash.bench.presets as presets

    monkeypatch.setattr(presets, "build_preset", lambda *a, **k: pytest.fail("the preset was built"))
    monkeypatch.setattr(memory, "device_memory", lambda device: (8 * 10**9, 16 * 10**9, "available CPU RAM"))
    need = preset_memory("kimi-k2.6-tp8", CPU, torch.float32, 1024 + 32, 64)
    for argv in (["bench", "sweep", "--preset", "--contexts", "1k", "--max-tokens", "32"],
                 ["doctor", "--preset", "--context", "1k", "--max-tokens", "32"]):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--device", "cpu", "--tree-budget", "auto"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"preset kimi-k2.6-tp8 at 1056 tokens needs about {memory.gb(need.total)}" in err
        assert "routed experts INT4, the rest in float32" in err
        assert "Instead: --preset tiny-int4 --contexts 1k,4k;" in err  # its twin: INT4 experts too


def test_the_tiny_twin_is_built_the_same_way():
    model, drafter, preset = build_preset("tiny-int4", CPU, torch.float32)
    moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "routed_weights")]
    assert len(moe) == 2 and all(m.expert_format == "int4" for m in moe)
    assert all(isinstance(w, Int4Weight) and w.group_size == 32 for m in moe for w in m.routed_weights())
    assert drafter.cfg.block_size == 8 and drafter.cfg.target_layer_ids == (0, 0, 1, 1, 2, 2)
    tensors = {id(t): t for m in (model, drafter) for t in (*m.parameters(), *m.buffers())}
    built = sum(t.numel() * t.element_size() for t in tensors.values())
    assert preset_memory("tiny-int4", CPU, torch.float32, 64).weights == built


def test_floors_count_the_int4_experts_as_stored():
    """Each expert a step touches adds its packed words and scales (0.5625 B a parameter), per layer."""
    model, drafter, _ = build_preset("tiny-int4", CPU, torch.float32)
    ceilings = costs.Ceilings(1e12, 1e15, "test")
    plan = costs.LayerPlan(61, 1)
    floor = {t: costs.step_floor(model, drafter, ceilings, 64, 8, 3, t, plan)["target_weights"]["bytes"]
             for t in (0.0, 5.0)}
    per_expert = 3 * 64 * 32 * 9 / 16  # gate, up, down of 64 x 32 each
    assert floor[5.0] - floor[0.0] == pytest.approx(5 * per_expert * 60)


@pytest.fixture(scope="module")
def two_sweeps(tmp_path_factory):
    out = tmp_path_factory.mktemp("k26sweep")
    results = []
    for name in ("tiny-int4", "tiny"):
        path = out / f"{name}.json"
        assert main(["bench", "sweep", "--preset", name, "--device", "cpu", "--contexts", "64", "--spec",
                     "off,dflash", "--max-tokens", "10", "--no-progress", "--out", str(path)]) == 0
        results.append(json.loads(path.read_text()))
    return results


@pytest.mark.slow
def test_sweep_rows_say_their_expert_format(two_sweeps, capsys):
    int4, plain = two_sweeps
    assert int4["expert_format"] == "int4" and {r["expert_format"] for r in int4["runs"]} == {"int4"}
    assert plain["expert_format"] == "fp32" and {r["expert_format"] for r in plain["runs"]} == {"fp32"}
    from treeflash.bench.sweep_table import table

    lines = table(int4).splitlines()
    head = next(line for line in lines if "Experts" in line)
    row = next(line for line in lines if "dflash" in line and "|" in line)
    col = [c.strip() for c in head.split("|")].index("Experts")
    assert [c.strip() for c in row.split("|")][col] == "int4"
    assert "routed experts: int4 (W4A16: packed INT4 + bf16 scales" in table(int4)


@pytest.mark.slow
def test_two_sweeps_side_by_side(two_sweeps, tmp_path):
    from treeflash.bench.plot import plot_beside
    from treeflash.bench.sweep_table import beside

    text = beside(two_sweeps)
    assert "tiny-int4 (int4) tok/s" in text and "tiny (fp32) tok/s" in text
    rows = [line for line in text.splitlines() if line.startswith("| 64 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["off", "dflash"]
    want = two_sweeps[0]["runs"][1]["tok_s_mean"] / two_sweeps[1]["runs"][1]["tok_s_mean"]
    assert rows[1].rstrip(" |").endswith(f"{want:.2f}x")
    assert plot_beside(two_sweeps, tmp_path / "b.png").stat().st_size > 10_000


def test_each_spec_run_reaches_its_declared_acceptance(two_sweeps):
    """Oracle: the whole block a step (8 for the K2.6-shaped drafter, 6 for tiny's); a run that
    falls short (or a budget table's ddtree-3 under acceptance 1 that passes 2) is named."""
    from treeflash.bench.sweep_table import acceptance_misses, expected_acceptance

    int4, plain = two_sweeps
    dflash = [next(r for r in res["runs"] if r["mode"] == "dflash") for res in two_sweeps]
    assert [expected_acceptance(r, res) for r, res in zip(dflash, two_sweeps)] == [8, 6]
    assert acceptance_misses(int4) == [] and acceptance_misses(plain) == []
    short = dict(int4, runs=[dict(r, mean_acceptance_length=7.5) for r in int4["runs"]])
    assert acceptance_misses(short) == ["tiny-int4 64 dflash: acceptance length 7.50, declared 8"]
    table = {"preset": "p", "drafter_block_size": 16, "runs": [
        {"context": 1024, "mode": "ddtree-3@1", "spec": "ddtree", "tree_budget": 3, "acceptance": "1",
         "mean_acceptance_length": 2.5},
        {"context": 1024, "mode": "ddtree-3@oracle", "spec": "ddtree", "tree_budget": 3, "acceptance": "oracle",
         "mean_acceptance_length": 4.0},
        {"context": 1024, "mode": "ddtree-auto@oracle", "spec": "ddtree", "tree_budget": "auto",
         "acceptance": "oracle", "mean_acceptance_length": 9.0},
        {"context": 1024, "mode": "off", "mean_acceptance_length": 1.0}]}
    assert acceptance_misses(table) == ["p 1k ddtree-3@1: acceptance length 2.50, declared 2"]


@pytest.mark.slow
def test_the_gpu_scripts_report(two_sweeps, tmp_path):
    """benchmarks/k26_report.py (part 3 of benchmarks/gpu_k26_sweep.sh) on the two sweeps: side by
    side, auto's tables, the acceptance check and the memory plan; a run that missed its declared
    acceptance fails it."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "k26_report.py"
    spec = importlib.util.spec_from_file_location("k26_report", path)
    k26_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(k26_report)
    int4, plain = two_sweeps
    (tmp_path / "1-tiny-int4.json").write_text(json.dumps(int4))
    (tmp_path / "2-tiny.json").write_text(json.dumps(plain))
    text, ok = k26_report.report(tmp_path, "tiny-int4", "tiny", "1k")
    assert ok and "tiny-int4 (int4) tok/s" in text and "ok: every dflash / ddtree-N run" in text
    assert "## tiny (fp32): auto against off" in text and (tmp_path / "beside.png").is_file()
    assert "--gpu-memory h100,h200" in text and "on H200 141GB HBM3e" in text and "(exit 0)" in text
    assert "Memory measured" not in text  # CPU runs: no CUDA peak
    cuda = dict(int4, runs=[dict(r, memory={"peak_allocated_bytes": int4["weights_bytes"] + 3 * 10**8,
                                            "kv_pool_bytes": 10**8}) for r in int4["runs"]])
    assert k26_report.measured_memory(cuda).startswith("tiny-int4: weights built 0.00 GB; peak beyond them and "
                                                       "the KV pool 0.20 GB (most at 64 off)")
    short = dict(int4, partial="1 of 2 contexts", runs=[dict(r, mean_acceptance_length=2.0) for r in int4["runs"]])
    (tmp_path / "1-tiny-int4.json").write_text(json.dumps(short))
    text, ok = k26_report.report(tmp_path, "tiny-int4", "tiny", "1k")
    assert not ok and "MISMATCH" in text and "cut short: 1 of 2 contexts" in text
    (tmp_path / "2-tiny.json").unlink()
    text, ok = k26_report.report(tmp_path, "tiny-int4", "tiny", "1k")
    assert not ok and text.startswith("no result: 2-tiny.json")
