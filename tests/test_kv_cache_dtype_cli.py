"""--kv-cache-dtype from the command line to the pool (issue 45): auto / fp8_e4m3 and vLLM's fp8
alias parse in every model-running command, fp8_e5m2 is refused with the reason, and each entry
point (generate, serve, bench sweep, bench serve, doctor) builds its KVPool in fp8_e4m3 rows; the
memory estimate and the floors count the fp8 row's bytes."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from helpers.drafter import write_drafter
from helpers.hf_checkpoints import add_tokenizer, write_checkpoint
from treeflash import flags
from treeflash.cli import main, make_parser
from treeflash.kvcache.pool import KVPool

COMMANDS = {"generate": ["generate"], "serve": ["serve"], "sweep": ["bench", "sweep"], "doctor": ["doctor"],
            "bench serve": ["bench", "serve"]}


def parse(cmd: str, *argv: str):
    args = make_parser().parse_args(COMMANDS[cmd] + list(argv) + (["hi"] if cmd == "generate" else []))
    flags.resolve(args)
    return args


@pytest.mark.parametrize("cmd", COMMANDS)
@pytest.mark.parametrize("text, want", [("auto", "auto"), ("fp8", "fp8_e4m3"), ("FP8_E4M3", "fp8_e4m3"),
                                        ("fp8_ds_mla", "fp8_e4m3")])
def test_kv_cache_dtype_parses_in_every_command(cmd, text, want):
    assert parse(cmd, "--kv-cache-dtype", text).kv_cache_dtype == want


@pytest.mark.parametrize("cmd", ["generate", "serve", "sweep", "doctor"])
def test_fp8_e5m2_is_refused_with_the_reason(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        parse(cmd, "--kv-cache-dtype", "fp8_e5m2")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "fp8_e5m2: not implemented" in err and "--kv-cache-dtype fp8_e4m3" in err


@pytest.mark.parametrize("text, words", [("int8", "expected auto, fp8_e4m3"), ("fp8_e3m4", "expected fp8_e4m3")])
def test_unknown_cache_dtypes_name_the_choices(text, words, capsys):
    with pytest.raises(SystemExit):
        parse("serve", "--kv-cache-dtype", text)
    assert words in capsys.readouterr().err


@pytest.fixture
def pools(monkeypatch):
    """The row format of every KVPool built while the test runs."""
    seen: list[str] = []
    init = KVPool.__init__

    def record(self, *args, **kw):
        init(self, *args, **kw)
        seen.append(self.format.label)

    monkeypatch.setattr(KVPool, "__init__", record)
    return seen


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A target (kv_lora_rank 32: whole 16-byte scale groups) with a tokenizer and a drafter."""
    root = tmp_path_factory.mktemp("kv_dtype")
    target = write_checkpoint(root / "m", initializer_range=0.3, max_position_embeddings=1024)
    add_tokenizer(target)
    drafter = write_drafter(root / "d", hidden_size=64, vocab_size=96, num_target_layers=3,
                            target_layer_ids=(0, 2), block_size=4, mask_token_id=95)
    return ["--model", str(target), "--drafter", str(drafter), "--device", "cpu"]


def test_generate_builds_an_fp8_pool(tiny, pools, capsys):
    assert main(["generate", *tiny, "--kv-cache-dtype", "fp8", "--max-tokens", "6", "--json", "hi"]) == 0
    assert pools == ["fp8_e4m3"]
    assert json.loads(capsys.readouterr().out)["num_tokens"] == 6


def test_serve_builds_an_fp8_pool_and_logs_its_tokens(tiny, pools, monkeypatch, caplog):
    from treeflash.server import cli

    class Stop(Exception):
        pass

    def stop(*a, **kw):
        raise Stop

    monkeypatch.setattr("treeflash.server.app.create_app", stop)
    args = make_parser().parse_args(["serve", *tiny, "--kv-cache-dtype", "fp8", "--max-total-tokens", "4096"])
    flags.resolve(args)
    with caplog.at_level(logging.INFO), pytest.raises(Stop):
        cli._load_and_serve(args, None, args.drafter, "ddtree")
    assert pools == ["fp8_e4m3"]
    assert "fp8_e4m3 rows, 64 B a token a layer" in caplog.text  # D 40, v 32: 32 + 16 + 16 bytes


