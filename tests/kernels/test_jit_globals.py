"""Every Triton kernel reads only globals a compiled kernel may read: modules, other kernels and
`tl.constexpr` values. Triton's interpreter (CI's CPU) reads any Python global, so a plain float
used inside a kernel passes every CPU test and fails to compile on the GPU (kv_ops.py's E4M3_MAX,
found by the H100 run of 2026-12-07)."""
from __future__ import annotations

import importlib
import pkgutil
import types

import triton.language as tl
from triton.runtime.jit import KernelInterface

import treeflash.kernels


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def _kernels():
    for info in pkgutil.walk_packages(treeflash.kernels.__path__, "treeflash.kernels."):
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if isinstance(obj, KernelInterface) and obj.fn.__module__ == mod.__name__:
                yield f"{mod.__name__}.{name}", obj.fn


def _allowed(value) -> bool:
    return isinstance(value, (types.ModuleType, KernelInterface, tl.constexpr)) or callable(value)


def test_the_kernels_are_found():
    found = dict(_kernels())
    assert "treeflash.kernels.kv_ops._quantize_row" in found
    assert len(found) > 30


def test_no_kernel_reads_a_plain_python_global():
    bad = [f"{where}: {name} ({type(fn.__globals__[name]).__name__})"
           for where, fn in _kernels()
           for name in sorted(_names(fn.__code__))
           if name in fn.__globals__ and not _allowed(fn.__globals__[name])]
    assert not bad, "globals a compiled kernel cannot read (make them tl.constexpr): " + "; ".join(bad)


def test_the_check_catches_a_float_global():
    def kernel(x):
        return x * LIMIT  # noqa: F821
    fn = types.FunctionType(kernel.__code__, {"LIMIT": 448.0})
    assert not _allowed(fn.__globals__["LIMIT"]) and "LIMIT" in _names(fn.__code__)
