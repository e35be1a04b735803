"""Tiny CPU runs of every `treeflash train` stage: checkpoints, resume, formats, bad arguments.

Also pins the pieces the acceptance figures rest on: the one-pass multi-block drafter
forward equals the z-lab reference forward per anchor, and the DDTree/chain walks.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.train import TINY_D, TINY_T, tiny_tokenized
from treeflash.train.cli import main

pytestmark = pytest.mark.slow

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    tiny_tokenized(root)
    assert main(["target", "--data", str(root / "tok"), "--out", str(root / "target"), *TINY_T,
                 "--steps", "4", "--save-every", "2", "--eval-every", "2", "--eval-batches", "1"]) == 0
    assert main(["drafter", "--data", str(root / "tok"), "--target", str(root / "target"), "--out",
                 str(root / "drafter"), *TINY_D, "--steps", "3", "--eval-every", "3", "--eval-batches", "1"]) == 0
    return root


def test_tokenizer_stage(run):
    man = json.loads((run / "tok" / "data" / "manifest.json").read_text())
    assert man["vocab_size"] == 400 and man["tokens"]["train"] > 1000 and man["heldout_files"] > 0
    assert (run / "tok" / "tokenizer.json").is_file()


def test_target_is_hf_deepseek_v3(run):
    from transformers import DeepseekV3ForCausalLM

    cfg = json.loads((run / "target" / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["rope_parameters"]["rope_type"] == "yarn"
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_shared_experts"] == 1 and cfg["n_routed_experts"] == 4
    from safetensors import safe_open

    with safe_open(run / "target" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in keys  # per-expert HF names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys
    model = DeepseekV3ForCausalLM.from_pretrained(run / "target")
    assert model(torch.tensor([[0, 5, 6]])).logits.shape == (1, 3, 400)
    assert (run / "target" / "tokenizer.json").is_file()
    bias = torch.cat([m.e_score_correction_bias for n, m in model.named_modules() if n.endswith("mlp.gate")])
    assert bias.abs().sum() > 0  # the aux-loss-free balancer moved it


def test_target_resume(run):
    ck = torch.load(run / "target" / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 4
    assert main(["target", "--data", str(run / "tok"), "--out", str(run / "target"), *TINY_T, "--steps", "6",
                 "--save-every", "2", "--eval-every", "3", "--eval-batches", "1", "--resume"]) == 0
    ck = torch.load(run / "target" / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 6 and [h["step"] for h in ck["history"]] == [2, 4, 6]  # history carried over


def test_drafter_is_zlab_format_and_resumes(run):
    from dflash.model import DFlashDraftModel

    cfg = json.loads((run / "drafter" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == 3 and cfg["dflash_config"]["block_size"] == 4
    assert sorted(cfg["layer_types"]) == ["full_attention", "sliding_attention"] and cfg["use_sliding_window"]
    d = DFlashDraftModel.from_pretrained(run / "drafter")
    assert d.target_layer_ids == [0, 1] and d.mask_token_id == 3
    assert main(["drafter", "--data", str(run / "tok"), "--target", str(run / "target"), "--out",
                 str(run / "drafter"), *TINY_D, "--steps", "5", "--eval-every", "5", "--eval-batches", "1",
                 "--resume"]) == 0
    assert torch.load(run / "drafter" / "checkpoint.pt", weights_only=False)["step"] == 5


def test_multi_block_forward_matches_reference(run):
    from treeflash.train.corpus import TokenData
    from treeflash.train.drafter import draft_logits, load_drafter, target_features
    from treeflash.train.target import load_target

    t, d = load_target(run / "target"), load_drafter(run / "drafter")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # make every path matter
    tokens = torch.from_numpy(TokenData.load(run / "tok").heldout[:48].astype(np.int64))[None]
    taps, _ = target_features(t, tokens, d.target_layer_ids)
    anchors = torch.tensor([[1, 3, 4, 17, 30, 44]])  # adjacent, overlapping and past the window (8)
    with torch.no_grad():
        mine = draft_logits(d, t, taps, tokens, anchors)
        for i, a in enumerate(anchors[0].tolist()):
            block = torch.full((1, d.block_size), d.mask_token_id)
            block[0, 0] = tokens[0, a]
            noise = torch.nn.functional.embedding(block, t.get_input_embeddings().weight)
            h = d(target_hidden=taps[:, :a], noise_embedding=noise, position_ids=torch.arange(a + d.block_size)[None])
            ref = d.compute_logits(h[:, 1:], t.lm_head)
            torch.testing.assert_close(mine[0, i], ref[0], atol=1e-5, rtol=1e-5)


def test_eval_stage_and_reference_loop(run):
    out = run / "metrics.json"
    assert main(["eval", "--data", str(run / "tok"), "--target", str(run / "target"), "--drafter",
                 str(run / "drafter"), "--out", str(out), "--prompts", "3", "--prompt-len", "32",
                 "--new-tokens", "12", "--seq-len", "64", "--loss-windows", "1", "--long-len", "0",
                 "--context-lengths", "48", "--context-prompts", "1", "--budgets", "4",
                 "--reference-prompts", "2", "--device", "cpu"]) == 0
    m = json.loads(out.read_text())
    assert m["target"]["heldout_loss"] > 0 and 0 <= m["target"]["valid_python"]["valid_line_share"] <= 1
    d = m["drafter"]
    assert d["T0"]["chain"]["mean_acceptance_length"] >= 1 and "ddtree_b4" in d["T1"]
    ref = d["dflash_reference_T0"]
    assert ref["same_text_as_greedy"]  # lossless: the reference loop reproduces greedy decoding
    assert ref["mean_acceptance_length"] == pytest.approx(ref["simulated_chain_mean_same_prompts"], abs=0.5)


def test_ddtree_and_chain_walks():
    from treeflash.train.evaluate import ddtree_children, walk_chain, walk_tree

    logp = torch.log_softmax(torch.tensor([[3.0, 2.0, 0.0, -1.0], [0.0, 3.0, 2.5, -1.0], [1.0, 0.0, 0.0, 4.0]]), -1)
    children = ddtree_children(logp, budget=5)
    assert len(children) == 6  # root + budget nodes
    assert children[0].keys() >= {0}  # the best depth-1 token hangs off the root
    spine = children[children[0][0]]
    assert 1 in spine  # depth 2 best token under the depth-1 best
    assert walk_tree(children, [0, 1, 3]) == 3 and walk_tree(children, [2]) == 0
    assert walk_chain([0, 1, 3], [0, 1, 2]) == 2
    wide = ddtree_children(logp, budget=1)
    assert len(wide) == 2 and walk_tree(wide, [0, 1]) == 1


def test_python_validity():
    from treeflash.train.evaluate import python_validity

    ok = ("def f(x):", "\n    y = x + 1\n    return y\nprint(1)\n")
    bad = ("    def g(self):", "\n        return )(\n")
    cut = ("def h():", "\n    return [1,\n        2")
    m = python_validity([ok, bad, cut])
    assert m["functions"] == 3 and m["function_parse_rate"] == pytest.approx(1 / 3, abs=1e-3)
    assert 0 < m["valid_line_share"] < 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["target", "--data", "/nonexistent", "--out", "x"], "no data/manifest.json"),
        (["drafter", "--data", "/nonexistent", "--target", "t", "--out", "x"], "no data/manifest.json"),
        (["tokenizer", "--out", "x", "--corpus", "/nonexistent"], "not a directory"),
    ],
)
def test_bad_paths_give_clear_errors(argv, message, capsys, tmp_path):
    argv = [a if a != "x" else str(tmp_path / "x") for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_values_are_rejected_by_the_parser(capsys):
    for argv, message in ((["target", "--data", "d", "--out", "o", "--steps", "0"], "--steps: must be >= 1, got 0"),
                          (["target", "--data", "d", "--out", "o", "--preset", "huge"], "invalid choice: 'huge'"),
                          (["tokenizer", "--out", "o", "--sample-bytes", "lots"], "expected a byte count"),
                          (["drafter", "--data", "d", "--out", "o"], "required: --target"),
                          (["frobnicate"], "invalid choice: 'frobnicate'")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err, argv


def test_run_state_errors(run, tmp_path, capsys):
    # an existing checkpoint is never silently overwritten, and --resume needs one
    assert main(["target", "--data", str(run / "tok"), "--out", str(run / "target"), *TINY_T, "--steps", "1"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["target", "--data", str(run / "tok"), "--out", str(tmp_path / "t2"), *TINY_T, "--steps", "1",
                 "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["target", "--data", str(run / "tok"), "--out", str(tmp_path / "t3"), *TINY_T, "--steps", "1",
                 "--time-budget", "-1"]) == 2
    assert "--time-budget" in capsys.readouterr().err
