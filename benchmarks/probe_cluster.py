"""Can the v5 kernel's Gluon (Triton 3.6) reduce partials across a thread-block cluster? A
feasibility probe for the structural step KERNEL_NOTES.md "Session 14" names (partials merged
inside a cluster through distributed shared memory, no combine kernel).

Each CTA of a cluster of C (2, 4, 8 or 16; 16 is non-portable, the launcher allows it) stores its
128-float row into its own shared memory, the cluster meets at `barrier.cluster`, and every CTA
reads the row of the CTA of rank r ^ 1 (`mapa.shared::cluster` + `ld.shared::cluster`, inline
PTX on the `global_smem` symbol: Gluon 3.6 has no DSMEM API) and stores it. Triton launches
num_ctas > 1 as clusters of num_ctas CTAs along x (gridDim.x = grid x num_ctas, program_id =
%clusterid); every layout carries the CTA dimension (cga_layout bases, all 0: each CTA holds the
whole tensor), so Triton treats the tensors as the same in every CTA of a cluster and only rank 0
stores them to global memory. Expected, then: rank 0's row of Y is rank 1's row of X, and the
other ranks' rows stay untouched (NaN). H200, session 14 (results/h200-20261204-s14/
9-probe-cluster, first form): exactly that at 2, 4, 8 and 16 CTAs a cluster. For a cluster merge
of the verify kernel's partials this is the right shape: rank 0 gathers the peers' partials
through DSMEM and alone stores the merged one.

    python3 benchmarks/probe_cluster.py            # on an sm_90 GPU; prints one line a size
(each line also shows what program_id, %cluster_ctarank, %clusterid.x and num_programs read in
the first four CTAs).
"""

from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _sreg(name: gl.constexpr):
    return gl.inline_asm_elementwise("mov.u32 $0, " + name.value + ";", "=r", [], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _swap_rows(X, Y, D, BASES: gl.constexpr, CTAS: gl.constexpr):
    """Clusters of CTAS CTAs; BASES: the layouts' CGA bases (log2(CTAS) of [0])."""
    blk: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0], cga_layout=BASES.value)
    offs = gl.arange(0, 128, layout=blk)
    # 256 floats of shared memory, the kernel's only allocation (so at global_smem + 0). Gluon
    # stores the row twice into it (that keeps the allocation; its lowering may permute elements:
    # stmatrix), then, after a barrier, inline PTX stores it linearly into bytes 512 + 4 i, which
    # the peers read
    buf = gl.allocate_shared_memory(gl.float32, [256],
                                    gl.SwizzledSharedLayout(1, 1, 1, [0], cga_layout=BASES.value))
    offs2 = gl.arange(0, 256, layout=blk)
    rank = _sreg("%cluster_ctarank")
    cta = _sreg("%ctaid.x")  # this CTA's row: its index in the grid
    # what Triton's program_id and the cluster registers say, for the record
    gl.store(D + cta * 4 + offs // 32, gl.where(offs % 32 == 0, gl.where(
        offs < 32, gl.program_id(0), gl.where(offs < 64, rank, gl.where(offs < 96, _sreg("%clusterid.x"),
                                                                          gl.num_programs(0)))), 0),
             mask=offs % 32 == 0)
    row = gl.load(X + cta * 128 + offs)
    buf.store(gl.load(X + cta * 128 + offs2 % 128))
    gl.thread_barrier()
    gl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, global_smem; mad.lo.u32 a, $1, 4, a; st.shared.f32 [a+512], $2; }"
        " // $0", "=r,r,f", [offs, row], dtype=gl.int32, is_pure=False, pack=1)
    _cluster_sync()
    peer = gl.inline_asm_elementwise(
        "{ .reg .u32 a, p, r; mov.u32 a, global_smem; mad.lo.u32 a, $1, 4, a; add.u32 a, a, 512; "
        "xor.b32 r, $2, 1; mapa.shared::cluster.u32 p, a, r; ld.shared::cluster.f32 $0, [p]; }",
        "=f,r,r", [offs, rank], dtype=gl.float32, is_pure=False, pack=1)
    _cluster_sync()  # no CTA leaves while a peer may still read its shared memory
    gl.store(Y + cta * 128 + offs, peer)


@gluon.jit
def _cluster_sync():
    gl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned; "
                              "barrier.cluster.wait.acquire.aligned; // $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


def main() -> int:
    ok = True
    for log2 in (1, 2, 3, 4):
        c = 1 << log2
        clusters = 132 // c
        x = torch.randn(clusters * c, 128, device="cuda")
        y = torch.full_like(x, float("nan"))
        d = torch.full((clusters * c, 4), -1, dtype=torch.int32, device="cuda")
        try:
            _swap_rows[(clusters,)](x, y, d, ((0,),) * log2, c, num_warps=4, num_ctas=c)
            torch.cuda.synchronize()
            rank0 = torch.arange(len(x), device="cuda") % c == 0
            swapped = x.view(clusters, c // 2, 2, 128).flip(2).reshape_as(x)
            good = bool(torch.equal(y[rank0], swapped[rank0]) and y[~rank0].isnan().all())
            print(f"cluster {c:2d} x {clusters:3d}: {'ok' if good else 'WRONG'}; rank-0 rows = the "
                  f"peer's row: {int((y == swapped).all(1)[rank0].sum())}/{int(rank0.sum())}, other "
                  f"rows untouched: {int(y[~rank0].isnan().all(1).sum())}/{int((~rank0).sum())}; "
                  f"[program_id, rank, clusterid, num_programs] of CTAs 0-3: {d[:4].tolist()}",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - a failing size is the result
            good = False
            print(f"cluster {c:2d}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
