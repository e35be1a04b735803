"""The speculative step at batch > 1, counted on the CPU (where it cannot be timed faithfully):
the batched drafter append equals the per-request one, the padded context gather of a proposal
is one launch per tensor, the eager launches of a batched step grow by a bounded number per
request, and after a warm-up a served batch of 8 captures no graph. On the H100 (2026-12-07,
benchmarks/notes/serve-batch.md) the batched step ran ~10x slower than spec off's at 8 requests.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from treeflash import LLM, SamplingParams
from treeflash.engine.warmup import warm, warm_buckets
from treeflash.graph_capture import graph_captures
from treeflash.runtime import RuntimeOptions
from treeflash.speculative import overlap


def _drafter(dtype=torch.float32, fused: str = "torch"):
    from helpers.drafter import drafter_config, random_state_dict, target_heads
    from treeflash.config import DrafterConfig
    from treeflash.models.drafter import DFlashDrafter

    raw = drafter_config(layer_types=("sliding_attention", "full_attention"), sliding_window=4, block_size=6)
    embed, head = target_heads(64, 32)
    return DFlashDrafter.from_state_dict(DrafterConfig.from_hf(raw), random_state_dict(raw, seed=3), embed, head,
                                         dtype=dtype, options=RuntimeOptions(fused_kernels=fused))


def _filled(drafter, n: int, g: torch.Generator, presize: int = 0):
    cache = drafter.new_cache()
    if presize:
        cache.presize(presize)
    width = drafter.cfg.num_taps * drafter.cfg.hidden_size
    drafter.extend(cache, torch.randn(n, width, generator=g))
    return cache


@pytest.mark.parametrize("fused", ["torch", "triton"])
def test_batched_append_matches_per_request(fused):
    """extend_static_batch (fc, norm and the k/v GEMM once for the batch) writes each request's
    cache as extend_static does request by request, bit for bit (float32; the fused path's torch
    twin, and its Triton kernel through the interpreter); masked counts 1..6, contexts of
    different lengths, a ring that wraps."""
    drafter = _drafter(fused=fused)
    g = torch.Generator().manual_seed(0)
    lengths, counts = (3, 9, 5), torch.tensor([1, 6, 4])
    runs = {path: [_filled(drafter, n, torch.Generator().manual_seed(n)) for n in lengths]
            for path in ("batch", "each")}
    rows = drafter.block_size
    feats = torch.randn(len(lengths), rows, drafter.cfg.num_taps * drafter.cfg.hidden_size, generator=g)
    start = torch.tensor(lengths)
    for path, caches in runs.items():
        first = torch.tensor([c.reserve(rows) for c in caches]).T.contiguous()  # [layers, B]
        if path == "batch":
            drafter.extend_static_batch(caches, feats, start, first, counts)
        else:
            for i, c in enumerate(caches):
                drafter.extend_static(c, feats[i], start[i:i + 1], first[:, i], counts[i:i + 1])
        for c, k in zip(caches, counts.tolist(), strict=True):
            c.advance(k)
    for a, b in zip(runs["batch"], runs["each"], strict=True):
        for la, lb in zip(a.layers, b.layers, strict=True):
            assert (la.n, la.head, la.capacity) == (lb.n, lb.head, lb.capacity)
            for x, y in ((la.k, lb.k), (la.v, lb.v), (la.pos, lb.pos)):
                assert torch.equal(x, y)


def test_batched_append_launches_once_per_batch(monkeypatch):
    """fc, hidden_norm and the k/v GEMM once for 5 requests, the cache write once per request."""
    from treeflash.models import drafter as drafter_mod

    drafter = _drafter()
    caches = [_filled(drafter, 4, torch.Generator().manual_seed(i)) for i in range(5)]
    rows = drafter.block_size
    first = torch.tensor([c.reserve(rows) for c in caches]).T.contiguous()
    gemms, writes = [], []
    real_gemm, real_write = drafter_mod._layers_linear, drafter_mod.kernels.drafter_kv_write
    monkeypatch.setattr(drafter_mod, "_layers_linear", lambda *a: gemms.append(a[0].shape) or real_gemm(*a))
    monkeypatch.setattr(drafter_mod.kernels, "drafter_kv_write",
                        lambda *a, **k: writes.append(1) or real_write(*a, **k))
    feats = torch.randn(5, rows, drafter.cfg.num_taps * drafter.cfg.hidden_size)
    drafter.extend_static_batch(caches, feats, torch.full((5,), 4), first, torch.full((5,), 2))
    assert gemms == [(5 * rows, drafter.cfg.hidden_size)] and len(writes) == 5


def test_gather_of_equal_lengths_is_one_stack_per_tensor():
    """A batch's full views (caches presized alike: the overlapped step's proposal) are stacked,
    one launch per tensor, and equal the padded copy's values."""
    from treeflash.models.drafter import _gather_context

    drafter = _drafter()
    caches = [_filled(drafter, n, torch.Generator().manual_seed(n), presize=16) for n in (3, 7, 5)]
    copies = _Ops()
    with copies:
        k, v, pos = _gather_context(caches, 1, torch.float32, torch.device("cpu"), full=True)
    assert copies.total() == 3, copies.ops  # one stack each for k, v and the positions
    for i, c in enumerate(caches):
        kb, vb, pb = c.layers[1].full_view()
        assert torch.equal(k[i], kb) and torch.equal(v[i], vb) and torch.equal(pos[i], pb)
    k2, _, pos2 = _gather_context(caches, 1, torch.float32, torch.device("cpu"), full=False)  # unequal: padded
    assert k2.shape[2] == 7 and (pos2[0, 3:] == -1).all()


