"""Runtime options: which implementation each fused step runs, handed to the models when they are
built (`--runtime-option NAME=VALUE`), never read from the environment inside them."""

from __future__ import annotations

import pytest
import torch

from treeflash import cli, runtime
from treeflash.models.layers import RMSNorm, fused, set_options
from treeflash.runtime import RuntimeOptions


def test_parse_takes_each_kind_of_option():
    o = RuntimeOptions.parse(["fused_norm=0", "mla-prep=false", "moe_tiles=32:64:64:32:2",
                              "w4a16_split_k=4", "drafter_attention=torch", "fused_kernels=auto"])
    assert (o.fused_norm, o.mla_prep, o.moe_tiles, o.w4a16_split_k) == (False, False, (32, 64, 64, 32, 2), 4)
    assert o.drafter_attention == "torch" and o.fused_kernels is None
    assert RuntimeOptions.parse([]) == RuntimeOptions() == runtime.DEFAULT
    assert RuntimeOptions.parse(["moe_split_k=auto"]).moe_split_k is None


def test_the_speculative_steps_switches_are_options():
    o = RuntimeOptions.parse(["overlap=0", "fused_tree=0", "tree_into_verify=off", "fused_walk=0", "fused_topk=no"])
    assert (o.overlap, o.fused_tree, o.tree_into_verify, o.fused_walk, o.fused_topk) == (False,) * 5
    assert RuntimeOptions.parse(["overlap=1"]).overlap is True
    assert RuntimeOptions.parse(["overlap=auto"]).overlap is None is RuntimeOptions().overlap
    assert RuntimeOptions(overlap=False).changed() == {"overlap": "0"}
    with pytest.raises(ValueError, match=r"overlap='on-cuda': expected 1 or 0 \(true / false\), or auto"):
        RuntimeOptions.parse(["overlap=on-cuda"])
    with pytest.raises(ValueError, match=r"fused_walk='auto': expected 1 or 0 \(true / false\)$"):
        RuntimeOptions.parse(["fused_walk=auto"])  # a bool with a fixed default has no auto


def test_the_speculative_options_reach_the_step(monkeypatch):
    """fused_tree / fused_topk / fused_walk off keep the torch ops where the launch would run
    (CPU tensors stand in for CUDA ones: is_cuda is patched, and a launch would fail loudly)."""
    from treeflash.speculative import build, verify

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    logits = torch.zeros(1, 3, 8)
    assert build._fused_tree_impl(logits, 7, 2, 3, RuntimeOptions().fused_tree) == "triton"
    assert build._fused_tree_impl(logits, 7, 2, 3, RuntimeOptions(fused_tree=False).fused_tree) is None
    assert verify.walk_impl(logits) is None and verify.walk_impl(logits, fused=False) == "torch"
    monkeypatch.undo()
    off = RuntimeOptions(fused_tree=False, fused_topk=False, fused_walk=False)
    g = torch.Generator().manual_seed(0)
    draft = torch.randn(2, 3, 8, generator=g)
    roots, start = torch.tensor([1, 2]), torch.tensor([0, 4])
    want = build.build_tree("ddtree", draft, roots, start, 7)
    got = build.build_tree("ddtree", draft, roots, start, 7, options=off)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    post = torch.randint(8, want.tokens.shape, generator=g)
    assert torch.equal(verify.walk_tree(want, post, options=off).packed, verify.walk_tree(want, post).packed)


@pytest.mark.parametrize("item, match", [
    ("fused_nrom=0", r"no option 'fused_nrom'; one of fused_kernels, fused_norm"),
    ("fused_norm", "expected NAME=VALUE"),
    ("fused_norm=maybe", r"fused_norm='maybe': expected 1 or 0"),
    ("moe_tiles=32:64", "expected 5 or 7 positive integers"),
    ("moe_split_k=0", "expected 1 positive integers"),
    ("drafter_attention=cuda", "expected one of auto, torch, triton"),
])
def test_parse_names_the_problem(item, match):
    with pytest.raises(ValueError, match=match):
        RuntimeOptions.parse([item])


def test_changed_and_notes_say_what_is_away_from_the_default():
    o = RuntimeOptions(fused_gate=False, moe_tiles=(32, 64, 64, 32, 2))
    assert o.changed() == {"fused_gate": "0", "moe_tiles": "32:64:64:32:2"}
    assert o.notes()[0].startswith("--runtime-option fused_gate=0 (default 1): the MoE router's")
    assert RuntimeOptions().changed() == {} and RuntimeOptions().notes() == []
    text = runtime.describe()
    assert all(f"  {name}=" in text for name in RuntimeOptions.__dataclass_fields__)


def test_fused_follows_the_options():
    x = torch.zeros(2, 4)
    assert fused(RuntimeOptions(), x) is None  # a CPU tensor: the torch ops
    assert fused(RuntimeOptions(fused_kernels="triton"), x) == "triton"
    assert fused(RuntimeOptions(fused_kernels="torch", fused_norm=False), x) == "torch"


def test_set_options_reaches_every_deciding_module(pair):
    from treeflash import LLM
    from treeflash.models.mla import MLA
    from treeflash.models.moe import Gate, MoE

    target, drafter = pair
    opts = RuntimeOptions(head_matmul=False, drafter_attention="torch")
    llm = LLM(target, drafter, device="cpu", dtype="float32", page_size=8, runtime_options=opts)
    mods = [m for m in llm.model.modules() if isinstance(m, (MLA, MoE, Gate, RMSNorm))]
    assert mods and all(m.options is opts for m in mods) and llm.model.rotary.options is opts
    dr = llm.engine.spec.drafter
    assert dr.options is opts and all(m.options is opts for m in dr.modules() if isinstance(m, RMSNorm))
    set_options(llm.model, RuntimeOptions())
    assert all(m.options == RuntimeOptions() for m in mods)


def test_moe_hands_its_format_s_tuning_to_the_call():
    from treeflash.models.moe import MoE

    class Cfg:
        hidden_size, moe_intermediate_size, n_shared_experts, n_routed_experts = 16, 8, 0, 4
        num_experts_per_tok, int4_expert_layers, int4_group_size = 2, (), 32

        def experts_int4(self, layer):
            return False

    opts = RuntimeOptions(moe_tiles=(32, 32, 32, 32, 2), moe_split_k=2, w4a16_split_k=3)
    moe = MoE(Cfg(), options=opts, layer=0)
    assert moe._tuning() == {"tiles": (32, 32, 32, 32, 2), "split_k": 2}
    moe.int4_group = 32  # an INT4 layer takes the W4A16 fields
    assert moe._tuning() == {"split_k": 3}
    assert MoE(Cfg(), layer=0)._tuning() == {}


def test_the_flag_parses_notes_and_lists_the_options(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--runtime-option", "help"])
    assert e.value.code == 0 and "fused_norm=1:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--runtime-option", "head_matmul=2", "--model", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "head_matmul='2': expected 1 or 0" in err and "missing" not in err
    with pytest.raises(SystemExit):
        cli.main(["generate", "hi", "--runtime-option", "head_matmul=0", "--runtime-option", "fused_a=0",
                  "--model", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert "treeflash: note: --runtime-option head_matmul=0 (default 1)" in err
    assert "treeflash: note: --runtime-option fused_a=0 (default 1)" in err and "missing" in err
