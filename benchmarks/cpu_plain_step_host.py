"""Host time of a plain decode step outside its forward, spec off against the auto tree budget's
plain spells (an always-wrong drafter), on the CPU: the share of a plain step under auto that is
not spec off's (issue 42's acceptance-0 bar; benchmarks/notes/spec-cost.md).

The tests' tiny target (tests/helpers: a DeepSeek-V3-shaped checkpoint of a few MB), float32, one
thread, the CUDA-graph path run eagerly; the drafter is `WrongDrafter` and the sizing prices steps
with a synthetic cost (no tree pays), so every run decodes plainly whatever this host's step
times do. Per step: the engine step's wall minus the decode call's (`plain_step` under auto,
`Engine._decode` for spec off: forward, logits, token choice), medians over steps, then over
rounds (off and auto interleaved). Run it against another checkout with PYTHONPATH=that/src.

    PYTHONPATH=src python benchmarks/cpu_plain_step_host.py --rounds 4 --tokens 400
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers: the tiny target

import treeflash  # noqa: E402
from helpers.hf_checkpoints import write_checkpoint  # noqa: E402
from helpers.spec import VOCAB, SyntheticCost  # noqa: E402
from treeflash import LLM, SamplingParams  # noqa: E402
from treeflash.speculative import decoder  # noqa: E402
from treeflash.speculative.testing_drafters import WrongDrafter  # noqa: E402

NO_TREE_PAYS = SyntheticCost(lambda n: 1.0, lambda n, b: 1.5 + 0.01 * b)


class DecodeTimer:
    """Seconds of each decode call (plain_step, Engine._decode) since the last clear."""

    def __init__(self):
        self.calls: list[float] = []

    def wrap(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.calls.append(time.perf_counter() - t0)
            return out
        return timed


def run(llm: LLM, prompt: list[int], tokens: int, timer: DecodeTimer) -> dict:
    """One request: per plain step, host seconds outside the decode call, and the whole step."""
    eng = llm.engine
    req = eng.add_request(list(prompt), SamplingParams(max_tokens=tokens, ignore_eos=True))
    eng.step()  # the prefill
    outside, whole = [], []
    while not req.finished:
        timer.calls.clear()
        t0 = time.perf_counter()
        eng.step()
        wall = time.perf_counter() - t0
        if timer.calls:  # a plain step (a tree step at batch 1 runs no plain decode)
            outside.append(wall - sum(timer.calls))
            whole.append(wall)
    return {"steps": len(outside), "outside_us": 1e6 * statistics.median(outside),
            "outside_mean_us": 1e6 * statistics.mean(outside), "step_ms": 1e3 * statistics.median(whole)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=400, help="tokens a request (the tiny target allows 488)")
    ap.add_argument("--out", default=None, help="JSON of every round")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = write_checkpoint(Path(tempfile.mkdtemp()) / "m", initializer_range=0.3)
    prompt = [(7 * i + 3) % (VOCAB - 2) + 1 for i in range(24)]
    timer = DecodeTimer()
    off = LLM(target, device="cpu", dtype="float32", page_size=8, cuda_graphs=True)
    want = off.generate(prompt, SamplingParams(max_tokens=args.tokens, ignore_eos=True))[0].token_ids
    off.engine._decode = timer.wrap(off.engine._decode)
    decoder.plain_step = timer.wrap(decoder.plain_step)
    rounds: dict[str, list[dict]] = {"off": [], "auto": []}
    for r in range(args.rounds):
        rounds["off"].append(run(off, prompt, args.tokens, timer))
        auto = LLM(target, WrongDrafter(VOCAB, 6, sequences=[prompt + want], target_layer_ids=(0, 2)), spec="ddtree",
                   tree_budget="auto", device="cpu", dtype="float32", page_size=8, cuda_graphs=True)
        auto.engine.spec._cost = NO_TREE_PAYS
        rounds["auto"].append(run(auto, prompt, args.tokens, timer))
        print(f"round {r + 1}/{args.rounds}: off {rounds['off'][-1]['outside_us']:.0f} us, "
              f"auto {rounds['auto'][-1]['outside_us']:.0f} us outside the decode call", flush=True)
    summary = {k: {m: statistics.median(x[m] for x in v) for m in ("outside_us", "outside_mean_us", "step_ms")}
               for k, v in rounds.items()}
    print(f"treeflash from {Path(treeflash.__file__).parent}")
    for k, s in summary.items():
        print(f"{k:4s}: outside the decode call median {s['outside_us']:.0f} us (mean {s['outside_mean_us']:.0f}), "
              f"whole plain step median {s['step_ms']:.2f} ms")
    print(f"auto / off whole plain step: {summary['auto']['step_ms'] / summary['off']['step_ms']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"source": str(Path(treeflash.__file__).parent), "rounds": rounds,
                                              "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
