"""The step's host traffic, counted: a spec step asks the device for values exactly once (the
packed tokens + counts at its end); plain decode once; a MoE layer never.

Python-level reads (.tolist, .item, bool/int/float of a tensor, nonzero) are intercepted
and attributed to the treeflash file that made them. The torch twins in kernels/reference.py
are exempt: on the GPU their Triton counterparts run, which read nothing back.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

from treeflash import LLM, SamplingParams

PKG = Path(__import__("treeflash").__file__).parent
EXEMPT = {PKG / "kernels" / "reference.py"}
READS = ["tolist", "item", "__bool__", "__int__", "__float__", "nonzero", "numpy", "cpu"]


class ReadLog:
    def __init__(self, monkeypatch):
        self.on = False
        self.reads: list[tuple[str, str]] = []
        for name in READS:
            orig = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, orig))

    def _wrap(self, name, orig):
        def read(t, *a, **kw):
            if self.on:
                self._record(name)
            return orig(t, *a, **kw)
        return read

    def _record(self, name):
        for frame in reversed(traceback.extract_stack()[:-2]):
            path = Path(frame.filename)
            if PKG in path.parents:
                if path not in EXEMPT:
                    self.reads.append((name, f"{path.relative_to(PKG)}:{frame.name}"))
                return

    def around(self, fn):
        def wrapped(*a, **kw):
            self.on = True
            try:
                return fn(*a, **kw)
            finally:
                self.on = False
        return wrapped


@pytest.mark.slow
@pytest.mark.parametrize("budget, graphs, overlap", [(8, False, False), ("auto", False, False), (8, True, False),
                                                    (8, False, True), ("auto", True, True)])
def test_spec_step_reads_the_device_once(target, drafter_path, monkeypatch, budget, graphs, overlap):
    """overlap: the step queues its masked append and the next tree before that one read
    (speculative/overlap.py OverlapDriver.queue_next), which must read nothing of its own."""
    from treeflash.speculative import overlap as overlap_driver

    monkeypatch.setattr(overlap_driver, "OVERLAP", overlap)
    llm = LLM(target, drafter_path, spec="ddtree", tree_budget=budget, device="cpu", dtype="float32",
              page_size=4, cuda_graphs=graphs)
    assert llm.engine.spec.overlap is overlap
    log = ReadLog(monkeypatch)
    steps = []
    spec = llm.engine.spec
    inner = log.around(spec.step)

    def step(engine, reqs):
        before = len(log.reads)
        out = inner(engine, reqs)
        steps.append(log.reads[before:])
        return out

    spec.step = step
    llm.generate([[3, 4, 5], [7, 8, 9, 10, 11]], SamplingParams(max_tokens=16, ignore_eos=True))
    assert steps
    # one read a step: the packed copy (on the device .cpu() copies, then .numpy() views it), or
    # under auto for requests decoded plainly their tokens (both when a batch is split)
    tree = [("cpu", "speculative/decoder.py:_to_host"), ("numpy", "speculative/decoder.py:_to_host")]
    plain = [("tolist", "speculative/plain.py:plain_step")]
    for reads in steps:
        assert reads in (tree, plain, plain + tree), reads


def test_decode_and_moe_read_nothing_else(target, monkeypatch):
    llm = LLM(target, device="cpu", dtype="float32", page_size=4)
    log = ReadLog(monkeypatch)
    llm.engine._decode = log.around(llm.engine._decode)
    llm.generate([[3, 4, 5], [9, 9]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert log.reads and set(log.reads) == {("tolist", "engine/engine.py:_decode")}
    assert len(log.reads) == 5  # one per decode step


def test_an_executor_that_ships_steps_gets_host_prefix_lens(target, drafter_path):
    """Executors overriding forward (the distributed one packs host ints for its followers)
    get prefix lens as a list, never a device tensor they would read back per request."""
    from treeflash.engine.executor import LocalExecutor

    seen = []

    class Shipping(LocalExecutor):
        def forward(self, page_lists, input_ids, positions, prefix_lens, tree_mask=None, taps=()):
            seen.append(prefix_lens)
            return super().forward(page_lists, input_ids, positions, prefix_lens, tree_mask, taps)

    llm = LLM(target, drafter_path, spec="ddtree", tree_budget=4, device="cpu", dtype="float32", page_size=4)
    eng = llm.engine
    eng.executor = Shipping(eng.model, eng.pool, eng.attention_impl)
    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert seen and all(isinstance(p, list) for p in seen)
