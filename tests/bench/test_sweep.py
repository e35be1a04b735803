"""bench sweep on the CPU: table, JSON and PNG from a tiny checkpoint pair and the tiny preset."""

from __future__ import annotations

import json

import pytest

from treeflash.bench import floors
from treeflash.bench.presets import PRESETS, build_preset
from treeflash.cli import main
from treeflash.config import DrafterConfig, ModelConfig

VOCAB = 96


@pytest.mark.slow
def test_sweep_checkpoint_pair_writes_table_json_png(pair, tmp_path, capsys, monkeypatch):
    target, drafter = pair
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["bench", "sweep", "--model", str(target), "--drafter", str(drafter), "--device", "cpu",
               "--contexts", "64,300", "--spec", "off,dflash,ddtree", "--tree-budget", "8",
               "--max-tokens", "16", "--page-size", "16", "--out", str(out), "--plot", str(png),
               "--no-progress", "--runtime-option", "fused_topk=0"])  # (CUDA-only: recorded, no effect here)
    assert rc == 0
    text = capsys.readouterr().out
    assert "Decode (tok/s)" in text and "ms/step" in text and "x floor" in text
    assert "slope ddtree" in text and "per +1k context" in text
    assert "switches away from their defaults: fused_topk=0" in text
    assert png.stat().st_size > 1000
    res = json.loads(out.read_text())
    assert res["meta"]["commit"] and res["meta"]["device_type"] == "cpu" and res["meta"]["date"]
    assert res["meta"]["switches"] == {"fused_topk": "0"}
    assert res["fill"] == "prefill" and not res["extrapolated"]
    assert res["acceptance"] == "the real drafter's own proposals"
    runs = {(r["context"], r["mode"]): r for r in res["runs"]}
    assert set(runs) == {(c, m) for c in (64, 300) for m in ("off", "dflash", "ddtree")}
    for r in runs.values():
        assert r["ms_per_step"] > 0 and r["tok_s"] > 0 and r["floor_ms"] > 0
        assert r["parts"]["attention_kernel"]["ms"] > 0 and r["kv_gbps"] > 0
        assert set(r["part_floors"]) == {"attention", "target_weights", "drafter"}
        assert r["kv_page_rows"] == 64  # pages of 16 in aligned runs: read as 64-row pages
    assert runs[(300, "ddtree")]["nodes_verified"] == 8
    assert runs[(300, "dflash")]["nodes_verified"] == 5
    assert runs[(300, "off")]["mean_acceptance_length"] == 1.0
    assert set(res["slopes"]) == {"off", "dflash", "ddtree"}
    assert res["ceilings"]["bandwidth"] > 0 and "measured" in res["ceilings"]["source"]


