"""Constants and prompts shared by the tensor-parallel tests."""

from __future__ import annotations

import torch

VOCAB = 96
MAX_TOKENS = 20


def prompts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB - 1, (int(torch.randint(1, 30, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def raising_follower(fail_rank, forwards, *args):
    """`worker.follower_main` for a spawned follower, except that rank `fail_rank` runs out of
    memory in its `forwards`-th forward (after receiving the step, while rank 0 is inside it).
    A test puts `functools.partial(raising_follower, r, n)` in place of `follower_main`."""
    from treeflash.parallel import worker

    rank = args[1]
    real, calls = worker.Follower._forward, []

    def forward(self, sizes):
        calls.append(1)
        if rank == fail_rank and len(calls) == forwards:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (planted by the test)")
        return real(self, sizes)

    worker.Follower._forward = forward
    worker.follower_main(*args)


def dying_follower(fail_rank, forwards, pidfile, *args):
    """`worker.follower_main`, except that rank `fail_rank` dies by SIGKILL in its `forwards`-th
    forward, as NCCL sees a dead peer: a forked grandchild keeps every file descriptor open, so
    rank 0's gloo sockets to it stay open and its collective waits, as an NCCL kernel waits for
    a peer that is gone. The grandchild's pid is written to `pidfile`; it sleeps 60 s, and the
    test kills it (closing those sockets, as aborting the NCCL communicator ends the wait)."""
    import os
    import signal
    import time

    from treeflash.parallel import worker

    rank = args[1]
    real, calls = worker.Follower._forward, []

    def forward(self, sizes):
        calls.append(1)
        if rank == fail_rank and len(calls) == forwards:
            child = os.fork()
            if child == 0:  # only this thread exists in the child: sleep and leave, nothing else
                time.sleep(60)
                os._exit(0)
            with open(pidfile, "w") as f:
                f.write(str(child))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, sizes)

    worker.Follower._forward = forward
    worker.follower_main(*args)


def dcp_engine(llm, drafter=None, mode="ddtree", budget=16):
    """An engine on `llm`'s executor (its group), with a spec decoder over `drafter`, prefill chunks of 8."""
    from treeflash.engine.engine import Engine
    from treeflash.speculative.decoder import make_spec_decoder

    spec = None if drafter is None else make_spec_decoder(llm.model, drafter, mode, budget, llm.device, llm.dtype)
    return Engine(llm.model, llm.pool, llm.tokenizer, max_model_len=llm.max_model_len, spec=spec,
                  prefill_chunk=8, executor=llm.engine.executor)


def run_engine(engine, ps, on_step=None, max_tokens=MAX_TOKENS):
    """Greedy outputs of `ps` on `engine`; on_step(steps, requests) after each step."""
    from treeflash import SamplingParams

    reqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in ps]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if on_step is not None:
            on_step(steps, reqs)
    return [r.output_ids for r in reqs]
