"""Gluon's names for Triton's CPU interpreter: the same kernel source runs compiled as Gluon on a
GPU and, with this module standing in for `triton.experimental.gluon.language`, as plain Triton
under TRITON_INTERPRET=1 (Gluon itself has no interpreter).

What the stand-in keeps: every value, index, mask, pointer, atomic and reduction of the kernel,
so CPU tests check its arithmetic and addressing. What it drops: layouts (every layout object is
None and `convert_layout` returns its input; the GPU compile checks them, `assert_trivial`
included) and inline PTX (a kernel branches on a constexpr to Triton ops with the same rounding;
the PTX text has its own test). `mma_v2` is a float32 `tl.dot` (the interpreter's 16-bit dot is
not faithful; the products of 16-bit inputs are exact in float32).

Usage in a kernel module: `gl, jit, mma_v2, constexpr_function = gluon_interp.language()`.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU tensors run under the Triton interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

constexpr = tl.constexpr
int1, int8, int16, int32, int64 = tl.int1, tl.int8, tl.int16, tl.int32, tl.int64
float16, bfloat16, float32 = tl.float16, tl.bfloat16, tl.float32
pointer_type = tl.pointer_type


def _layout(*args, **kwargs):
    """Any layout constructor: layouts do not exist here."""
    return None


BlockedLayout = SliceLayout = DistributedLinearLayout = DotOperandLayout = NVMMADistributedLayout = _layout
AutoLayout = _layout


def static_range(*args):
    return tl.static_range(*args)  # looked up at call time: the interpreter patches it


def arange(start, end, layout=None):
    return tl.arange(start, end)


def full(shape, value, dtype, layout=None):
    return tl.full(shape, value, dtype)


def zeros(shape, dtype, layout=None):
    return tl.zeros(shape, dtype)


def convert_layout(value, layout, assert_trivial=False):
    return value


def load(pointer, mask=None, other=None, cache_modifier="", eviction_policy="", volatile=False):
    return tl.load(pointer, mask=mask, other=other, cache_modifier=cache_modifier)


def store(pointer, value, mask=None, cache_modifier="", eviction_policy=""):
    tl.store(pointer, value, mask=mask)


def atomic_add(pointer, val, mask=None, sem=None, scope=None):
    return tl.atomic_add(pointer, val, mask=mask, sem=sem, scope=scope)


def atomic_xchg(pointer, val, mask=None, sem=None, scope=None):
    return tl.atomic_xchg(pointer, val, mask=mask, sem=sem, scope=scope)


def thread_barrier():
    tl.debug_barrier()


def program_id(axis):
    return tl.program_id(axis)


def num_programs(axis):
    return tl.num_programs(axis)


def where(condition, x, y):
    return tl.where(condition, x, y)


def join(a, b):
    return tl.join(a, b)


def split(a):
    return tl.split(a)


def permute(x, dims):
    return tl.permute(x, dims)


def reshape(x, shape):
    return tl.reshape(x, shape)


def expand_dims(x, axis):
    return tl.expand_dims(x, axis)


def broadcast(a, b):
    return tl.broadcast(a, b)


def sum(x, axis=None):  # noqa: A001 - Gluon's name
    return tl.sum(x, axis)


def max(x, axis=None):  # noqa: A001 - Gluon's name
    return tl.max(x, axis)


def minimum(a, b):
    return tl.minimum(a, b)


def maximum(a, b):
    return tl.maximum(a, b)


def exp(x):
    return tl.exp(x)


def mma_v2(a, b, acc, input_precision=None):
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


def _constexpr_function(fn):
    """Layout builders: nothing to build here."""
    return lambda *args, **kwargs: None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def language():
    """(gl, jit, mma_v2, constexpr_function): Gluon's on a GPU build, this module's under the
    interpreter (decided when the kernel module is imported, as the interpreter flag itself)."""
    if interpreting():
        import sys

        return sys.modules[__name__], triton.jit, mma_v2, _constexpr_function
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gluon_language
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2 as gluon_mma_v2

    return gluon_language, gluon.jit, gluon_mma_v2, gluon.constexpr_function
