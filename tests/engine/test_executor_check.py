"""The engine emits a step's tokens only after the executor has vouched for the step.

With tensor parallelism on NCCL, a collective that the follower watch aborts returns without an
error and the tokens read back after it are garbage: `DistributedExecutor.check()` raises then.
Here a local executor's check fails at a chosen call, and nothing of that step may reach a
request (no token appended, no output returned)."""

from __future__ import annotations

import pytest

from helpers.spec import prompts
from treeflash import LLM, SamplingParams
from treeflash.parallel.errors import DistributedError


class Broken:
    """Wraps executor.check: the `fail_at`-th call (1-based) raises."""

    def __init__(self, executor, fail_at: int):
        self.calls, self.fail_at, self.inner = 0, fail_at, executor.check

    def __call__(self):
        self.calls += 1
        if self.calls == self.fail_at:
            raise DistributedError("tensor-parallel group failed during the last step: rank 1 died")
        self.inner()


@pytest.mark.parametrize("spec", [None, "ddtree"])
@pytest.mark.parametrize("fail_at", [1, 2, 5])
def test_a_step_the_executor_rejects_emits_nothing(target, drafter_path, spec, fail_at):
    kw = {"spec": "ddtree", "tree_budget": 8} if spec else {}
    llm = LLM(target, drafter_path if spec else None, device="cpu", dtype="float32", page_size=8, **kw)
    engine = llm.engine
    engine.executor.check = broken = Broken(engine.executor, fail_at)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts()[:2]]
    emitted = {r.request_id: 0 for r in reqs}
    with pytest.raises(DistributedError, match="rank 1 died"):
        for _ in range(20):
            for out in engine.step():
                emitted[out.request_id] += len(out.new_token_ids)
    assert broken.calls == fail_at
    # Every token a request holds was returned by a step the executor accepted, and no more.
    assert {r.request_id: len(r.output_ids) for r in reqs} == emitted
    if fail_at == 1:  # the prefill step itself failed
        assert emitted == {r.request_id: 0 for r in reqs}
