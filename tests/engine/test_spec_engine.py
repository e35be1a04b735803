"""Speculative decoding through the engine: lossless (greedy and sampled), metrics consistent."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.spec import VOCAB
from treeflash import LLM, SamplingParams
from treeflash.speculative.testing_drafters import AdversarialDrafter, OracleDrafter, RandomDrafter

pytestmark = pytest.mark.slow


def spec_llm(target, drafter, spec, budget, page_size=8):
    return LLM(target, drafter, spec=spec, tree_budget=budget, device="cpu", dtype="float32",
               page_size=page_size)


def check_metrics(out):
    m = out.metrics["speculative_decoding"]
    assert "invariant_error" not in m
    steps = m["num_spec_steps"]
    hist = m["acceptance_histogram"]
    assert sum(hist) == steps
    assert sum(j * h for j, h in enumerate(hist)) == m["num_accepted_draft_tokens"]
    if steps:
        assert math.isclose(m["mean_accepted_depth"], m["num_accepted_draft_tokens"] / steps)
        assert math.isclose(m["mean_acceptance_length"], 1 + m["num_accepted_draft_tokens"] / steps)
    # 1 token from prefill + (accepted + 1) per step + 1 per plain step, minus what max_tokens cut.
    produced = 1 + sum(a + 1 for a in m["per_step_accepted"]) + m["num_plain_steps"]
    assert len(out.token_ids) <= produced < len(out.token_ids) + 1 + max(m["per_step_accepted"] + [0]) + 1
    return m


@pytest.mark.parametrize("spec, budget", [("ddtree", 1), ("ddtree", 4), ("ddtree", 16),
                                          ("ddtree", 64), ("ddtree", 256), ("dflash", None), ("ddtree", "auto")])
@pytest.mark.parametrize("kind", ["random", "adversarial", "oracle", "real"])
def test_greedy_is_lossless(target, drafter_path, reference, spec, budget, kind):
    ps, expected = reference
    seqs = [p + e for p, e in zip(ps, expected)]
    drafter = {
        "random": lambda: RandomDrafter(VOCAB, 6, seed=1, target_layer_ids=(0, 2)),
        "adversarial": lambda: AdversarialDrafter(VOCAB, 6, seed=2, sequences=seqs, target_layer_ids=(0,)),
        "oracle": lambda: OracleDrafter(VOCAB, 6, sequences=seqs, target_layer_ids=(1,)),
        "real": lambda: drafter_path,
    }[kind]()
    llm = spec_llm(target, drafter, spec, budget, page_size=1 if budget == 4 else 8)
    free = llm.pool.num_free_pages
    outs = llm.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert llm.pool.num_free_pages == free
    for o in outs:
        m = check_metrics(o)
        if kind == "oracle" and budget != "auto":  # full acceptance: every step commits all it can, but the last
            full = 5 if budget is None else min(5, budget)
            assert all(a == full for a in m["per_step_accepted"][:-1])


def test_oracle_acceptance_length(target, reference):
    ps, expected = reference
    seqs = [p + e for p, e in zip(ps, expected)]
    llm = spec_llm(target, OracleDrafter(VOCAB, 6, sequences=seqs), "dflash", None)
    out = llm.generate(ps[0], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    m = out.metrics["speculative_decoding"]
    assert m["num_spec_steps"] == math.ceil((24 - 1) / 6)
    assert m["mean_acceptance_length"] >= 5.0


def _token_pair_counts(llm, prompt, params, runs):
    outs = llm.generate([prompt] * runs, params)
    counts = {}
    for o in outs:
        key = tuple(o.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    return counts


def _exact_pair_probs(llm, prompt, params):
    """p(t1, t2) of the target itself, from its logits and the same processing."""
    from treeflash.sampling import process_logits

    p1 = process_logits(llm.score(prompt)[-1], params)
    probs = {}
    for t1 in torch.nonzero(p1 > 1e-9).flatten().tolist():
        p2 = process_logits(llm.score(prompt + [t1])[-1], params)
        for t2 in torch.nonzero(p2 > 1e-9).flatten().tolist():
            probs[(t1, t2)] = float(p1[t1] * p2[t2])
    return probs


T1, TOPK, TOPP, ONEHOT = (dict(temperature=1.0), dict(temperature=1.0, top_k=4),
                          dict(temperature=0.8, top_p=0.7), dict(temperature=0.05))  # (the last: nearly one-hot)


@pytest.mark.parametrize("params, budget", [
    (T1, 8), (TOPK, 8), (TOPP, 8), (ONEHOT, 8), (T1, "auto"), (TOPK, "split"), (TOPP, "split"),
], ids=["t1", "topk", "topp", "onehot", "t1-auto", "topk-split", "topp-split"])
def test_sampling_is_lossless(target, reference, params, budget):
    """Chi-square and total variation: speculative samples vs the target's exact p(t1, t2);
    auto sizes the trees itself; "split" runs every batch half with trees of 7 nodes, half
    plainly (the sizing's per-request plans) in the same steps."""
    from scipy.stats import chi2

    ps, expected = reference
    prompt = ps[1][:6]
    sp = SamplingParams(max_tokens=2, ignore_eos=True, **params)
    drafter = AdversarialDrafter(VOCAB, 4, seed=5, sequences=[prompt + expected[1]])
    llm = spec_llm(target, drafter, "ddtree", "auto" if budget == "split" else budget)
    if budget == "split":
        from treeflash.speculative.budget import Plan

        sizer = llm.engine.spec._sizer(llm.engine)
        sizer.plan = lambda states, contexts, forced=None, forced_build=None: Plan(
            7, list(range(0, len(states), 2)), list(range(1, len(states), 2)))
    runs = 1000
    counts = _token_pair_counts(llm, prompt, sp, runs)
    probs = _exact_pair_probs(llm, prompt, sp)
    assert set(counts) <= set(probs), "sampled a pair the target gives no mass"
    # Pool cells with small expectation into one bin.
    big = {k for k, p in probs.items() if p * runs >= 5}
    obs = [counts.get(k, 0) for k in big] + [runs - sum(counts.get(k, 0) for k in big)]
    exp = [probs[k] * runs for k in big] + [runs * (1 - sum(probs[k] for k in big))]
    cells = [(o, e) for o, e in zip(obs, exp) if e > 0]
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = max(len(cells) - 1, 1)
    assert stat < chi2.ppf(0.999, dof), (stat, dof)
    # Total variation over the same bins (the raw pair table is too sparse for a TV bound).
    tv = 0.5 * sum(abs(o - e) for o, e in cells) / runs
    assert tv < 0.08


def test_spec_needs_a_drafter_and_valid_budget(target, drafter_path):
    with pytest.raises(ValueError, match="needs a drafter"):
        LLM(target, device="cpu", spec="ddtree")
    with pytest.raises(ValueError, match="budget"):
        spec_llm(target, drafter_path, "ddtree", 5000)
    with pytest.raises(ValueError, match="does not exist"):
        spec_llm(target, "/no/such/drafter", "ddtree", 8)
