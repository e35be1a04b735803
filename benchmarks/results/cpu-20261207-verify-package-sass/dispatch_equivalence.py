"""The verify kernel's dispatch table (`kernels/mla_verify/__init__.py`, `dispatch`) against the
rule it replaced (5144cea: `mla_verify.default_config` plus the launcher's fallback when v5 does
not support a call), over a grid of calls: the kernel that runs, its tile, its split plan, the
combine it takes; then the same with the override set (5144cea's TREEFLASH_VERIFY_KERNEL=v4,
the bug-report override `portable` now).

    git archive 5144cea src | tar -x -C /tmp/base
    python dispatch_equivalence.py /tmp/base/src src      (from the repository root; CPU)

Prints the number of points and every one that differs; exits 1 if any does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

GRID = """
import itertools, torch
GPUS = ("sm_90", "gpu", "interpreter")
ROWS = (1, 4, 8, 16, 17, 20, 64, 128, 264, 1024, 8192, 65536)
PAGES = (None, 1, 3, 4, 16, 32, 64, 128, 256)
NODES = (None, 1, 2, 16, 33, 256, 257, 1024, 4096)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEADS = ((576, 512), (96, 64), (48, 32), (24, 16))
POINTS = list(itertools.product(GPUS, ROWS, PAGES, NODES, DTYPES, HEADS))
def block_v(head):
    return max(16, 1 << (head[1] - 1).bit_length())
"""

OLD = GRID + """
from treeflash.kernels import mla_verify as mv
out = {}
for gpu, m, page, nodes, dt, head in POINTS:
    on_gpu = gpu != "interpreter"
    mv._interpreting = (lambda: False) if on_gpu else (lambda: True)
    cfg = mv.default_config(m, DTYPES[dt], on_gpu, page, nodes=nodes)
    n = nodes if nodes is not None else 1
    v5_ok = gpu == "sm_90" and dt != "fp32" and head == (576, 512) and (page is None or page % 64 == 0)
    if cfg.version == 5 and not v5_ok:  # the launcher's fallback
        cfg = mv.pick_config(m, DTYPES[dt], on_gpu, version=4 if n <= mv.V4_MAX_NODES else 3)
    kernel = 3 if cfg.version == 4 and block_v(head) < 32 else cfg.version
    combine = "hopper" if cfg.version == 5 else ("one-pass" if cfg.version >= 3 else "gathered")
    out[repr((gpu, m, page, nodes, dt, head))] = [kernel, cfg.block_m, cfg.block_n, cfg.num_warps,
        cfg.num_stages, cfg.tma, cfg.version >= 3 or cfg.v3_plan, combine]
print(json.dumps(out))
"""

NEW = GRID + """
from treeflash.kernels import mla_verify as mv
KERNEL = {"gathered": 2, "portable": 3, "portable_tree": 4, "hopper": 5}
out = {}
for gpu, m, page, nodes, dt, head in POINTS:
    cfg = mv.dispatch(m, DTYPES[dt], gpu, page, nodes, head)
    kernel = 3 if cfg.impl == "portable_tree" and block_v(head) < 32 else KERNEL[cfg.impl]
    combine = {"hopper": "hopper", "gathered": "gathered"}.get(cfg.impl, "one-pass")
    out[repr((gpu, m, page, nodes, dt, head))] = [kernel, cfg.block_m, cfg.block_n, cfg.num_warps,
        cfg.num_stages, cfg.tma, cfg.wave_plan, combine]
print(json.dumps(out))
"""


def dump(src: str, code: str, override: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src), TRITON_INTERPRET="1")
    env.pop("TREEFLASH_VERIFY_KERNEL", None)
    if override:
        env["TREEFLASH_VERIFY_KERNEL"] = override
    run = subprocess.run([sys.executable, "-c", "import json\n" + code], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(run.stdout)


def main() -> int:
    bad = 0
    for old_env, new_env in ((None, None), ("v4", "portable")):
        old, new = dump(sys.argv[1], OLD, old_env), dump(sys.argv[2], NEW, new_env)
        assert old.keys() == new.keys()
        diff = [k for k in old if old[k] != new[k]]
        for k in diff:
            print(f"DIFF {k}: {old[k]} -> {new[k]}")
        print(f"override {old_env} -> {new_env}: {len(old)} points, {len(diff)} differ")
        bad += len(diff)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
