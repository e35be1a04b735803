"""Do the v5 kernel's building blocks compile for a thread-block cluster under Triton 3.6's
Gluon? A no-GPU compile check for the cluster merge DESIGN_NOTES.md 1.5 prices: one
TMA load into a 128-byte-swizzled NVMMA tile on an mbarrier, one async wgmma (64 x 64 x 64), the
accumulator converted to a blocked layout and stored, compiled for sm_90 with num_ctas = 1, 2, 4,
8 and 16, every layout given log2(num_ctas) broadcast CGA bases (all 0). An mbarrier array is
1-D: its bases are [0], not [0, 0] (2-D bases on it abort the compiler in an LLVM assertion).

    TRITON_INTERPRET=0 PYTHONPATH=/tmp/tri36:src python benchmarks/lab/compile_cluster.py

(a Triton 3.6 wheel unpacked at /tmp/tri36, as compile_v5.py). Prints, a size: ok or the error,
the PTX's TMA loads, wgmma instructions, multicast copies and `.reqnctapercluster`.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _tile(a_desc, O, B1: gl.constexpr, B2: gl.constexpr):
    smem_l: gl.constexpr = gl.NVMMASharedLayout(128, 16, 2, cga_layout=B2.value)
    acc_l: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], [16, 64, 16], cga_layout=B2.value)
    a = gl.allocate_shared_memory(gl.bfloat16, [64, 64], smem_l)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout(cga_layout=B1.value))
    mbarrier.init(bar, count=1)
    fence_async_shared()
    mbarrier.expect(bar, 64 * 64 * 2)
    tma.async_copy_global_to_shared(a_desc, [gl.program_id(0) * 64, 0], bar, a)
    mbarrier.wait(bar, 0)
    acc = gl.zeros([64, 64], gl.float32, acc_l)
    acc = warpgroup_mma(a, a.permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=B2.value)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, blk))
    gl.store(O + gl.expand_dims(r, 1) * 64 + gl.expand_dims(c, 0), gl.convert_layout(acc, blk))


def main() -> None:
    for n in (1, 2, 4, 8, 16):
        log2 = n.bit_length() - 1
        layout = gl.NVMMASharedLayout(128, 16, 2, cga_layout=[[0, 0]] * log2)
        desc = f"tensordesc<bf16[64, 64],{layout!r}>"
        try:
            k = triton.compile(
                GluonASTSource(fn=_tile, signature={"a_desc": desc, "O": "*fp32", "B1": "constexpr",
                                                    "B2": "constexpr"},
                               constexprs={"B1": [[0]] * log2, "B2": [[0, 0]] * log2}),
                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": n})
        except Exception as e:  # noqa: BLE001 - a failing size is the result
            print(f"num_ctas {n:2d}: {type(e).__name__}: {str(e)[-300:]}", flush=True)
            continue
        ptx = k.asm["ptx"]
        cluster = [x.strip() for x in ptx.splitlines() if "reqnctapercluster" in x]
        print(f"num_ctas {n:2d}: ok; TMA loads {ptx.count('cp.async.bulk.tensor')}, wgmma "
              f"{ptx.count('wgmma.mma_async')}, multicast {ptx.count('multicast')}, {cluster}",
              flush=True)


if __name__ == "__main__":
    main()
