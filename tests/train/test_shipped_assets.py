"""The shipped pair (treeflash/assets/): size, load time, formats, and acceptance on fixed
held-out prompts, measured with the reference implementations (transformers + z-lab dflash)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ASSETS = Path(__file__).resolve().parents[2] / "src" / "treeflash" / "assets"


def _bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


def test_size_and_formats():
    total = _bytes(ASSETS / "target") + _bytes(ASSETS / "drafter")
    assert total <= 16.8e6, f"shipped pair is {total / 1e6:.1f} MB"
    t = json.loads((ASSETS / "target" / "config.json").read_text())
    d = json.loads((ASSETS / "drafter" / "config.json").read_text())
    assert t["model_type"] == "deepseek_v3" and t["rope_parameters"]["rope_type"] == "yarn"
    assert t["n_routed_experts"] > 1 and t["n_shared_experts"] >= 1 and t["first_k_dense_replace"] >= 1
    assert set(d["layer_types"]) == {"sliding_attention", "full_attention"}
    assert d["hidden_size"] == t["hidden_size"] and d["dflash_config"]["mask_token_id"] == 3
    assert max(d["dflash_config"]["target_layer_ids"]) < t["num_hidden_layers"]


@pytest.fixture(scope="module")
def pair():
    from treeflash.train.drafter import load_drafter
    from treeflash.train.target import load_target

    t0 = time.perf_counter()
    pair = load_target(ASSETS / "target"), load_drafter(ASSETS / "drafter")
    pair[0].load_seconds = time.perf_counter() - t0
    return pair


def test_loads_fast(pair):
    assert pair[0].load_seconds < 10  # ~1-2 s on a laptop CPU; generous for shared CI machines


def test_acceptance_on_fixed_heldout_prompts(pair):
    from treeflash.train.evaluate import continue_tokens, simulate_acceptance, summarize
    from treeflash.train.tokenizer import load_tokenizer

    prompts = json.loads((ASSETS / "heldout_prompts.json").read_text())["prompts"][:6]
    tok = load_tokenizer(ASSETS / "target")
    target, drafter = pair
    torch.manual_seed(0)
    means = {"chain": [], "ddtree_b32": []}
    for p in prompts:
        ids = torch.tensor([tok.encode(p["text"]).ids])
        seqs = continue_tokens(target, ids, 64 + drafter.block_size)
        res = summarize(simulate_acceptance(target, drafter, seqs, ids.shape[1], [32]))
        for k in means:
            means[k].append(res[k]["mean_acceptance_length"])
    chain = sum(means["chain"]) / len(prompts)
    tree = sum(means["ddtree_b32"]) / len(prompts)
    # Regression floors for the drafter shipped now (retrained 2026-12-02; measured here on
    # CPU: chain 2.22, DDTree(32) 2.95; the first-run drafter it replaced gives 1.68 / 2.47,
    # so it fails both). The bar (chain >= 2.5, DDTree >= 3.0 over 48 prompts) is met
    # for DDTree(32) only: see MODEL_CARD.md. Raise these when better weights replace the files.
    assert chain >= 1.9 and tree >= 2.6, f"chain {chain:.2f}, ddtree(32) {tree:.2f}"
