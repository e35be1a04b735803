"""benchmarks/compile_launches.py: a launch is captured instead of run, and specialised as the JIT
would for sm_90 (pointer / int divisibility by 16, constexprs, launch options); two launches are
one compile exactly when their specialisations match. No GPU; the one sm_90 compile here (the fp8
KV writes, a subprocess with the installed Triton) is marked slow."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _tool():
    if "compile_launches" not in sys.modules:
        spec = importlib.util.spec_from_file_location("compile_launches", BENCH / "compile_launches.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["compile_launches"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["compile_launches"]


def _copy(X, Y, n, m, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < m)


KERNEL = JITFunction(_copy)  # compiled-kernel object whatever TRITON_INTERPRET says


def _launches(*calls):
    """Launch KERNEL once per (x, y, n, m, kwargs) under the capture."""
    cl = _tool()
    with cl.capture(package=_copy.__module__) as got:
        for x, y, n, m, kw in calls:
            KERNEL[(1,)](x, y, n, m, BLOCK=128, **kw)
    return got.launches


def test_a_launch_is_captured_not_run():
    x, y = torch.ones(128), torch.zeros(128)
    (launch,) = _launches((x, y, 100, 64, {"num_warps": 2}))
    assert torch.equal(y, torch.zeros(128)), "a captured launch must not run"
    assert launch.kernel is KERNEL and launch.grid == (1,) and launch.kwargs == {"BLOCK": 128, "num_warps": 2}
    assert launch.name.endswith("._copy")


def test_specialised_as_the_jit_for_sm90():
    cl = _tool()
    buf = torch.zeros(256)
    (launch,) = _launches((buf[:128], buf[1:129], 100, 64, {"num_warps": 2, "num_stages": 3}))
    src, options = cl.specialise(launch)
    assert src.signature == {"X": "*fp32", "Y": "*fp32", "n": "i32", "m": "i32", "BLOCK": "constexpr"}
    index = {name: (i,) for i, name in enumerate(KERNEL.arg_names)}
    div16 = [["tt.divisibility", 16]]
    assert src.attrs[index["X"]] == div16  # 16-byte aligned base
    assert src.attrs[index["Y"]] == []  # one float past it: 4-byte aligned
    assert src.attrs[index["n"]] == [] and src.attrs[index["m"]] == div16  # 100, 64
    assert src.constants[index["BLOCK"]] == 128
    assert (options.num_warps, options.num_stages, options.arch) == (2, 3, "sm90")


def test_one_compile_per_specialisation():
    cl = _tool()
    x, y = torch.ones(128), torch.zeros(128)
    launches = _launches((x, y, 100, 64, {}), (x, y, 36, 128, {}), (x, y, 96, 64, {}),
                         (x, y, 100, 64, {"num_warps": 8}))
    groups = cl.distinct(launches)
    # 100 and 36 are both not 16-divisible (one compile); 96 is; a warp count is its own compile
    assert sorted(len(g) for g in groups.values()) == [1, 1, 2]


def test_a_module_outside_the_package_is_not_captured():
    cl = _tool()
    x, y = torch.ones(128), torch.zeros(128)
    seen = []
    real = JITFunction.run
    try:
        JITFunction.run = lambda self, *a, grid, warmup, **kw: seen.append(grid)
        with cl.capture(package="treeflash.kernels") as got:
            KERNEL[(3,)](x, y, 100, 64, BLOCK=128)
    finally:
        JITFunction.run = real
    assert got.launches == [] and seen == [(3,)]
    assert JITFunction.run is real


_FP8_WRITES = """
import json, sys
sys.path[:0] = [{bench!r}]
import torch
import compile_cases as cc
import compile_launches as cl
from treeflash.kernels.kv_ops import kv_write_triton
from treeflash.kernels.mla_prep import mla_latent_prep_triton

s, b, n = cc.K2, 2, 16
pt, start = cc._table(b)
cs = torch.zeros(b, n, (s["d"] - s["v"]) // 2, dtype=torch.bfloat16)
with cl.capture() as got:
    kv_write_triton(cc._cache(s, True), pt, start, torch.zeros(b, n, s["d"], dtype=torch.bfloat16), s["v"])
    mla_latent_prep_triton(torch.zeros(b, n, s["d"], dtype=torch.bfloat16), cc._cache(s, True), pt, start,
                           torch.ones(s["v"], dtype=torch.bfloat16), 1e-6, cs, cs, True)
print(json.dumps([dict(kernel=ln.name, **cl.compile_launch(ln)) for ln in got.launches]))
"""


@pytest.mark.slow
def test_the_fp8_kv_writes_compile_for_sm90(tmp_path):
    """The fp8_e4m3 cache's two row writers (`kv_ops`, `mla_prep`) at Kimi K2 TP8 shapes compile
    for sm_90 with the installed Triton (no GPU needed: its bundled ptxas), in a process of
    compiled kernels (TRITON_INTERPRET=0): a plain float global read in a kernel fails here as it
    did on the H100 (c9e54e6)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"this Triton has no bundled ptxas ({ptxas}): it cannot compile for sm_90")
    root = BENCH.parent
    path = os.pathsep.join([str(root / "src"), str(BENCH)])
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=path)
    res = subprocess.run([sys.executable, "-c", _FP8_WRITES.format(bench=str(BENCH))], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert [g["kernel"].rsplit(".", 1)[1] for g in got] == ["_kv_write_fp8_kernel", "_mla_prep_kernel"]
    for g in got:
        assert "error" not in g, f"{g['kernel']} does not compile for sm_90:\n{g['error']}"
        assert g["registers"] > 0
