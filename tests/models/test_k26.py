"""Kimi K2.6 as published: the wrapper config, the language_model. layout, INT4 routed experts in
compressed-tensors' pack-quantized format (kept packed), against transformers on the dequantized
weights and compressed-tensors' own matching rules; corrupted checkpoints are refused by name."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from helpers.k26_checkpoints import (
    PREFIX,
    edit_k26,
    oracle_model,
    quantization_config,
    read_tensors,
    write_k26_checkpoint,
)
from treeflash import LLM, SamplingParams
from treeflash.config import ModelConfig
from treeflash.kernels.int4 import Int4Weight
from treeflash.quantization import Int4Scheme

pytest.importorskip("compressed_tensors")

TOL = 1e-4  # max relative error, float32 (DESIGN: target parity)
PROMPT = [5, 17, 33, 2, 60, 41, 9, 88, 23, 14, 70, 3, 51]


@pytest.fixture(scope="module")
def k26(tmp_path_factory):
    return write_k26_checkpoint(tmp_path_factory.mktemp("k26") / "m")


@pytest.fixture()
def copy(k26, tmp_path):
    """A private copy of the checkpoint to corrupt."""
    path = tmp_path / "c"
    path.mkdir()
    for f in k26.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    return path


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _llm(path, **kw):
    return LLM(path, device="cpu", dtype="float32", page_size=16, **kw)


def test_config_reads_the_wrapper(k26):
    cfg = ModelConfig.from_hf(k26)
    assert cfg.model_type == "kimi_k2" and cfg.weight_prefix == PREFIX
    assert cfg.skipped_prefixes == ("vision_tower.", "mm_projector.")
    assert isinstance(cfg.quantization, Int4Scheme) and cfg.int4_group_size == 32
    assert cfg.int4_expert_layers == (1, 2)  # layer 0 is the dense one
    assert cfg.rms_norm_eps == 1e-5 and cfg.q_lora_rank == 24 and cfg.rope.rope_type == "yarn"


def test_ignore_and_targets_match_compressed_tensors(k26):
    """`Int4Scheme.quantizes` agrees with compressed-tensors' `is_match` on every module name of
    the checkpoint (and a few edge names), for the published targets / ignore list."""
    from compressed_tensors.utils.match import is_match

    scheme = ModelConfig.from_hf(k26).quantization
    group = quantization_config()["config_groups"]["group_0"]
    names = {n.rsplit(".", 1)[0] for n in read_tensors(k26) if n.endswith(("weight", "weight_packed"))}
    names |= {"lm_head", "model.layers.1.mlp.experts.0.gate_proj", "xlanguage_model.model.layers.1.self_attn"}
    linear, other = torch.nn.Linear(1, 1), torch.nn.LayerNorm(1)
    for name in sorted(names):
        for module, cls in ((linear, "Linear"), (other, "LayerNorm")):
            want = is_match(name, module, group["targets"], quantization_config()["ignore"])
            assert scheme.quantizes(name, cls) == want, (name, cls)


def test_ignore_entries_without_the_wrapper_prefix_count(k26):
    """Copies spell `ignore` with or without `language_model.`: both keep those modules bf16."""
    raw = json.loads((k26 / "config.json").read_text())
    raw["quantization_config"]["ignore"] = [
        "lm_head", r"re:model\.layers\.\d+\.self_attn\..*", "re:.*shared_experts.*", "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj", "language_model.model.layers.0.mlp.down_proj"]
    assert ModelConfig.from_hf(raw).int4_expert_layers == (1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("quant_in", ["top", "text"])
def test_logits_and_greedy_match_transformers_on_dequantized_weights(k26, tmp_path, quant_in):
    path = k26 if quant_in == "top" else write_k26_checkpoint(tmp_path / "t", quant_in="text")
    hf, llm = oracle_model(path), _llm(path)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert rel_err(llm.score(PROMPT, chunk_size=8), ref) < TOL
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == ids[len(PROMPT):]


def test_experts_stay_packed(k26):
    """The routed experts are the checkpoint's int32 words and bf16 scales, bit for bit; no
    dequantized copy of them exists in the model."""
    llm = _llm(k26)
    stored = read_tensors(k26)
    for i in (1, 2):
        mlp = llm.model.model.layers[i].mlp
        assert mlp.expert_format == "int4" and not hasattr(mlp, "experts_gate")
        for kind, w in zip(("gate", "up", "down"), mlp.routed_weights()):
            assert isinstance(w, Int4Weight) and w.group_size == 32
            name = f"{PREFIX}model.layers.{i}.mlp.experts.{{}}.{kind}_proj.weight_"
            assert torch.equal(w.packed, torch.stack([stored[name.format(e) + "packed"] for e in range(8)]))
            assert torch.equal(w.scale, torch.stack([stored[name.format(e) + "scale"] for e in range(8)]))
    cfg = llm.model.cfg
    expert_shapes = {(cfg.moe_intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.moe_intermediate_size)}
    floats = [t for t in llm.model.state_dict().values() if t.is_floating_point() and t.dim() == 3]
    assert not [t for t in floats if tuple(t.shape[1:]) in expert_shapes]


def test_vision_tower_is_skipped_with_one_log_line(k26, caplog):
    with caplog.at_level(logging.INFO, logger="treeflash.models.loader"):
        _llm(k26)
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(lines) == 1 and "4 vision-tower tensors" in lines[0] and "mm_projector.*" in lines[0]


E = f"{PREFIX}model.layers.1.mlp.experts"
CORRUPT = {
    "missing_scale": (lambda t: t.pop(f"{E}.3.gate_proj.weight_scale"),
                      f"missing tensor '{E}.3.gate_proj.weight_scale'"),
    "missing_shape": (lambda t: t.pop(f"{E}.5.down_proj.weight_shape"),
                      f"missing tensor '{E}.5.down_proj.weight_shape'"),
    "missing_all_packed": (
        lambda t: [t.pop(f"{E}.{e}.up_proj.weight_packed") for e in range(8)],
        f"missing tensor '{E}.0.up_proj.weight_packed'"),
    "wrong_packed_shape": (
        lambda t: t.update({f"{E}.2.up_proj.weight_packed": torch.zeros(64, 7, dtype=torch.int32)}),
        rf"'{E}.2.up_proj.weight_packed' has shape \(64, 7\), expected \(64, 8\)"),
    "wrong_scale_shape": (
        lambda t: t.update({f"{E}.0.down_proj.weight_scale": torch.zeros(64, 4, dtype=torch.bfloat16)}),
        rf"'{E}.0.down_proj.weight_scale' has shape \(64, 4\), expected \(64, 2\)"),
    "weight_shape_mismatch": (
        lambda t: t.update({f"{E}.2.down_proj.weight_shape": torch.tensor([64, 56], dtype=torch.int32)}),
        rf"'{E}.2.down_proj.weight_shape' is \[64, 56\], but the config gives down_proj the shape \[64, 64\]"),
    "fp16_scale": (
        lambda t: t.update({f"{E}.1.gate_proj.weight_scale": t[f"{E}.1.gate_proj.weight_scale"].half()}),
        f"'{E}.1.gate_proj.weight_scale' has dtype torch.float16"),
    "extra_dense_expert": (
        lambda t: t.update({f"{E}.0.gate_proj.weight": torch.zeros(64, 64)}),
        f"unexpected tensor '{E}.0.gate_proj.weight'.*INT4"),
    "extra_expert": (
        lambda t: t.update({f"{E}.8.gate_proj.weight_packed": torch.zeros(64, 8, dtype=torch.int32)}),
        f"unexpected tensor '{E}.8.gate_proj.weight_packed'"),
    "extra_attention_scale": (
        lambda t: t.update({f"{PREFIX}model.layers.0.self_attn.q_a_proj.weight_scale": torch.zeros(24, 2)}),
        f"unexpected tensor '{PREFIX}model.layers.0.self_attn.q_a_proj.weight_scale'"),
    "outside_the_prefix": (
        lambda t: t.update({"audio_tower.proj.weight": torch.zeros(2, 2)}),
        "unexpected tensor 'audio_tower.proj.weight'"),
    "missing_attention": (
        lambda t: t.pop(f"{PREFIX}model.layers.2.self_attn.kv_b_proj.weight"),
        f"missing tensor '{PREFIX}model.layers.2.self_attn.kv_b_proj.weight'"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupted_checkpoint_is_refused_by_name(copy, case):
    fn, match = CORRUPT[case]
    edit_k26(copy, fn)
    with pytest.raises(ValueError, match=match):
        _llm(copy)


def _weights(q):
    return q["config_groups"]["group_0"]["weights"]


SCHEMES = {
    "asymmetric": (lambda q: _weights(q).update(symmetric=False), "symmetric"),
    "int8": (lambda q: _weights(q).update(num_bits=8), "num_bits"),
    "channel": (lambda q: _weights(q).update(strategy="channel", group_size=None), "strategy"),
    "float": (lambda q: _weights(q).update(type="float"), "type"),
    "actorder": (lambda q: _weights(q).update(actorder="group"), "actorder"),
    "activations": (lambda q: q["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token"}),
        "input_activations"),
    "format": (lambda q: q.update(format="marlin-24"), "marlin-24"),
    "method": (lambda q: q.update(quant_method="awq"), "awq"),
    "kv_cache": (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    "attention_quantized": (lambda q: q["ignore"].remove("re:.*self_attn.*"), "self_attn.q_a_proj"),
    "some_experts": (lambda q: q["ignore"].append(r"re:.*experts\.3\..*"), "some of layer 1's routed experts"),
}


@pytest.mark.parametrize("case", sorted(SCHEMES))
def test_unsupported_scheme_is_refused_by_name(k26, case):
    raw = json.loads((k26 / "config.json").read_text())
    edit, match = SCHEMES[case]
    edit(raw["quantization_config"])
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(raw)


def test_two_different_quantization_configs_are_refused(k26):
    raw = json.loads((k26 / "config.json").read_text())
    other = quantization_config(group_size=16)
    raw["text_config"]["quantization_config"] = other
    with pytest.raises(ValueError, match="differ"):
        ModelConfig.from_hf(raw)
    raw["text_config"]["quantization_config"] = raw["quantization_config"]  # the same twice: fine
    assert ModelConfig.from_hf(raw).int4_group_size == 32


def test_fp8_scheme_still_parses():
    from helpers.hf_checkpoints import BASE

    raw = {"model_type": "deepseek_v3", **BASE,
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 32]}}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.quantization.block == (64, 32) and cfg.int4_expert_layers == ()
