"""The Kimi K2.6 DFlash drafter's configuration (z-lab format: GQA 8:1, block 8, six taps, the
mask token, YaRN over the full head dim, sliding-window layers) at tiny size, over an INT4 target
in K2.6's published layout: it loads, and treeflash's chain mode (the engine: its own target
forward, taps, drafter cache and walk) reproduces z-lab's `dflash_generate` step for step, run on
transformers' DeepseekV3 with the dequantized weights. One tap is on the target's last layer,
which the reference reads from Hugging Face's `hidden_states[-1]`, after the final norm."""

from __future__ import annotations

import pytest
import torch

from helpers.drafter import reference_drafter, write_drafter
from helpers.k26_checkpoints import PREFIX, edit_k26, oracle_model, write_k26_checkpoint
from treeflash import LLM, SamplingParams
from treeflash.config import DrafterConfig, ModelConfig
from treeflash.models.drafter import DFlashDrafter

pytest.importorskip("dflash")
pytest.importorskip("compressed_tensors")

LAYERS, VOCAB, HIDDEN, BLOCK = 7, 96, 64, 8
TAPS = (0, 1, 3, 4, 5, 6)  # K2.6's are 1, 12, 24, 35, 47, 58 of 61; here the last layer too
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
K26_DRAFTER = dict(  # 64 query / 8 KV heads of 128 in the published one
    layer_types=("sliding_attention", "sliding_attention", "full_attention") * 2, sliding_window=6,
    target_layer_ids=TAPS, block_size=BLOCK, mask_token_id=VOCAB - 2, hidden_size=HIDDEN, vocab_size=VOCAB,
    num_attention_heads=8, num_key_value_heads=1, head_dim=16, intermediate_size=96, rms_norm_eps=1e-5,
    rope_theta=50000.0, rope_scaling=YARN, num_target_layers=LAYERS,
)


def _rank1_head(tensors):
    """A near rank-1 lm_head: few likely tokens, so the drafter's blocks get accepted."""
    g = torch.Generator().manual_seed(5)
    c = torch.linspace(-1, 1, VOCAB)[torch.randperm(VOCAB, generator=g)]
    u = torch.randn(HIDDEN, generator=g)
    head = 3 * c[:, None] * u + 0.05 * torch.randn(VOCAB, HIDDEN, generator=g)
    tensors[f"{PREFIX}lm_head.weight"] = head.to(torch.bfloat16)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("k26d")
    target = write_k26_checkpoint(root / "t", num_hidden_layers=LAYERS)
    edit_k26(target, _rank1_head)
    drafter = write_drafter(root / "d", seed=3, **K26_DRAFTER)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(drafter / "model.safetensors"))  # with the rank-1 head: agrees often
    sd["norm.weight"] = -sd["norm.weight"]
    save_file(sd, str(drafter / "model.safetensors"))
    return target, drafter


@pytest.mark.slow
def test_k26_drafter_config_loads(pair):
    target, drafter = pair
    cfg = DrafterConfig.from_hf(drafter)
    cfg.check_fits(ModelConfig.from_hf(target))
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == (BLOCK, TAPS, VOCAB - 2)
    assert cfg.num_attention_heads // cfg.num_key_value_heads == 8 and cfg.rope.rope_type == "yarn"
    assert [cfg.window(i) for i in range(6)] == [6, 6, None, 6, 6, None]


@pytest.mark.slow
@torch.no_grad()
def test_chain_mode_reproduces_dflash_generate(pair, monkeypatch):
    from dflash.model import dflash_generate

    target, drafter = pair
    hf, ref = oracle_model(target), reference_drafter(drafter)
    ref_blocks = []
    compute = ref.compute_logits
    ref.compute_logits = lambda hid, head: _record(ref_blocks, compute(hid, head))
    prompt, new = [3, 14, 15, 9, 2, 6, 53, 58], 40
    want = dflash_generate(ref, hf, torch.tensor([prompt]), new, None)[0, len(prompt):].tolist()

    our_blocks = []
    propose = DFlashDrafter.propose
    monkeypatch.setattr(DFlashDrafter, "propose",
                        lambda self, *a, **k: _record(our_blocks, propose(self, *a, **k)))
    llm = LLM(target, drafter, spec="dflash", device="cpu", dtype="float32", page_size=8)
    out = llm.generate(prompt, SamplingParams(max_tokens=new, ignore_eos=True))[0]
    assert out.token_ids == want
    accepted = out.metrics["speculative_decoding"]["per_step_accepted"]
    # Step for step: the same drafts and acceptance wherever the reference drafted a whole block
    # (it shortens its blocks near max_new_tokens; the engine drafts whole ones and cuts).
    ref_accepted = _accepted(ref_blocks, want)
    assert len(our_blocks) == len(ref_blocks) == len(accepted)
    whole = [i for i, b in enumerate(ref_blocks) if len(b) == BLOCK - 1]
    assert len(whole) >= 20
    assert [our_blocks[i] for i in whole] == [ref_blocks[i] for i in whole]
    assert [accepted[i] for i in whole] == [ref_accepted[i] for i in whole]
    assert max(accepted) >= 2  # multi-row extends and partial acceptance were exercised


def _accepted(blocks, tokens):
    """Drafts the reference accepted each step: its block's leading tokens that the output has."""
    out, at = [], 0  # tokens[at] is the step's bonus token
    for block in blocks:
        n = 0
        while n < len(block) and at + 1 + n < len(tokens) and block[n] == tokens[at + 1 + n]:
            n += 1
        out.append(n)
        at += n + 1
    return out


def _record(store, logits):
    store.append(logits.argmax(-1)[0].tolist())
    return logits
