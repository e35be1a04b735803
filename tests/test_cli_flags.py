"""The flags a vLLM / SGLang user types: one spelling in generate, serve, bench sweep and doctor,
aliases that mean the same thing, and refusals that say why (issue 43, item 7)."""

from __future__ import annotations

import argparse

import pytest

from helpers.drafter import write_drafter
from helpers.hf_checkpoints import add_tokenizer, patch_config, write_checkpoint
from treeflash import flags
from treeflash.cli import main, make_parser

COMMANDS = {"generate": ["generate"], "serve": ["serve"], "sweep": ["bench", "sweep"], "doctor": ["doctor"]}


def parse(cmd: str, *argv: str) -> argparse.Namespace:
    words = COMMANDS[cmd] + list(argv) + (["hi"] if cmd == "generate" else [])
    args = make_parser().parse_args(words)
    flags.resolve(args)
    return args


@pytest.mark.slow
@pytest.mark.parametrize("cmd", COMMANDS)
@pytest.mark.parametrize("argv, field, value", [
    (["--speculative-algorithm", "DFLASH"], "spec", "dflash"),
    (["--spec", "dflash"], "spec", "dflash"),
    (["--speculative-algorithm", "none"], "spec", "off"),
    (["--speculative-ddtree-budget", "15"], "tree_budget", 15),
    (["--tree-budget", "auto"], "tree_budget", "auto"),
    (["--speculative-num-draft-tokens", "16"], "tree_budget", 15),  # the root counts
    (["--speculative-draft-model-path", "/d"], "drafter", "/d"),
    (["--model-path", "/m"], "model", "/m"),
    (["--tensor-parallel-size", "2"], "tp", 2),
    (["--tp-size", "2"], "tp", 2),
    (["--ep-size", "2", "--tp", "2"], "ep", 2),
    (["--tp", "4", "--enable-expert-parallel"], "ep", 4),
    (["--dcp", "2", "--tp", "4"], "dcp", 2),
    (["--dcp-size", "2", "--tp", "2"], "dcp", 2),
    (["--decode-context-parallel-size", "4", "--tp", "8"], "dcp", 4),
    (["--block-size", "16"], "page_size", 16),
    (["--enforce-eager"], "cuda_graphs", False),
    (["--disable-cuda-graph"], "cuda_graphs", False),
    (["--dtype", "half"], "dtype", "float16"),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8_e4m3"),  # vLLM's alias
    (["--trust-remote-code"], "trust_remote_code", True),
])
def test_one_spelling_in_every_command(cmd, argv, field, value):
    if cmd == "sweep" and field in ("spec", "tree_budget"):
        value = [value]  # bench sweep runs a list of modes and of budgets
    assert getattr(parse(cmd, *argv), field) == value


@pytest.mark.parametrize("cmd", ["generate", "serve"])
@pytest.mark.parametrize("argv, field, value", [
    (["--max-num-seqs", "8"], "max_running_requests", 8),
    (["--max-running-requests", "8"], "max_running_requests", 8),
    (["--gpu-memory-utilization", "0.5"], "mem_fraction", 0.5),
    (["--mem-fraction-static", "0.5"], "mem_fraction", 0.5),
    (["--context-length", "128"], "max_model_len", 128),
    (["--max-model-len", "128"], "max_model_len", 128),
])
def test_engine_size_flags_where_an_engine_serves(cmd, argv, field, value):
    assert getattr(parse(cmd, *argv), field) == value


@pytest.mark.parametrize("argv, field, value", [
    (["--model-path", "/m"], "model", "/m"),
    (["--speculative-draft-model-path", "/d"], "drafter", "/d"),
    (["--speculative-ddtree-budget", "off,3,auto"], "tree_budget", ["off", 3, "auto"]),
    (["--tree-budget", "7"], "tree_budget", [7]),
    (["--block-size", "16"], "page_size", 16),
    (["--dtype", "half"], "dtype", "float16"),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8_e4m3"),  # vLLM's alias
    (["--enforce-eager"], "cuda_graphs", False),
])
def test_bench_serve_shares_the_model_flags(argv, field, value):
    args = make_parser().parse_args(["bench", "serve", *argv])
    flags.resolve(args)
    assert getattr(args, field) == value


def test_sweep_budget_lists_in_either_spelling():
    assert parse("sweep", "--tree-budget", "1,3,auto").tree_budget == [1, 3, "auto"]
    assert parse("sweep", "--speculative-num-draft-tokens", "4,8").tree_budget == [3, 7]
    assert parse("sweep", "--speculative-num-draft-tokens", "8", "--tree-budget", "7").tree_budget == [7]
    with pytest.raises(ValueError, match="a DDTree budget of"):
        parse("sweep", "--speculative-num-draft-tokens", "8", "--tree-budget", "3")


