"""Under torchrun every rank runs the same script: rank 0 gets the LLM, the others follow
inside `LLM(...)` and exit with it. World size 1 takes the same distributed path (on the
GPU that is NCCL at world size 1)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tp_helpers import MAX_TOKENS

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
