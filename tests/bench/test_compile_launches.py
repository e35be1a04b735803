"""benchmarks/compile_launches.py: a launch is captured instead of run, and specialised as the JIT
would for sm_90 (pointer / int divisibility by 16, constexprs, launch options); two launches are
one compile exactly when their specialisations match. No GPU, no sm_90 compile here."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
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