@pytest.mark.slow
def test_bench_sweep_runs_over_fp8_rows(pools, tmp_path):
    out = tmp_path / "s.json"
    assert main(["bench", "sweep", "--preset", "tiny", "--device", "cpu", "--contexts", "64", "--spec", "off",
                 "--max-tokens", "4", "-q", "--kv-cache-dtype", "fp8", "--out", str(out)]) == 0
    assert pools and set(pools) == {"fp8_e4m3"}
    data = json.loads(out.read_text())
    assert data["kv_cache_dtype"] == "fp8_e4m3"
    assert data["runs"] and all(r["kv_cache_dtype"] == "fp8_e4m3" for r in data["runs"])


def test_bench_serve_runs_over_fp8_rows(tiny, pools, tmp_path):
    assert main(["bench", "serve", *tiny, "--concurrency", "1", "--tree-budget", "off", "--max-tokens", "4",
                 "--prompt-len", "8", "-q", "--kv-cache-dtype", "fp8", "--out", str(tmp_path / "r.json")]) == 0
    assert pools and set(pools) == {"fp8_e4m3"}


def test_doctor_checks_the_fp8_cache(tiny, pools, capsys):
    main(["doctor", *tiny, "--spec", "off", "--context", "64", "--max-tokens", "4", "-q", "--kv-cache-dtype", "fp8"])
    out = capsys.readouterr().out
    assert pools and set(pools) == {"fp8_e4m3"}
    assert "KV tokens per GPU: fp8_e4m3 rows: 64 B a token a layer" in out, out


def test_memory_counts_the_fp8_row():
    """Kimi K2 geometry: 61 layers x 656 B a token in fp8_e4m3 rows, 61 x 1152 in bf16; the plan's
    KV follows."""
    from treeflash import memory
    from treeflash.bench.presets import PRESETS
    from treeflash.config import ModelConfig

    cfg = ModelConfig.from_hf(PRESETS["kimi-k2-tp8"].target)
    assert memory.kv_bytes_per_token(cfg, torch.bfloat16) == cfg.num_hidden_layers * 1152
    assert memory.kv_bytes_per_token(cfg, torch.bfloat16, None, "fp8_e4m3") == cfg.num_hidden_layers * 656
    assert memory.kv_bytes_per_token(cfg, torch.bfloat16, None, "fp8") == cfg.num_hidden_layers * 656
    plan = memory.plan(cfg, None, torch.bfloat16, torch.device("meta"), 1000, 1, "fp8_e4m3")
    assert plan.kv == 1000 * cfg.num_hidden_layers * 656 and "in fp8_e4m3 rows" in plan.describe()


def test_a_preset_too_big_is_told_fp8_would_fit(monkeypatch):
    """The refusal names --kv-cache-dtype fp8_e4m3 where the fp8 rows bring it under the free memory."""
    from treeflash import memory
    from treeflash.bench import presets
    from treeflash.config import ModelConfig

    ctx = 1 << 20
    bf16 = presets.preset_memory("kimi-k2-tp8", torch.device("cpu"), torch.bfloat16, ctx, 32)
    fp8 = presets.preset_memory("kimi-k2-tp8", torch.device("cpu"), torch.bfloat16, ctx, 32, "fp8_e4m3")
    layers = ModelConfig.from_hf(presets.PRESETS["kimi-k2-tp8"].target).num_hidden_layers  # the built slice
    assert bf16.kv - fp8.kv == (ctx + 32) * layers * (1152 - 656)
    free = (bf16.total + fp8.total) // 2
    monkeypatch.setattr(memory, "device_memory", lambda device: (free, 2 * free, "test memory"))
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3 "):
        presets.check_preset_fits("kimi-k2-tp8", torch.device("cpu"), torch.bfloat16, ctx, 31)
    presets.check_preset_fits("kimi-k2-tp8", torch.device("cpu"), torch.bfloat16, ctx, 31, "fp8")


def test_floors_and_the_auto_sizer_read_the_fp8_row(tiny):
    """costs/floor.py: the attention part reads kv_row_bytes a token a layer; the auto budget's cost model
    (built from the engine) takes the pool's row."""
    from treeflash import LLM, costs

    llm = LLM(tiny[1], tiny[3], tree_budget="auto", device="cpu", max_model_len=256, kv_cache_dtype="fp8")
    model = llm.engine.model
    assert costs.attention_part(model, 1000, 1, 64).bytes == 1000 * 64
    assert costs.attention_part(model, 1000, 1).bytes == 1000 * 40 * 4  # float32 rows
    drafter = getattr(llm.engine.spec.drafter, "inner", llm.engine.spec.drafter)
    assert llm.engine.step_costs(drafter).costs.cache_row_bytes == llm.pool.format.row_bytes == 64
