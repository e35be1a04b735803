"""What an fp8_e4m3 KV cache (`kvcache.format`) costs in accuracy, against a bf16 cache: logits
error, greedy token agreement and mean acceptance length, on the shipped pair and on a small
random model of Kimi K2's attention geometry.

    PYTHONPATH=src python benchmarks/fp8_kv_accuracy.py --device cuda --out benchmarks/results/DIR

(`benchmarks/gpu_fp8_kv.sh` runs it; on 2 CPU cores the shipped pair alone takes ~12 minutes.)

Method (the same for both models, on either device): the model computes in float32, eagerly,
with the cache written by `kernels.kv_write` (the runtime option mla_prep=0), so that the cache is the
only thing that differs between runs; the "bf16 cache" is the float32 pool holding every
written row rounded to bf16 (what a bf16 cache stores; its writes wrapped), "fp8" the real
fp8_e4m3 pool, "fp32" the pool as it is (a reference for how much bf16's own rounding of the
cache moves things).

- reference continuation: each prompt's 128 greedy tokens under the bf16 cache;
- logits: prompt + continuation teacher-forced under each cache (`LLM.score`); error = max |fp8
  - bf16| / max |bf16| per sequence over the generated positions; agreement = the share of
  generated positions where both argmaxes are equal; the bf16 top-2 margin at each disagreement;
- acceptance: greedy DDTree decoding of the same prompts under each cache, mean acceptance
  length over all steps (1 + accepted drafts / steps); the fp32 cache's beside bf16's says how
  far any perturbation of the cache moves it (free-running paths diverge at the first flip). The
  shipped pair: its trained drafter. The random model has no trained drafter (a random one
  accepts nothing under any cache), so an oracle drafter replays the bf16 cache's continuation:
  full acceptance under bf16 by construction, and under fp8 exactly as long as fp8's greedy
  path stays on bf16's.

Prompts: the shipped pair's 8 held-out prompts and 56 windows of Python standard-library files
(its training domain); the random model: random tokens. The random model (`kimi_random`):
Kimi K2's TP8 attention slice (8 heads, kv_lora 512 + rope 64 = the 656-byte fp8 row, q_lora
1536, nope / v 128, YaRN x64 rope at theta 50000), with a hidden size of 2048 instead of 7168, 2
layers (1 dense, 1 MoE of 16 experts top-8 with a shared expert) instead of 61 (384 experts) and
a 4096-token vocabulary instead of 163840, so that 64 x 128 tokens (and the speculative runs'
verify rows) fit in minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from treeflash import LLM, SamplingParams, kernels
from treeflash.runtime import RuntimeOptions

CACHES = ("bf16", "fp8", "fp32")
FIRST_DENSE = 1  # as Kimi K2: layer 0 dense, the rest MoE
DEVICE = {"device": "cpu"}  # --device
KV_WRITE = RuntimeOptions(mla_prep=False)  # the cache written by kernels.kv_write (wrapped for "bf16")


@contextlib.contextmanager
def bf16_valued_writes():
    """Every KV write of a model-dtype pool stores its rows rounded to bf16 (a bf16 cache's values)."""
    write = kernels.kv_write

    def rounded(kv_cache, page_table, start_lens, latents, impl=None, v_dim=None):
        return write(kv_cache, page_table, start_lens, latents.to(torch.bfloat16).to(latents.dtype), impl=impl,
                     v_dim=v_dim)

    kernels.kv_write = rounded
    try:
        yield
    finally:
        kernels.kv_write = write


def cache_context(cache: str):
    return bf16_valued_writes() if cache == "bf16" else contextlib.nullcontext()


def make_llm(cache: str, target, drafter=None, spec: str = "off", budget=None) -> LLM:
    return LLM(target, drafter, spec=spec, tree_budget=budget, device=DEVICE["device"], dtype="float32",
               page_size=64, kv_cache_dtype="fp8_e4m3" if cache == "fp8" else "auto", max_running=64,
               cuda_graphs=False, runtime_options=KV_WRITE)


def shipped_prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    """The 8 held-out prompts, then windows of standard-library .py files (every k-th, sorted)."""
    from treeflash.engine.llm import EMBEDDED

    held = json.loads((EMBEDDED / "heldout_prompts.json").read_text())["prompts"]
    prompts = [llm.encode(p["text"])[-length:] for p in held][:n]
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    for f in files[:: max(1, len(files) // (n - len(prompts) + 1))]:
        if len(prompts) == n:
            break
        ids = llm.encode(f.read_text(errors="replace"))
        if len(ids) >= 2 * length:
            prompts.append(ids[length:2 * length])
    return prompts


def random_prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab - 2, (length,), generator=g).tolist() for _ in range(n)]


def write_kimi_random(path: Path) -> Path:
    """The random Kimi-geometry checkpoint (module docstring), written by transformers."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=4096, hidden_size=2048, intermediate_size=18432 // 8, moe_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16,
        num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        first_k_dense_replace=FIRST_DENSE, max_position_embeddings=262144, routed_scaling_factor=2.827,
        norm_topk_prob=True, rope_interleave=True, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=1, initializer_range=0.02,
        rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=64.0,
                             original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0))
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms and router biases random, so they are really exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    model.save_pretrained(path)
    return path


def continuations(target, prompts, tokens: int) -> list[list[int]]:
    with bf16_valued_writes():
        llm = make_llm("bf16", target)
        outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    return [o.token_ids for o in outs]


def scored_logits(cache: str, target, seqs, gen_from: list[int]) -> list[torch.Tensor]:
    """Logits predicting each generated token, [tokens, vocab] a sequence, under `cache`."""
    out = []
    with cache_context(cache):
        llm = make_llm(cache, target)
        for ids, start in tqdm(list(zip(seqs, gen_from)), desc=f"score {cache}", leave=False):
            out.append(llm.score(ids)[start - 1:-1])
    return out


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    errs, agree, total, margins = [], 0, 0, []
    for r, g in zip(ref, got):
        errs.append(((g - r).abs().max() / r.abs().max()).item())
        same = r.argmax(-1) == g.argmax(-1)
        agree += int(same.sum())
        total += same.numel()
        top2 = r.topk(2, -1).values
        margins += (top2[:, 0] - top2[:, 1])[~same].tolist()
    return {"logits_rel_err_median": statistics.median(errs), "logits_rel_err_max": max(errs),
            "agreement": agree / total, "positions": total, "disagreements": total - agree,
            "disagreements_ref_margin_below_0.1": sum(m < 0.1 for m in margins),
            "ref_top2_margin_at_disagreements": sorted(margins)}


def acceptance(cache: str, target, drafter, prompts, tokens: int, budget) -> dict:
    with cache_context(cache):
        llm = make_llm(cache, target, drafter, "ddtree", budget)
        outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    steps = sum(o.metrics["speculative_decoding"]["num_spec_steps"] for o in outs)
    accepted = sum(o.metrics["speculative_decoding"]["num_accepted_draft_tokens"] for o in outs)
    return {"mean_acceptance_length": 1 + accepted / max(steps, 1), "steps": steps, "accepted": accepted,
            "tokens": [o.token_ids for o in outs]}


def run_model(name: str, target, drafter_for, prompts, tokens: int, budget) -> dict:
    t0 = time.time()
    conts = continuations(target, prompts, tokens)
    seqs = [p + c for p, c in zip(prompts, conts)]
    starts = [len(p) for p in prompts]
    logits = {c: scored_logits(c, target, seqs, starts) for c in CACHES}
    res = {"model": name, "prompts": len(prompts), "tokens": tokens,
           "fp8_vs_bf16": compare(logits["bf16"], logits["fp8"]),
           "bf16_vs_fp32": compare(logits["fp32"], logits["bf16"])}
    drafter = drafter_for(conts)
    acc = {c: acceptance(c, target, drafter, prompts, tokens, budget) for c in CACHES}
    res["acceptance"] = {c: {k: v for k, v in a.items() if k != "tokens"} for c, a in acc.items()}
    for c in ("fp8", "fp32"):
        res["acceptance"][f"{c}_over_bf16"] = (acc[c]["mean_acceptance_length"]
                                               / acc["bf16"]["mean_acceptance_length"])
    res["wall_s"] = time.time() - t0
    return res


def shipped(n: int, length: int, tokens: int) -> dict:
    from treeflash.engine.llm import EMBEDDED

    target, drafter = EMBEDDED / "target", EMBEDDED / "drafter"
    prompts = shipped_prompts(make_llm("fp32", target), n, length)
    return run_model("shipped pair", target, lambda conts: drafter, prompts, tokens, None)


def kimi_random(n: int, length: int, tokens: int, work: Path) -> dict:
    from treeflash.speculative.testing_drafters import OracleDrafter

    target = write_kimi_random(work / "kimi_random")
    prompts = random_prompts(4096, n, length)

    def oracle(conts):
        return OracleDrafter(4096, 16, sequences=[p + c for p, c in zip(prompts, conts)], target_layer_ids=(0, 1),
                             device=DEVICE["device"])  # its proposals where the target walks them

    return run_model("random Kimi-geometry model", target, oracle, prompts, tokens, 15)


def table(results: list[dict]) -> str:
    lines = ["| model | logits rel. err. (median / max) | greedy agreement | disagreements (bf16 margin < 0.1) | "
             "acceptance bf16 | acceptance fp8 | fp8 / bf16 | bf16 vs fp32 cache: agreement, acceptance |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        f, a, ref = r["fp8_vs_bf16"], r["acceptance"], r["bf16_vs_fp32"]
        lines.append(f"| {r['model']} | {f['logits_rel_err_median']:.4f} / {f['logits_rel_err_max']:.4f} | "
                     f"{100 * f['agreement']:.2f}% ({f['positions']} positions) | {f['disagreements']} "
                     f"({f['disagreements_ref_margin_below_0.1']}) | "
                     f"{a['bf16']['mean_acceptance_length']:.3f} | {a['fp8']['mean_acceptance_length']:.3f} | "
                     f"{a['fp8_over_bf16']:.4f} | {100 * ref['agreement']:.2f}%, "
                     f"{a['fp32']['mean_acceptance_length']:.3f} ({a['fp32_over_bf16']:.4f} of bf16) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--models", default="shipped,kimi_random")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args(argv)
    DEVICE["device"] = args.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.models.split(","):
            print(f"{name}: {args.prompts} prompts x {args.tokens} tokens", flush=True)
            if name == "shipped":
                results.append(shipped(args.prompts, args.prompt_tokens, args.tokens))
            elif name == "kimi_random":
                results.append(kimi_random(args.prompts, args.prompt_tokens, args.tokens, Path(work)))
            else:
                raise ValueError(f"unknown model {name!r}: shipped, kimi_random")
            results[-1]["device"] = args.device
            (out / "accuracy.json").write_text(json.dumps(results, indent=1))
            (out / "accuracy.md").write_text(table(results) + "\n")
            print(table(results[-1:]), flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
