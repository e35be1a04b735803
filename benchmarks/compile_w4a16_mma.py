"""Compile the Gluon MMA W4A16 kernels (`kernels/moe_w4a16/mma.py`) for sm_90 ahead of time, on a
machine without a GPU, exactly as a call launches them: the call runs on CPU tensors at Kimi K2 TP8
strides (16 local experts: the per-expert strides do not change) with both launches captured
instead of run, and each captured launch (its arguments' types, 16-divisibility as the JIT
specialises them, constexprs, warps) is compiled with `triton.compile`. Reports registers, stack
(spills) and shared memory a launch, or the compile error.

    TRITON_INTERPRET=0 PYTHONPATH=<triton 3.6 site>:src python benchmarks/compile_w4a16_mma.py [--rows 1,16,128,1024]

Run it under the GPU's Triton (3.6 on the H100 / H200 image: its Gluon differs between versions).
Exit 1 when a launch does not compile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess as sp
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from treeflash.kernels.int4 import Int4Weight  # noqa: E402
from treeflash.kernels.moe_w4a16 import mma  # noqa: E402

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64"}


class _Capture:
    """Stands in for a kernel: `kernel[grid](*args, **kw)` records the launch instead of running it."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((self.fn, grid, args, kw))


def _case(rows: int, experts: int = 16, top_k: int = 8, hid: int = 7168, inter: int = 256, group: int = 32):
    g = torch.Generator().manual_seed(rows)

    def w(n, k):
        return Int4Weight(torch.zeros(experts, n, k // 8, dtype=torch.int32),
                          torch.ones(experts, n, k // group, dtype=torch.bfloat16), group)

    x = torch.randn(rows, hid, generator=g).to(torch.bfloat16)
    ids = torch.rand(rows, experts, generator=g).topk(top_k, dim=-1).indices
    shared = (torch.zeros(inter, hid, dtype=torch.bfloat16), torch.zeros(inter, hid, dtype=torch.bfloat16),
              torch.zeros(hid, inter, dtype=torch.bfloat16))
    return x, torch.rand(rows, top_k, generator=g), ids, w(inter, hid), w(inter, hid), w(hid, inter), shared


def capture(rows: int, sms: int = 132) -> tuple[list, mma.MmaPlan]:
    """The launches of one call at `rows` rows with the dispatch's tiles and split (on `sms` SMs)."""
    x, wts, ids, wg, wu, wd, shared = _case(rows)
    launches: list = []
    saved = mma._gate_up_kernel, mma._down_kernel, mma._num_sms
    mma._gate_up_kernel, mma._down_kernel = _Capture(saved[0], launches), _Capture(saved[1], launches)
    mma._num_sms = lambda index: sms
    try:
        e, inter, hid = wg.shape
        plan = mma.plan(rows, ids.shape[1], 384, inter, hid, 1, torch.device("cuda"))
        mma.moe_experts_mma(x, wts, ids, wg, wu, wd, 0, None, shared, None, 1, plan)
    finally:
        mma._gate_up_kernel, mma._down_kernel, mma._num_sms = saved
    return launches, plan


def compile_launch(fn, args: tuple, kw: dict):
    """triton.compile of one captured launch, specialised as the JIT does (pointers and ints
    divisible by 16 marked so, constexprs by the kernel's parameters)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    kw = dict(kw)
    options = {"num_warps": kw.pop("num_warps", 4)}
    names = list(fn.arg_names)
    values = dict(zip(names, args)) | kw
    sig, cx, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = values[p.name]
        if p.is_constexpr:
            sig[p.name], cx[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = "i32" if -2**31 <= int(v) < 2**31 else "i64"
            if int(v) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def usage(k) -> dict:
    """Registers and stack from the cubin (cuobjdump of Triton's bundled CUDA tools), shared memory."""
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = sp.run([str(bindir / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    reg = re.search(r"REG:(\d+) STACK:(\d+)", res)
    return {"registers": int(reg.group(1)) if reg else None, "stack": int(reg.group(2)) if reg else None,
            "shared": k.metadata.shared}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16,128,1024", help="row counts (each its dispatch row's tiles and split)")
    p.add_argument("--out", default="", help="JSON path for the results")
    args = p.parse_args(argv)
    rows_out, failed = [], 0
    for rows in (int(r) for r in args.rows.split(",")):
        launches, plan = capture(rows)
        for fn, grid, a, kw in launches:
            tag = f"rows {rows:5d} {fn.__name__:16s} tiles {plan.tiles.spec()} grid {tuple(grid)}"
            rec = {"rows": rows, "kernel": fn.__name__, "tiles": plan.tiles.spec()}
            try:
                rec.update(usage(compile_launch(fn, a, kw)))
            except Exception as exc:  # noqa: BLE001 - a launch that does not compile is the result
                failed += 1
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:3000]}"
            rows_out.append(rec)
            print(f"{tag}: " + (f"FAILED {rec['error'][:400]}" if "error" in rec else
                                f"ok, {rec['registers']} registers, stack {rec['stack']}, shared {rec['shared']}"),
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"triton": triton.__version__, "launches": rows_out}, indent=1))
    print(f"triton {triton.__version__}: {len(rows_out) - failed} of {len(rows_out)} launches compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
