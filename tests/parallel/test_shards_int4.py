"""INT4 routed experts (Kimi K2.6's pack-quantized layout) under tensor / expert parallelism:
each rank's packed words and scales are exactly its slice (gate/up rows; down's input dim in
whole groups), unowned experts are never read, a split inside a group is refused, and a TP=2
process group scores and decodes as TP=1."""

from __future__ import annotations

import pytest
import torch

from helpers.k26_checkpoints import write_k26_checkpoint
from treeflash import LLM, SamplingParams
from treeflash.models import loader
from treeflash.models.loader import load_target
from treeflash.sharding import Parallel, split

pytestmark = pytest.mark.slow

pytest.importorskip("compressed_tensors")
CPU = torch.device("cpu")
GROUP = 32


@pytest.fixture(scope="module")
def k26(tmp_path_factory):
    """moe_intermediate_size 64: two ranks per expert hold one group of down's input each."""
    return write_k26_checkpoint(tmp_path_factory.mktemp("k26tp") / "m", moe_intermediate_size=64)


def expected_int4(name: str, full: torch.Tensor, cfg, par: Parallel) -> torch.Tensor:
    e0, n = par.expert_offset(cfg), par.local_experts(cfg)
    i0, i1 = split(cfg.moe_intermediate_size, par.moe_tp_size, par.moe_tp_rank)
    part = full[e0 : e0 + n]
    if "experts_down" not in name:
        return part[:, i0:i1]
    per = 8 if name.endswith("_packed") else GROUP
    return part[:, :, i0 // per : i1 // per]


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_int4_shards_are_slices_of_the_whole(k26, tp, ep):
    whole = dict(load_target(k26, CPU, torch.float32).named_buffers())
    for rank in range(tp):
        par = Parallel(tp, rank, ep)
        model = load_target(k26, CPU, torch.float32, par)
        int4 = {n: b for n, b in model.named_buffers() if n.endswith(("_packed", "_scale"))}
        assert len(int4) == 2 * 3 * 2  # two MoE layers, three projections, words + scales
        for name, b in int4.items():
            assert torch.equal(b, expected_int4(name, whole[name], model.cfg, par)), (tp, ep, rank, name)


def test_split_inside_a_group_is_refused(k26):
    with pytest.raises(ValueError, match="not a multiple of the INT4 group size 32"):
        load_target(k26, CPU, torch.float32, Parallel(4, 1, 1))


def test_unowned_int4_experts_are_not_read(k26, monkeypatch):
    read = []
    real = loader.iter_tensors

    def spy(files, select=None):
        for name, t in real(files, select):
            read.append(name)
            yield name, t

    monkeypatch.setattr(loader, "iter_tensors", spy)
    load_target(k26, CPU, torch.float32, Parallel(2, 0, 2))
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts == {0, 1, 2, 3}
    assert not [n for n in read if n.startswith(("vision_tower.", "mm_projector."))]


def test_tp2_equals_tp1(k26):
    prompt = [4, 9, 31, 2, 77, 15, 60, 8]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    one = LLM(k26, device="cpu", dtype="float32", page_size=8)
    want_tokens = one.generate(prompt, params)[0].token_ids
    want_logits = one.score(prompt + want_tokens)
    two = LLM(k26, device="cpu", dtype="float32", page_size=8, tp=2)
    try:
        assert two.generate(prompt, params)[0].token_ids == want_tokens
        torch.testing.assert_close(two.score(prompt + want_tokens), want_logits, rtol=1e-5, atol=1e-4)
    finally:
        two.close()