def test_serve_takes_the_model_as_vllm_does():
    assert parse("serve", "/m").model == "/m"
    with pytest.raises(ValueError, match="two models given"):
        parse("serve", "/m", "--model", "/other")


@pytest.mark.parametrize("cmd, argv, words", [
    ("serve", ["--pipeline-parallel-size", "2"], "pipeline parallelism is not implemented"),
    ("generate", ["-pp", "2"], "pipeline parallelism is not implemented"),
    ("serve", ["--data-parallel-size", "2"], "data parallelism is not implemented"),
    ("doctor", ["--speculative-num-steps", "3"], "node budget"),
    ("serve", ["--speculative-eagle-topk", "4"], "node budget"),
    ("serve", ["--speculative-config", '{"method": "eagle"}'], "--speculative-draft-model-path"),
    ("sweep", ["--max-num-seqs", "8"], "sizes an engine for serving"),
    ("doctor", ["--gpu-memory-utilization", "0.9"], "sizes an engine for serving"),
    ("serve", ["--kv-cache-dtype", "fp8_e5m2"], "fp8_e5m2: not implemented"),
    ("generate", ["--kv-cache-dtype", "fp8_e5m2"], "fp8_e5m2: not implemented"),
    ("serve", ["--quantization", "awq"], "not implemented"),
    ("sweep", ["--speculative-algorithm", "eagle"], "expected DDTREE, DFLASH or NONE"),
    ("serve", ["--speculative-num-draft-tokens", "1"], "must be >= 2"),
    ("serve", ["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
])
def test_what_treeflash_does_not_do_is_refused_with_the_reason(cmd, argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        parse(cmd, *argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--enforce-eager", "--cuda-graphs"], "contradict"),
    (["--speculative-num-draft-tokens", "8", "--speculative-ddtree-budget", "5"], "a DDTree budget of 7"),
    (["--tp", "4", "--ep", "2", "--enable-expert-parallel"], "give one"),
    (["--tp", "4", "--dcp", "3"], "--dcp 3 must divide --tp 4"),
    (["--gpu-memory-utilization", "0.5", "--max-total-tokens", "4096"], "give one"),
    (["--device", "cpu", "--kv-cache-dtype", "bfloat16"], "kept in the model's dtype (float32 here)"),
])
def test_contradictions_exit_2_before_loading(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "/nonexistent", *argv])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_kv_cache_dtype_naming_the_model_dtype_is_accepted():
    assert parse("serve", "--device", "cpu", "--kv-cache-dtype", "float32").kv_cache_dtype == "float32"
    assert parse("serve", "--device", "cpu", "--dtype", "bf16", "--kv-cache-dtype", "bfloat16").dtype == "bfloat16"


@pytest.fixture(scope="module")
def fp8_declared(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("q") / "m")
    patch_config(path, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    return path


def test_quantization_is_checked_against_what_the_checkpoint_declares(fp8_declared, pair, capsys):
    assert parse("serve", "--model", str(fp8_declared), "--quantization", "fp8").quantization == "fp8"
    assert parse("serve", "--model", str(fp8_declared), "--quantization", "None").quantization is None
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", str(fp8_declared), "--quantization", "compressed-tensors"])
    assert e.value.code == 2
    assert "declares fp8" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a bf16/fp32 checkpoint: nothing is quantized at load time
        main(["generate", "--model", str(pair[0]), "--quantization", "fp8", "hi"])
    assert e.value.code == 2
    assert "declares no quantization_config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "sweep", "--preset", "tiny", "--quantization", "fp8"])
    assert "preset tiny declares no quantization_config" in capsys.readouterr().err


def test_num_draft_tokens_runs_the_budget_it_means(tmp_path, capsys):
    import json

    target = write_checkpoint(tmp_path / "m")
    add_tokenizer(target)
    drafter = write_drafter(tmp_path / "d", hidden_size=64, vocab_size=96, num_target_layers=3,
                            target_layer_ids=(0, 2), block_size=4, mask_token_id=95)
    rc = main(["generate", "--model", str(target), "--speculative-draft-model-path", str(drafter),
               "--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "9", "--device", "cpu",
               "--enforce-eager", "--max-tokens", "6", "--json", "hi"])
    assert rc == 0
    spec = json.loads(capsys.readouterr().out)["metrics"]["speculative_decoding"]
    assert spec["tree_budget"] == 8 and spec["spec_mode"] == "ddtree"


def test_help_of_each_command_names_the_sglang_flags(capsys):
    for words in COMMANDS.values():
        with pytest.raises(SystemExit):
            main([*words, "--help"])
        out = capsys.readouterr().out
        for flag in ("--speculative-algorithm", "--speculative-ddtree-budget", "--tensor-parallel-size",
                     "--enforce-eager", "--kv-cache-dtype", "--quantization", "--speculative-num-draft-tokens"):
            assert flag in out, (words, flag)
