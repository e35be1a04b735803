"""Each rank's loaded shard is exactly its slice of the whole model (FP8 too, cut across
scale blocks), and experts a rank does not own are never read."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.hf_checkpoints import patch_config
from treeflash.models import loader
from treeflash.models.loader import load_target
from treeflash.sharding import Parallel, split

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


def expected_shard(name: str, full: torch.Tensor, cfg, par: Parallel) -> torch.Tensor:
    h0, h1 = split(cfg.num_attention_heads, par.tp_size, par.tp_rank)
    if name.endswith(("q_proj.weight", "q_b_proj.weight")):
        return full[h0 * cfg.qk_head_dim : h1 * cfg.qk_head_dim]
    if name.endswith("kv_b_proj.weight"):
        per = cfg.qk_nope_head_dim + cfg.v_head_dim
        return full[h0 * per : h1 * per]
    if name.endswith("o_proj.weight"):
        return full[:, h0 * cfg.v_head_dim : h1 * cfg.v_head_dim]
    if name.endswith("o_proj.bias"):
        return full if par.tp_rank == 0 else torch.zeros_like(full)
    if ".experts_" in name:
        e0, n = par.expert_offset(cfg), par.local_experts(cfg)
        i0, i1 = split(full.shape[2 if name.endswith("down") else 1], par.moe_tp_size, par.moe_tp_rank)
        part = full[e0 : e0 + n]
        return part[:, :, i0:i1] if name.endswith("down") else part[:, i0:i1]
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        i0, i1 = split(full.shape[0], par.tp_size, par.tp_rank)
        return full[i0:i1]
    if name.endswith("down_proj.weight"):
        i0, i1 = split(full.shape[1], par.tp_size, par.tp_rank)
        return full[:, i0:i1]
    return full


def check_shards(path, layouts):
    whole = dict(load_target(path, CPU, torch.float32).named_parameters())
    for tp, ep in layouts:
        for rank in range(tp):
            par = Parallel(tp, rank, ep)
            model = load_target(path, CPU, torch.float32, par)
            for name, p in model.named_parameters():
                want = expected_shard(name, whole[name].detach(), model.cfg, par)
                assert torch.equal(p.detach(), want), (tp, ep, rank, name)


def test_shards_are_slices_of_the_whole(target):
    check_shards(target, [(2, 1), (4, 1), (2, 2), (4, 2), (4, 4)])


def test_fp8_shards_cut_across_scale_blocks(target, tmp_path):
    """Block 16: with tp=4 the q_b rows (24 per head) and shared-expert rows cut mid-block."""
    path = tmp_path / "fp8"
    path.mkdir()
    for f in target.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(path / "model.safetensors")
    for name in list(tensors):
        w = tensors[name]
        if w.dim() == 2 and "embed" not in name and "lm_head" not in name and "gate.weight" not in name:
            scale = w.abs().amax().clamp(min=1e-12) / 448.0
            tensors[name] = (w / scale).to(torch.float8_e4m3fn)
            grid = (-(-w.shape[0] // 16), -(-w.shape[1] // 16))
            tensors[name + "_scale_inv"] = torch.rand(grid) + 0.5  # distinct per block
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    patch_config(path, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                            "weight_block_size": [16, 16]})
    check_shards(path, [(4, 1), (4, 2)])


def test_unowned_experts_are_not_read(target, monkeypatch):
    read = []
    real = loader.iter_tensors

    def spy(files, select=None):
        for name, t in real(files, select):
            read.append(name)
            yield name, t

    monkeypatch.setattr(loader, "iter_tensors", spy)
    load_target(target, CPU, torch.float32, Parallel(2, 1, 2))
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts == {4, 5, 6, 7}


@pytest.mark.parametrize("tamper, match", [
    (lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"), "experts.5.up_proj"),
    (lambda t: t.update({"model.layers.1.mlp.experts.8.up_proj.weight": torch.zeros(32, 64)}),
     "unexpected tensor 'model.layers.1.mlp.experts.8.up_proj.weight'"),
])
def test_sharded_loading_stays_strict(target, tmp_path, tamper, match):
    path = tmp_path / "bad"
    path.mkdir()
    for f in target.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(path / "model.safetensors")
    tamper(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        load_target(path, CPU, torch.float32, Parallel(2, 1, 2))
