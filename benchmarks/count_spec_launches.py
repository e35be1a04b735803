"""Launch-sized ops per engine step of the shipped pair, by op and by the Python line that
issued them: spec off against ddtree, to find copies and small launches the spec step can drop.

    python benchmarks/count_spec_launches.py [--device cpu|cuda] [--budget 31] [--steps 5]

Runs the graphed path (the static buffers of engine/graphs.py and speculative/draft_graphs.py,
tail_graphs.py) *eagerly* ("eager" graph mode, on CUDA too), so every op that a replayed
graph would launch is a visible, attributable aten op. Counts leaf aten ops (those that
call no other aten op: on a GPU each is about one kernel), leaving out ops that launch
nothing (views, empty, metadata). Two caveats: the eager graph mode copies its outputs into
the tensors a replay would write in place (`_keep`, `_run_in_place`: marked "eager-only"
below, not launched under real graphs); and on the CPU the Triton kernels of the CUDA path
(tree build, walk, top-k, drafter attention, MLA verify, kv_commit) run as their torch
twins; --device cuda gives the CUDA path's exact ops (--graphs cuda: device kernels per step
by name, replayed graphs included).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from treeflash import LLM, SamplingParams  # noqa: E402

PROMPT = "def quicksort(xs):"
# Ops that launch no kernel: views, allocation, metadata.
NO_LAUNCH = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::view", "aten::_unsafe_view",
    "aten::as_strided", "aten::reshape", "aten::slice", "aten::select", "aten::transpose", "aten::t",
    "aten::permute", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::unflatten",
    "aten::flatten", "aten::alias", "aten::detach", "aten::lift_fresh", "aten::resize_",
    "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::narrow",
    "aten::result_type", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense",
    "aten::set_", "aten::record_stream", "aten::pin_memory", "aten::is_pinned", "aten::_pin_memory",
    "aten::expand_as", "aten::view_as", "aten::chunk", "aten::unfold", "aten::diagonal",
    "aten::_reshape_alias", "aten::contiguous", "aten::to", "aten::_to_copy", "aten::numpy_T",
    "aten::resolve_conj", "aten::resolve_neg", "aten::conj", "aten::scalar_tensor",
}
# The copies the eager graph mode makes in place of a replay's in-place writes.
EAGER_ONLY = ("draft_graphs.py", "_keep"), ("graphs.py", "_run_in_place")
WATCH = ("aten::copy_", "aten::index_select", "aten::sort", "aten::cat", "aten::fill_", "aten::gather",
         "aten::index", "aten::index_put_", "aten::scatter_", "aten::index_copy_", "aten::zero_",
         "aten::clone", "aten::where", "aten::arange", "aten::topk")


def frames(ev):
    """The op's Python callers, innermost first (the profiler's Python events above it)."""
    ev = ev.cpu_parent
    while ev is not None:
        if ".py(" in ev.name:
            yield ev.name
        ev = ev.cpu_parent


def site(ev, depth: int = 2) -> str:
    """The innermost `depth` treeflash frames above the op ("file(line): func < caller")."""
    ours = [f.split("treeflash/", 1)[-1] for f in frames(ev) if f.startswith("treeflash/")]
    return " < ".join(ours[:depth]) or "?"


def eager_only(ev) -> bool:
    """Issued by the eager graph mode's own copies (the innermost treeflash frame is one)."""
    inner = next((f for f in frames(ev) if f.startswith("treeflash/")), "")
    return any(f in inner and fn in inner for f, fn in EAGER_ONLY)


def leaves(prof):
    """aten ops that call no other aten op and launch something (not the Triton interpreter's)."""
    for ev in prof.events():
        if not ev.name.startswith("aten::") or ev.name in NO_LAUNCH:
            continue
        if any(fr.startswith("triton/") for fr in frames(ev)):
            continue
        if any(c.name.startswith("aten::") and c.name not in NO_LAUNCH for c in ev.cpu_children):
            continue
        yield ev


def build(spec: str, budget: int, device: str, graphs: str) -> LLM:
    dtype = "bfloat16" if device == "cuda" else "float32"
    llm = LLM(spec=spec, tree_budget=budget if spec == "ddtree" else None, device=device, dtype=dtype,
              seed=0, cuda_graphs=graphs == "cuda")
    eng = llm.engine
    if graphs == "eager":
        eng.executor.enable_graphs("eager", max_rows=eng.verify_width, max_batch=eng.max_running)
        if eng.spec is not None:
            eng.spec.enable_graphs("eager")
    return llm


def kernel_table(prof, steps: int) -> None:
    """Device kernels and copies per step, by name (a replayed graph's included)."""
    from torch.autograd import DeviceType

    by = Counter(e.name for e in prof.events() if e.device_type == DeviceType.CUDA)
    print(f"-- device kernels per step: {sum(by.values()) / steps:.1f}")
    for name, n in by.most_common():
        print(f"{n / steps:7.1f}  {name[:140]}")


def count(spec: str, budget: int, device: str, steps: int, width: int, graphs: str = "eager") -> dict:
    llm = build(spec, budget, device, graphs)
    llm.generate(PROMPT, SamplingParams(max_tokens=64, ignore_eos=True))  # caches, compiles
    eng = llm.engine
    req = eng.add_request(llm.encode(PROMPT), SamplingParams(max_tokens=4096, ignore_eos=True))
    while req.num_cached == 0 or len(req.output_ids) < 8:
        eng.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts, with_stack=True) as prof:
        for _ in range(steps):
            eng.step()
        if device == "cuda":
            torch.cuda.synchronize()
    by_op, by_site, launches, eager = Counter(), Counter(), 0, 0
    for ev in leaves(prof):
        if eager_only(ev):
            eager += 1
            continue
        launches += 1
        by_op[ev.name] += 1
        if ev.name in WATCH:
            by_site[(ev.name, site(ev))] += 1
    print(f"\n===== {spec} ({device}): {launches / steps:.1f} leaf ops a step "
          f"(+{eager / steps:.1f} eager-only copies not counted)")
    print("-- watched ops per step")
    for name in WATCH:
        if by_op[name]:
            print(f"{by_op[name] / steps:7.1f}  {name}")
    print("-- watched ops per step by call site")
    for (name, where), n in sorted(by_site.items(), key=lambda kv: (kv[0][0], -kv[1])):
        print(f"{n / steps:7.1f}  {name:<20} {where[:width]}")
    print("-- every leaf op per step")
    for name, n in by_op.most_common():
        print(f"{n / steps:7.1f}  {name}")
    if device == "cuda":
        kernel_table(prof, steps)
    llm.close()
    return {"launches": launches / steps, **{k: v / steps for k, v in by_op.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--budget", type=int, default=31)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--modes", default="off,ddtree")
    p.add_argument("--width", type=int, default=110, help="call-site column width")
    p.add_argument("--graphs", default="eager", choices=("eager", "cuda"),
                   help="eager: the graphed path run eagerly (ops attributable); cuda: replayed "
                        "graphs (CUDA only: device kernels by name, the host ops left outside graphs)")
    args = p.parse_args()
    torch.set_num_threads(1)
    for spec in args.modes.split(","):
        count(spec, args.budget, args.device, args.steps, args.width, args.graphs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