class _Ops(TorchDispatchMode):
    """Ops dispatched inside (views left out: they launch nothing)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.paused = 0
        self.on = False  # inside the counted step (for counts kept outside dispatch)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not view and not self.paused:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.ops.values())


def _eager_ops_per_step(llm, batch: int, monkeypatch) -> int:
    """Ops of one steady overlapped step at `batch` that would run eagerly on CUDA: the verify
    forward's (a graph replay there) left out."""
    from treeflash.engine.graphs import VerifyGraphs

    ops = _Ops()
    real = VerifyGraphs._run

    def graphed(self, step):
        ops.paused += 1
        try:
            return real(self, step)
        finally:
            ops.paused -= 1

    monkeypatch.setattr(VerifyGraphs, "_run", graphed)
    from treeflash.models import drafter as drafter_mod

    write = drafter_mod.kernels.drafter_kv_write

    def one_launch(*a, **k):  # its torch twin here, one Triton launch on CUDA
        ops.ops["drafter_kv_write"] += ops.on
        ops.paused += 1
        try:
            return write(*a, **k)
        finally:
            ops.paused -= 1

    monkeypatch.setattr(drafter_mod.kernels, "drafter_kv_write", one_launch)
    eng = llm.engine
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    reqs = [eng.add_request([3 + i, 4, 5, 6, 7, 8], params) for i in range(batch)]
    while not all(r.output_ids for r in reqs):
        eng.step()
    eng.step()  # the first step of the whole batch (the queued tree was for none)
    with ops:
        ops.on = True
        eng.step()
        ops.on = False
    for r in reqs:
        eng.abort(r.request_id)
    monkeypatch.setattr(VerifyGraphs, "_run", real)
    monkeypatch.setattr(drafter_mod.kernels, "drafter_kv_write", write)
    return ops


@pytest.mark.slow
def test_batched_step_launches_grow_little_per_request(target, drafter_path, monkeypatch):
    """Overlapped (the CUDA default) with graphs, on the fused path's torch twins: going from 2 to 8
    requests adds one eager launch per request, the cache write (before: 10, the context gather's
    3 copies a request a drafter layer and the append's fc, norm and k/v GEMM a request)."""
    monkeypatch.setattr(overlap, "OVERLAP", True)
    llm = LLM(target, drafter_path, spec="ddtree", tree_budget=4, device="cpu", dtype="float32", page_size=4,
              cuda_graphs=True, max_running=8, runtime_options=RuntimeOptions(fused_kernels="torch"))
    two, eight = (_eager_ops_per_step(llm, b, monkeypatch) for b in (2, 8))
    per_request = (eight.total() - two.total()) / 6
    assert per_request <= 1, eight.ops - two.ops