@pytest.mark.slow
@pytest.mark.parametrize("acceptance, expect", [("oracle", 6.0), ("2", 3.0)])
def test_sweep_preset_declared_acceptance(tmp_path, capsys, acceptance, expect):
    out = tmp_path / "p.json"
    rc = main(["bench", "sweep", "--preset", "tiny", "--device", "cpu", "--contexts", "128,512",
               "--spec", "off,ddtree", "--max-tokens", "30", "--acceptance", acceptance,
               "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["fill"] == "random" and "random latents" in res["fill_note"]
    assert ("oracle" if acceptance == "oracle" else "fixed") in res["acceptance"]
    for r in res["runs"]:
        if r["mode"] == "ddtree":
            assert r["mean_acceptance_length"] == pytest.approx(expect)
            assert r["declared_acceptance"]
        # MoE load per step: the worst layer's tokens per expert, max/mean (>= 1 when routed);
        # one rank without --ep, so the per-rank figure is balanced by construction
        assert r["moe_expert_max_over_mean"] >= 1.0 and r["moe_rank_max_over_mean"] == 1.0
    assert (tmp_path / "p.png").is_file()
    assert "Decode (tok/s)" in capsys.readouterr().out


def test_sweep_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "sweep", "--preset", "tiny", "--device", "cpu", "--spec", "turbo"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["bench", "sweep", "--preset", "tiny", "--device", "cpu", "--acceptance", "drafter"])
    assert e.value.code == 2 and "random drafter" in capsys.readouterr().err
    for argv, words in ((["--contexts", "abc"], "expected token counts like 1k"),
                        (["--bandwidth", "0"], "--bandwidth: must be a finite number > 0"),  # was: "overridden", unused
                        (["--matmul", "-5"], "--matmul: must be a finite number > 0")):
        with pytest.raises(SystemExit) as e:
            main(["bench", "sweep", "--preset", "tiny", "--device", "cpu", *argv])
        assert e.value.code == 2 and words in capsys.readouterr().err


def test_presets_have_real_geometry():
    tp8 = ModelConfig.from_hf(PRESETS["kimi-k2-tp8"].target)
    assert (tp8.num_attention_heads, tp8.kv_lora_rank, tp8.qk_rope_head_dim, tp8.hidden_size) == (8, 512, 64, 7168)
    assert tp8.latent_dim == 576 and tp8.n_routed_experts == 384 and tp8.moe_intermediate_size == 2048 // 8
    assert PRESETS["kimi-k2-tp8"].full_layers == 61 and "extrapolated to 61" in PRESETS["kimi-k2-tp8"].notes
    for name in ("kimi-k2", "deepseek-v3", "kimi-k2-tp8"):
        cfg = ModelConfig.from_hf(PRESETS[name].target)
        DrafterConfig.from_hf(PRESETS[name].drafter).check_fits(cfg)
    assert ModelConfig.from_hf(PRESETS["kimi-k2"].target).num_attention_heads == 64
    assert ModelConfig.from_hf(PRESETS["deepseek-v3"].target).num_attention_heads == 128


def test_attention_floor_is_design_formula():
    import torch

    model, drafter, _ = build_preset("tiny", torch.device("cpu"), torch.float32)
    cfg = model.cfg
    part = floors.attention_part(model, 1000, 33)
    assert part.bytes == 1000 * cfg.latent_dim * 4
    assert part.flops == 2 * 33 * cfg.num_attention_heads * 1000 * (cfg.latent_dim + cfg.kv_lora_rank)
    c = floors.Ceilings(4.24e12, 779e12, "test")
    f = floors.step_floor(model, drafter, c, 1000, 33, 5.0, 4.0)
    assert f["step_s"] == pytest.approx(sum(f[k]["s"] for k in ("attention", "target_weights", "drafter")))
    more = floors.step_floor(model, drafter, c, 1000, 33, 5.0, 8.0)
    assert more["target_weights"]["bytes"] > f["target_weights"]["bytes"]  # touched experts count
    plan = floors.LayerPlan(61, 1)
    assert floors.step_floor(model, drafter, c, 1000, 33, 5.0, 4.0, plan)["attention"]["bytes"] == 61 * part.bytes


def test_preset_keeps_router_biases_float32_as_the_loader():
    """A 16-bit preset's routers carry float32 score-correction biases, as `load_target` leaves
    them: a 16-bit one would be cast every MoE call (a copy kernel a layer the real model has not)."""
    import torch

    model, _, _ = build_preset("tiny", torch.device("cpu"), torch.bfloat16)
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert gates and all(g.e_score_correction_bias.dtype == torch.float32 for g in gates)
    assert all(g.weight.dtype == torch.bfloat16 for g in gates)


def test_bench_kernel_is_registered_when_present(capsys):
    pytest.importorskip("treeflash.bench.kernel")
    with pytest.raises(SystemExit) as e:
        main(["bench", "kernel", "--help"])
    assert e.value.code == 0 and "--contexts" in capsys.readouterr().out


@pytest.mark.slow
def test_sweep_embedded_pair_by_default(tmp_path, capsys):
    """No --model/--preset: the shipped pair, real prefill, the real drafter's acceptance."""
    out, png = tmp_path / "e.json", tmp_path / "e.png"
    rc = main(["bench", "sweep", "--device", "cpu", "--contexts", "128,256", "--spec", "off,ddtree",
               "--tree-budget", "8", "--max-tokens", "12", "--out", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["fill"] == "prefill" and res["acceptance"] == "the real drafter's own proposals"
    assert {(r["context"], r["mode"]) for r in res["runs"]} == {(c, m) for c in (128, 256) for m in ("off", "ddtree")}
    assert all(r["tok_s"] > 0 for r in res["runs"]) and png.stat().st_size > 1000
    assert "Decode (tok/s)" in capsys.readouterr().out


def test_sweep_embedded_pair_auto_budget(tmp_path):
    """The shipped pair under auto: its warm-up's steps (inference mode) made the MoE's expert
    counts, which the timed request's real prefill then zeroed in place (refused under no_grad)."""
    out = tmp_path / "a.json"
    rc = main(["bench", "sweep", "--device", "cpu", "--contexts", "128", "--spec", "ddtree",
               "--tree-budget", "auto", "--max-tokens", "12", "--out", str(out), "--plot", str(tmp_path / "a.png"),
               "--no-progress"])
    assert rc == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["tree_budget"] == "auto" and run["tok_s"] > 0
    # what auto did, plan by plan: one plan a step of the timed request, its buckets priced
    plans = [p.split() for p in run["auto_plans"].split(", ")]
    assert sum(int(n[1:]) for _, _, n in plans) == sum(run["steps_by_budget"].values()) + run["plain_steps"]
    assert [b["budget"] for b in run["auto_explain"]["buckets"]] == [1, 3, 7, 15, 31, 63]


def test_graph_replay_time_is_extrapolated_to_the_full_layer_count():
    """Under CUDA graphs per-module timers see nothing: the target forward's replay time
    (device events) scales with the layer count instead, and the step grows by the rest."""
    import torch

    from treeflash.bench import sweep
    from treeflash.bench.presets import load_rig

    rig = load_rig(None, None, "tiny", torch.device("cpu"), torch.float32)
    built = floors.LayerPlan.of(rig.model)
    plan = floors.LayerPlan(built.total * 4, built.dense * 4)
    ceilings = floors.Ceilings(1e12, 1e14, "test")
    samples = [sweep.StepSample(wall_s=0.010, tokens=1, nodes=0, accepted=0, touched_experts=None,
                                graph_s=0.004) for _ in range(5)]
    r = sweep.summarise(rig, 256, "off", samples, ceilings, plan, None)
    assert r["ms_per_step_measured"] == pytest.approx(10.0)
    assert r["ms_per_step"] == pytest.approx(10.0 + 4.0 * 3)  # + the replay x (4x layers - 1)
    assert r["parts"]["target_forward_graph"]["ms"] == pytest.approx(16.0)
    # spec steps: the synced phase timers of the instrumented steps beside the replay
    spec = samples + [sweep.StepSample(0.012, 1, 0, 0, None, graph_s=None,
                                       parts={"drafter": 0.003, "verify": 0.005, "walk_commit": 0.001})
                      for _ in range(3)]
    r = sweep.summarise(rig, 256, "off", spec, ceilings, plan, None)
    assert r["ms_per_step"] == pytest.approx(10.0 + 4.0 * 3)
    assert r["parts"]["verify"]["ms"] == pytest.approx(5.0 + 4.0 * 3)  # its replay share scaled
    assert r["parts"]["drafter"]["ms"] == pytest.approx(3.0)  # the drafter does not scale
    assert r["parts"]["host_other"]["ms_measured"] == pytest.approx(12.0 - 9.0)
    # every step is in the JSON too, so an outlier behind a median is visible
    assert r["step_wall_ms"] == pytest.approx([10.0] * 3)  # after the 2 warm-up steps
    assert r["instrumented_wall_ms"] == pytest.approx([12.0] * 3)
    assert r["instrumented_host_ms"] == pytest.approx([3.0] * 3)
    spec[-1] = sweep.StepSample(0.040, 1, 0, 0, None, graph_s=None,
                                parts={"drafter": 0.003, "verify": 0.005, "walk_commit": 0.001})
    r = sweep.summarise(rig, 256, "off", spec, ceilings, plan, None)
    assert r["instrumented_host_ms"] == pytest.approx([3.0, 3.0, 31.0])
    assert sweep._host_spread(r) == "256 off: 3.00, 3.00, 31.00 ms"  # named under the table
    r["instrumented_host_ms"] = [3.0, 3.0, 4.0]
    assert sweep._host_spread(r) is None
    # the step that finished the request (its pages freed on the host) is not a decode step
    teardown = spec + [sweep.StepSample(0.500, 1, 0, 0, None, graph_s=None, finishing=True,
                                        parts={"drafter": 0.003, "verify": 0.005, "walk_commit": 0.001})]
    assert sweep.summarise(rig, 256, "off", teardown, ceilings, plan, None)["instrumented_host_ms"] == \
        pytest.approx([3.0, 3.0, 31.0])
    eager = [sweep.StepSample(0.010, 1, 0, 0, None) for _ in range(5)]
    assert sweep.summarise(rig, 256, "off", eager, ceilings, plan, None)["ms_per_step"] == pytest.approx(10.0)


def test_planted_chain_makes_greedy_continuation_next_token_by_a_wide_margin():
    import torch

    from treeflash.bench.presets import load_rig
    from treeflash.bench.sweep import RunConfig, decode_run

    rig = load_rig(None, None, "tiny", torch.device("cpu"), torch.bfloat16)
    ids = decode_run(rig, 64, "off", RunConfig([64], ["off"], max_tokens=12, progress=False)).token_ids
    v = rig.cfg.vocab_size
    assert all(b == (a + 1) % v for a, b in zip(ids, ids[1:])), ids


@pytest.mark.slow
def test_budget_table_of_declared_acceptances(tmp_path, capsys, monkeypatch):
    """--tree-budget 1,3,auto --acceptance 0,oracle: every (acceptance, budget) run at every context
    once, off once a context, and the budget table: auto beside the best of off and the fixed
    budgets, the bars that apply (acceptance 0: against off too), auto's steps by budget. With
    graphs (their static path, eagerly on the CPU) and overlapped steps (the GPU's defaults), an
    auto run meets no new graph inside its timed steps: every plan was warmed first."""
    out = tmp_path / "t.json"
    rc = main(["bench", "sweep", "--preset", "tiny", "--device", "cpu", "--contexts", "128,512",
               "--spec", "off,ddtree", "--tree-budget", "1,3,auto", "--acceptance", "0,oracle",
               "--max-tokens", "16", "--cuda-graphs", "--out", str(out), "--no-progress",
               "--runtime-option", "overlap=1"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "acceptance 0 (decode tok/s" in text and "acceptance oracle (decode tok/s" in text
    res = json.loads(out.read_text())
    modes = {(r["context"], r["mode"]) for r in res["runs"]}
    want = {(c, "off") for c in (128, 512)} | {(c, f"ddtree-{b}@{a}") for c in (128, 512)
                                                 for b in (1, 3, "auto") for a in ("0", "oracle")}
    assert modes == want and len(res["runs"]) == len(want)
    rows = {(r["acceptance"], r["context"]): r for r in res["comparison"]}
    assert set(rows) == {(a, c) for a in ("0", "oracle") for c in (128, 512)}
    for (a, _), row in rows.items():
        assert set(row["fixed"]) == {"1", "3"} and row["off"] > 0 and row["auto"] > 0
        assert row["auto_over_best"] == pytest.approx(row["auto"] / max([row["off"], *row["fixed"].values()]))
        # (acceptance 0: auto's untapped plain step against off's step too, where it ran untapped)
        assert {"best", "off"} <= set(row["bar"]) <= {"best", "off", "plain_step"} if a == "0" else \
            set(row["bar"]) == {"best"}
        assert sum(row["auto_steps_by_budget"].values()) + row["auto_plain_steps"] > 0
    for r in res["runs"]:
        if r["mode"].startswith("ddtree-") and r["acceptance"] == "oracle" and r["tree_budget"] != "auto":
            assert r["mean_acceptance_length"] == pytest.approx(1 + int(r["tree_budget"]))  # a chain that long
        if r["mode"].startswith("ddtree-") and r["acceptance"] == "0":
            assert r["mean_acceptance_length"] == 1.0
        if r.get("tree_budget") == "auto":
            assert r["captures_timed"] == 0, r["mode"]
        if r["mode"] == "off":
            assert set(r["plain_step_ms"]) == {"off"} and r["plain_step_ms"]["off"]["steps"] > 0
        elif r.get("tree_budget") == "auto" and r["acceptance"] == "0":
            assert r["plain_step_ms"] and set(r["plain_step_ms"]) <= {"tapped", "untapped"}


@pytest.mark.slow
def test_a_sweep_stopped_midway_keeps_the_contexts_it_ran(tmp_path, monkeypatch):
    """The JSON is written after each context (marked partial), so a sweep killed by its time
    limit at a later context still leaves the earlier ones on disk; the last write is whole."""
    from treeflash.bench import sweep

    real = sweep.decode_run

    def stop_at_128(rig, context, *a, **kw):
        if context == 128:
            raise RuntimeError("stopped at 128")
        return real(rig, context, *a, **kw)

    monkeypatch.setattr(sweep, "decode_run", stop_at_128)
    out = tmp_path / "s.json"
    argv = ["bench", "sweep", "--preset", "tiny", "--device", "cpu", "--contexts", "64,128", "--spec", "off",
            "--max-tokens", "6", "--out", str(out), "--no-progress"]
    with pytest.raises(RuntimeError, match="stopped at 128"):
        main(argv)
    res = json.loads(out.read_text())
    assert res["partial"] == "1 of 2 contexts" and [r["context"] for r in res["runs"]] == [64]
    monkeypatch.setattr(sweep, "decode_run", real)
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert "partial" not in res and [r["context"] for r in res["runs"]] == [64, 128]
