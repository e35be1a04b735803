"""Under torchrun every rank runs the same script: rank 0 gets the LLM, the others follow
inside `LLM(...)` and exit with it. World size 1 takes the same distributed path (on the
GPU that is NCCL at world size 1)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from helpers.tp import MAX_TOKENS

pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys, torch
from treeflash import LLM, SamplingParams
torch.set_num_threads(1)
path, tp, ep, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(path, device="cpu", dtype="float32", page_size=8, tp=tp, ep=ep)
outs = llm.generate(prompts, SamplingParams(max_tokens=int(sys.argv[5]), ignore_eos=True))
print("TOKENS " + json.dumps([o.token_ids for o in outs]), flush=True)
print("EXECUTOR " + type(llm.engine.executor).__name__, flush=True)
llm.close()
"""


@pytest.mark.parametrize("world, ep", [(2, 2), (1, 1)])
def test_torchrun_equals_tp1(target, reference, tmp_path, world, ep):
    ps, expected, _ = reference
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(script), str(target), str(world), str(ep), json.dumps(ps), str(MAX_TOKENS)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    tokens = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("TOKENS ")]
    assert tokens == [expected], done.stdout  # printed by rank 0 only
    assert "EXECUTOR DistributedExecutor" in lines


RAISES = """
import sys, torch
from treeflash import LLM, SamplingParams
from treeflash.parallel import worker
from treeflash.parallel.errors import DistributedError

def forward(self, sizes):
    raise torch.OutOfMemoryError("CUDA out of memory (planted by the test)")

worker.Follower._forward = forward
torch.set_num_threads(1)
llm = LLM(sys.argv[1], device="cpu", dtype="float32", page_size=8, tp=2)
try:
    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
except DistributedError as e:
    print("ERROR " + str(e), flush=True)
"""


def test_torchrun_follower_exception_is_named(target, tmp_path):
    """Under torchrun too, rank 0 names the follower that raised (found in torchrun's store).
    The two ranks are started by hand with torchrun's variables: torchrun's agent would kill
    rank 0 as soon as it saw rank 1 exit, racing the message this test reads."""
    import os
    import socket

    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, str(script), str(target)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]
    (out0, err0), (_, err1) = (p.communicate(timeout=60) for p in procs)
    assert procs[1].returncode == 1, err1
    assert re.search(r"^ERROR tensor-parallel group failed during forward: rank 1 \(pid \d+\) raised "
                     r"OutOfMemoryError: CUDA out of memory \(planted by the test\)$", out0, re.M), out0 + err0
    assert "treeflash tp rank 0: rank 1" in err0 and "Traceback (most recent call last)" in err0, err0