@pytest.mark.slow
def test_served_batch_of_8_captures_nothing_after_warmup(target, drafter_path, monkeypatch):
    """After a warm-up at every bucket up to 8, a batch of 8 requests of different lengths (it
    shrinks through every size) captures no graph while more than one request runs: verify graphs
    per bucket, no draft or tail graph at batch > 1, no kernel shape that follows the contexts.
    The last request alone may meet batch-1 draft, append and tail graphs for drafter-cache
    buffers no batch-1 warm-up step used (keyed on their addresses: speculative/draft_graphs.py),
    at most those three, once per buffer set (benchmarks/notes/serve-batch.md)."""
    monkeypatch.setattr(overlap, "OVERLAP", True)
    llm = LLM(target, drafter_path, spec="ddtree", tree_budget=4, device="cpu", dtype="float32", page_size=4,
              cuda_graphs=True, max_running=8)
    prompts = [[3 + i, 4, 5, 6, 7, 8, 9, 10] for i in range(8)]
    warm(llm.engine, prompts, 16, warm_buckets(8))
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(max_tokens=9 + i, ignore_eos=True))
    batched, alone, sizes = 0, 0, set()
    while eng.has_unfinished():
        before, running = graph_captures(), len(eng.running) or len(eng.waiting)
        eng.step()
        sizes.add(running)
        if running > 1:
            batched += graph_captures() - before
        else:
            alone += graph_captures() - before
    assert batched == 0 and alone <= 3, (batched, alone)
    assert {1, 8} <= sizes and len(sizes) >= 4  # it did shrink to one request


def _signature(fn, args, kwargs, loose: tuple[int, ...] = ()) -> tuple:
    """What Triton compiles a launch for: each tensor's dtype and 16-byte alignment, each int's
    ==1 and %16 classes (but those of `loose`, the kernel's do_not_specialize), the constexprs and
    launch options by value (`JITFunction`'s key)."""
    def arg(a, i=-1):
        if i in loose:
            return "any"
        if isinstance(a, torch.Tensor):
            return str(a.dtype), a.data_ptr() % 16 == 0
        if isinstance(a, bool) or not isinstance(a, int):
            return type(a).__name__
        return "int", a == 1, a % 16 == 0
    return (fn.__name__, tuple(arg(a, i) for i, a in enumerate(args)),
            tuple(sorted((k, v if isinstance(v, (bool, int, str, float)) else arg(v)) for k, v in kwargs.items())))


@pytest.mark.slow
def test_served_batch_compiles_no_new_kernel_after_warmup(target, drafter_path, monkeypatch):
    """The drafter's attention kernel (the Triton interpreter standing in for CUDA) at batch > 1 after a
    warm-up: every launch of a served batch that shrinks from 8 through sizes no bucket has meets a
    specialization the warm-up compiled (a new one is a compile inside a served step). Before: a
    proposal for a batch whose requests had changed read the contexts' valid slots, so each step's
    longest context set the split plan and int classes; and B x Hq x Q rows (5 or 7 requests here)
    were specialized on %16."""
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setattr(overlap, "OVERLAP", True)
    seen, phase = {"warm": set(), "served": set()}, ["warm"]
    real = InterpretedFunction.run

    def run(self, *args, **kwargs):
        launch = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        loose = tuple(self.arg_names.index(n) if isinstance(n, str) else n
                      for n in self.kwargs.get("do_not_specialize") or ())
        seen[phase[0]].add(_signature(self.fn, args, launch, loose))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    options = RuntimeOptions(drafter_attention="triton")
    llm = LLM(target, drafter_path, spec="ddtree", tree_budget=4, device="cpu", dtype="float32", page_size=4,
              cuda_graphs=True, max_running=8, runtime_options=options)
    prompts = [[3 + i, 4, 5, 6, 7, 8, 9, 10] for i in range(8)]
    warm(llm.engine, prompts, 16, warm_buckets(8))
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(max_tokens=9 + i, ignore_eos=True))
    phase[0] = "served"
    while eng.has_unfinished() and len(eng.running) != 1:
        eng.step()
    kernels = {s[0] for s in seen["served"]}
    assert "_drafter_attn_kernel" in kernels, kernels
    assert seen["served"] <= seen["warm"], seen["served"] - seen["warm"]
