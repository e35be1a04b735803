"""GPU check and cost of the fused norm / rotary / router kernels (kernels/norm_rope.py,
kernels/moe_router.py), the tree build, walk, argmax and the build's top-k of the log-probs
(kernels/topk_lp.py) against the torch ops they replace, then the shipped pair end to end
with them on and off (the runtime options fused_norm / fused_gate).

    python benchmarks/check_fused.py --out results.json        (CUDA)

Prints a table; exits 1 if a check fails. Times are per call, median of 7 replays of a CUDA
graph of 50 calls (what a captured step pays), so launch overhead is not counted twice.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from benchutil import graph_us  # noqa: E402  (this folder)

from treeflash import LLM, SamplingParams, kernels  # noqa: E402
from treeflash.bench.sweep import git_commit  # noqa: E402
from treeflash.runtime import RuntimeOptions  # noqa: E402

FAILS: list[str] = []


def check(name: str, got: torch.Tensor, want: torch.Tensor, units: float, tol: float | None = None) -> dict:
    """Within `units` of the output dtype's epsilon, relative to max |want| (fp32: 1e-5), or
    within `tol` where given."""
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()
    same = (got == want).float().mean().item()
    if tol is None:
        tol = 1e-5 if got.dtype == torch.float32 else units * torch.finfo(got.dtype).eps
    ok = err <= tol
    if not ok:
        FAILS.append(name)
    return {"case": name, "rel_err": err, "tol": tol, "equal_fraction": round(same, 5), "ok": ok}


def kernel_rows(dev) -> list[dict]:
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for t, d in ((1, 7168), (33, 7168), (33, 512), (17, 256)):
            x = torch.randn(t, d, device=dev, generator=g).to(dtype)
            r = torch.randn(t, d, device=dev, generator=g).to(dtype)
            w = (1 + 0.1 * torch.randn(d, device=dev, generator=g)).to(dtype)
            tag = f"rms_norm {str(dtype)[6:]} {t}x{d}"
            row = check(tag, kernels.rms_norm(x, w, 1e-6, impl="triton"), kernels.rms_norm(x, w, 1e-6, impl="torch"), 2)
            for impl in ("triton", "torch"):
                row[f"{impl}_us"] = graph_us(partial(kernels.rms_norm, x, w, 1e-6, impl=impl))
            rows.append(row)
            got, got_sum = kernels.rms_norm(x, w, 1e-6, residual=r, impl="triton")
            want, want_sum = kernels.rms_norm(x, w, 1e-6, residual=r, impl="torch")
            rows.append(check(tag + " +residual (sum)", got_sum, want_sum, 0))
            rows.append(check(tag + " +residual", got, want, 2))
        for t, h, dim, interleave in ((33, 8, 64, True), (1, 64, 64, True), (33, 1, 64, True), (16, 4, 128, False)):
            x = torch.randn(t, h, dim + 128, device=dev, generator=g).to(dtype)[..., 128:]
            pos = torch.arange(t, device=dev).float() + 1000
            f = pos[:, None] / (10000 ** (torch.arange(dim // 2, device=dev) / (dim // 2)))
            cos, sin = f.cos().to(dtype), f.sin().to(dtype)
            tag = f"rope {str(dtype)[6:]} {t}x{h}x{dim} {'inter' if interleave else 'half'}"
            row = check(tag, kernels.rope(x, cos, sin, interleave, impl="triton"),
                        kernels.rope(x, cos, sin, interleave, impl="torch"), 4)
            for impl in ("triton", "torch"):
                row[f"{impl}_us"] = graph_us(partial(kernels.rope, x, cos, sin, interleave, impl=impl))
            rows.append(row)
            w = (1 + 0.1 * torch.randn(dim, device=dev, generator=g)).to(dtype)
            rows.append(check(tag + " +norm", kernels.rope(x, cos, sin, interleave, norm_weight=w, impl="triton"),
                              kernels.rope(x, cos, sin, interleave, norm_weight=w, impl="torch"), 8))
    return rows


def router_rows(dev) -> list[dict]:
    """The MoE router after its logits GEMM (kernels/moe_router.py) against the torch ops:
    the same experts per row (as sets), weights within 1e-6, and the time of each."""
    rows = []
    g = torch.Generator(device=dev).manual_seed(2)
    cases = (("deepseek-v3", 256, 8, 4, 8), ("kimi-k2", 384, 1, 1, 8))
    for name, experts, groups, keep, top_k in cases:
        for t in (1, 33, 256):
            logits = torch.randn(t, experts, device=dev, generator=g)
            bias = 0.1 * torch.randn(experts, device=dev, generator=g)
            args = (logits, bias, "sigmoid", "noaux_tc", groups, keep, top_k, True, 2.5)
            (w_t, i_t), (w_r, i_r) = (kernels.moe_gate(*args, impl=impl) for impl in ("triton", "torch"))
            o_t, o_r = i_t.sort(-1), i_r.sort(-1)
            same = torch.equal(o_t.values, o_r.values)
            err = (w_t.gather(1, o_t.indices) - w_r.gather(1, o_r.indices)).abs().max().item() if same else 1.0
            row = {"case": f"router {name} {t} rows", "rel_err": err, "tol": 1e-6,
                   "equal_fraction": 1.0 if same else 0.0, "ok": same and err <= 1e-6}
            for impl in ("triton", "torch"):
                row[f"{impl}_us"] = graph_us(partial(kernels.moe_gate, *args, impl=impl))
            if not row["ok"]:
                FAILS.append(row["case"])
            rows.append(row)
    rows += router_fused_rows(dev)
    return rows


def router_fused_rows(dev) -> list[dict]:
    """The shipped pair's router (bf16 x [T, 256], float32 weight [8, 256], sigmoid noaux_tc, 2
    groups, 1 kept, top-2) with the logits GEMM folded in (`kernels.moe_gate_fused`, one launch)
    against the unfused path (F.linear(x.float(), w32): cast, cuBLAS float32 GEMM (+ split-K
    reduce), then the gate kernel) and the torch twin: the same experts per row, weights within
    5e-6 (the logits' float32 sum order differs from cuBLAS: last-bit differences, scaled by up
    to routed_scaling_factor 2.5; a row whose two routing decisions differ by < 1e-4 may route
    differently and is reported, not failed). triton_us: fused; torch_us: unfused (today's
    Gate.forward with fused_gate on before the fold); twin_us: F.linear + twin."""
    from treeflash.kernels.moe_router import fused_logits_ok

    rows = []
    g = torch.Generator(device=dev).manual_seed(3)
    e, hidden, groups, keep, top_k = 8, 256, 2, 1, 2
    assert fused_logits_ok(e, hidden, top_k)
    w32 = torch.randn(e, hidden, device=dev, generator=g) / hidden ** 0.5
    bias = 0.1 * torch.randn(e, device=dev, generator=g)
    args = (bias, "sigmoid", "noaux_tc", groups, keep, top_k, True, 2.5)

    def unfused(x, impl):
        return kernels.moe_gate(torch.nn.functional.linear(x.float(), w32), *args, impl=impl)

    for t in (1, 32):
        x = torch.randn(t, hidden, device=dev, generator=g).to(torch.bfloat16)
        res = {"fused": kernels.moe_gate_fused(x, w32, *args, impl="triton"),
               "unfused": unfused(x, "triton"), "twin": unfused(x, "torch")}
        srt = {k: (w.gather(1, i.argsort(-1)), i.sort(-1).values) for k, (w, i) in res.items()}
        logits = torch.nn.functional.linear(x.double(), w32.double())
        choice = logits.sigmoid() + bias.double()  # margins of the two decisions (float64)
        grp = choice.view(t, groups, -1).topk(2, -1)[0].sum(-1).sort(-1, descending=True).values
        near = (grp[:, 0] - grp[:, 1]).abs() < 1e-4
        sel = choice.view(t, groups, -1).sort(-1, descending=True).values
        near |= ((sel[..., top_k - 1] - sel[..., top_k]).abs() < 1e-4).any(-1)
        for ref in ("unfused", "twin"):
            same = (srt["fused"][1] == srt[ref][1]).all(-1)
            ok_ids = bool((same | near).all())
            err = (srt["fused"][0] - srt[ref][0])[same].abs().max().item() if same.any() else 0.0
            row = {"case": f"router fused-logits pair 8x256 bf16 {t} rows vs {ref}", "rel_err": err, "tol": 5e-6,
                   "equal_fraction": same.float().mean().item(), "near_ties": int(near.sum()),
                   "ok": ok_ids and err <= 5e-6}
            if ref == "unfused":
                row["triton_us"] = graph_us(partial(kernels.moe_gate_fused, x, w32, *args, impl="triton"))
                row["torch_us"] = graph_us(partial(unfused, x, "triton"))
                row["twin_us"] = graph_us(partial(unfused, x, "torch"))
            if not row["ok"]:
                FAILS.append(row["case"])
            rows.append(row)
    return rows


def tree_rows(dev) -> list[dict]:
    """The one-launch DDTree build (kernels/tree_build.py) against the torch build: every
    field equal (it is meant to be bit-exact), and the time of each under a graph."""
    from treeflash.speculative import build

    rows = []
    g = torch.Generator(device=dev).manual_seed(1)
    for budget, batch in ((15, 1), (31, 1), (63, 1), (127, 1), (31, 4)):
        logits = torch.randn(batch, 15, 4096, device=dev, generator=g) * 3
        roots = torch.randint(0, 4096, (batch,), device=dev, generator=g)
        start = torch.randint(0, 1000, (batch,), device=dev, generator=g)
        trees = {}
        for impl in ("triton", "torch"):
            build.FUSED_TREE = impl
            trees[impl] = build.build_tree("ddtree", logits, roots, start, budget)
        same = all(torch.equal(getattr(trees["triton"], f), getattr(trees["torch"], f))
                   for f in ("tokens", "parents", "depths", "positions", "ancestor_mask", "valid"))
        row = {"case": f"ddtree build budget {budget} batch {batch}", "rel_err": 0.0 if same else 1.0,
               "tol": 0.0, "equal_fraction": 1.0 if same else 0.0, "ok": same}
        for impl in ("triton", "torch"):
            build.FUSED_TREE = impl
            row[f"{impl}_us"] = graph_us(partial(build.build_tree, "ddtree", logits, roots, start, budget),
                                                    calls=10)
        build.FUSED_TREE = None
        if not same:
            FAILS.append(row["case"])
        rows.append(row)
    return rows


def walk_rows(dev) -> list[dict]:
    """The one-launch walk + packing (kernels/walk_pack.py) against the torch walk on built trees
    (a target that follows some child most of the time): every output equal, and the time of
    each under a graph."""
    from treeflash.speculative import build

    rows = []
    g = torch.Generator(device=dev).manual_seed(2)
    cands = torch.tensor([7, 15, 31, 63, 127], device=dev)
    for budget, batch in ((15, 1), (31, 1), (127, 1), (31, 4)):
        logits = torch.randn(batch, 15, 4096, device=dev, generator=g) * 3
        roots = torch.randint(0, 4096, (batch,), device=dev, generator=g)
        tree = build.build_tree("ddtree", logits, roots, torch.zeros(batch, dtype=torch.long, device=dev), budget)
        # post: the token of node i's first child where it has one (walks go deep), else random
        n = tree.width
        idx = torch.arange(n, device=dev).expand_as(tree.tokens)
        src = torch.where((tree.parents >= 0) & tree.valid, idx, n)
        first = torch.full_like(tree.tokens, n).scatter_reduce(1, tree.parents.clamp(min=0), src, "amin")
        kid = tree.tokens.gather(1, first.clamp(max=n - 1))
        post = torch.where(first < n, kid, torch.randint(0, 4096, tree.tokens.shape, device=dev, generator=g))
        args = (tree.tokens, tree.parents, tree.depths, tree.valid, tree.ancestor_mask, post, tree.max_depth + 1,
                cands)
        ref, got = (kernels.tree_walk(*args, impl=impl) for impl in ("torch", "triton"))
        same = all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
        row = {"case": f"walk + pack budget {budget} batch {batch} (accepted {ref[3].tolist()})",
               "rel_err": 0.0 if same else 1.0, "tol": 0.0, "equal_fraction": 1.0 if same else 0.0, "ok": same}
        for impl in ("triton", "torch"):
            row[f"{impl}_us"] = graph_us(partial(kernels.tree_walk, *args, impl=impl), calls=10)
        if not same:
            FAILS.append(row["case"])
        rows.append(row)
    for shape in ((1, 32, 4096), (1, 64, 4096), (4, 32, 4096)):  # the tail's greedy tokens
        x = (torch.randn(shape, device=dev, generator=g) * 4).round()  # ties for the maximum
        same = torch.equal(kernels.argmax(x, impl="triton"), x.argmax(-1))
        row = {"case": f"argmax rows {list(shape)}", "rel_err": 0.0 if same else 1.0, "tol": 0.0,
               "equal_fraction": 1.0 if same else 0.0, "ok": same}
        for impl in ("triton", "torch"):
            row[f"{impl}_us"] = graph_us(partial(kernels.argmax, x, impl=impl), calls=10)
        if not same:
            FAILS.append(row["case"])
        rows.append(row)
    return rows


def topk_rows(dev) -> list[dict]:
    """The tree build's top-k of the drafter's log-probs (kernels/topk_lp.py) against its torch
    twin on the GPU: tokens equal, values within 1e-5 relative; timed against the line it
    replaced, torch.log_softmax(x.float(), -1).topk(k) (torch_us; the twin's time: twin_us)."""
    rows = []
    g = torch.Generator(device=dev).manual_seed(3)
    cases = (((1, 15, 4096), 31, torch.float32, False), ((4, 15, 4096), 31, torch.float32, False),
             ((1, 15, 4096), 1, torch.float32, False), ((1, 15, 4096), 127, torch.float32, False),
             ((1, 15, 4096), 31, torch.bfloat16, False), ((2, 15, 4096), 31, torch.float32, True))
    for shape, k, dtype, ties in cases:
        x = torch.randn(shape, device=dev, generator=g) * 3
        if ties:  # ~9 distinct values: the lower token id first among equals
            x = (x / 2).round()
        x = x.to(dtype)
        got_lp, got_tok = kernels.topk_logprobs(x, k, impl="triton")
        want_lp, want_tok = kernels.topk_logprobs(x, k, impl="torch")
        tag = f"topk_logprobs {str(dtype)[6:]} {list(shape)} k={k}" + (" ties" if ties else "")
        row = check(tag, got_lp, want_lp, 0)
        if not torch.equal(got_tok, want_tok):
            row["ok"] = False
            row["equal_fraction"] = (got_tok == want_tok).float().mean().item()
            FAILS.append(tag + " tokens")
        row["triton_us"] = graph_us(partial(kernels.topk_logprobs, x, k, impl="triton"))
        row["torch_us"] = graph_us(lambda x=x, k=k: torch.log_softmax(x.float(), dim=-1).topk(k, dim=-1))
        row["twin_us"] = graph_us(partial(kernels.topk_logprobs, x, k, impl="torch"))
        rows.append(row)
    return rows


def pair_rows(dev) -> list[dict]:
    """The shipped pair, fp32 and bf16: logits of a prompt and greedy tokens, fused vs not."""
    rows = []
    prompt = "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n"
    for dtype in ("float32", "bfloat16"):
        res = {}
        for fused in ("1", "0"):
            opts = RuntimeOptions(fused_norm=fused == "1", fused_gate=fused == "1")
            llm = LLM(spec="ddtree", tree_budget=16, device=dev.type, dtype=dtype, seed=0, runtime_options=opts)
            res[fused] = (llm.score(llm.encode(prompt)),
                          llm.generate(prompt, SamplingParams(max_tokens=96, ignore_eos=True))[0].token_ids)
        # float32 logits either way; a bf16 model's differ by the rounding order through its
        # layers: bounded at 8 bf16 epsilons of the largest logit (2026-12-02: 4.4)
        tol = 8 * torch.finfo(torch.bfloat16).eps if dtype == "bfloat16" else None
        row = check(f"shipped pair {dtype} logits fused vs torch ops", res["1"][0], res["0"][0], 0, tol)
        row["same_greedy_tokens"] = res["1"][1] == res["0"][1]
        row["first_divergence"] = next((i for i, (a, b) in enumerate(zip(res["1"][1], res["0"][1])) if a != b), None)
        if dtype == "float32" and not row["same_greedy_tokens"]:
            FAILS.append(row["case"] + " tokens")
            row["ok"] = False
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = (kernel_rows(dev) + router_rows(dev) + tree_rows(dev) + walk_rows(dev) + topk_rows(dev)
            + pair_rows(dev))
    print("| case | rel err | tol | equal | triton us | torch us | ok |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['rel_err']:.2e} | {r['tol']:.1e} | {r['equal_fraction']:.4f} | "
              f"{r.get('triton_us', float('nan')):.2f} | {r.get('torch_us', float('nan')):.2f} | {r['ok']} |")
    meta = {"gpu": torch.cuda.get_device_name(), "commit": git_commit(), "torch": torch.__version__,
            "command": "python benchmarks/check_fused.py --out " + args.out}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "fails": FAILS}, indent=2))
    print("FAILED: " + ", ".join(FAILS) if FAILS else "all checks ok")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
