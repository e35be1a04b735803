"""Can the v5 kernel's Gluon (Triton 3.6) reduce partials across a thread-block cluster? A
feasibility probe for the structural step DESIGN_NOTES.md 1.5 names (partials merged
inside a cluster through distributed shared memory, no combine kernel).

Each CTA of a cluster of C (2, 4, 8 or 16; 16 is non-portable, the launcher allows it) stores its
128-float row into its own shared memory, the cluster meets at `barrier.cluster`, and every CTA
reads the row of the CTA of rank r ^ 1 (`mapa.shared::cluster` + `ld.shared::cluster`, inline
PTX on the `global_smem` symbol: Gluon 3.6 has no DSMEM API) and stores it. Triton launches
num_ctas > 1 as clusters of num_ctas CTAs along x (gridDim.x = grid x num_ctas, program_id =
%clusterid); every layout carries the CTA dimension (cga_layout bases, all 0: each CTA holds the
whole tensor), so Triton treats the tensors as the same in every CTA of a cluster and only rank 0
stores them to global memory. Expected, then: rank 0's row of Y is rank 1's row of X, and the
other ranks' rows stay untouched (NaN). H200, 2026-12-04 (results/h200-20261204-probe-cluster,
first form): exactly that at 2, 4, 8 and 16 CTAs a cluster. For a cluster merge
of the verify kernel's partials this is the right shape: rank 0 gathers the peers' partials
through DSMEM and alone stores the merged one.

Then the merge in miniature (`_gather_sums`): every CTA of a cluster loads its own 64 x 64 tile by
TMA, sums its rows, and rank 0 adds up the peers' sums through DSMEM and stores them.

    python3 benchmarks/lab/probe_cluster.py            # on an sm_90 GPU; prints one line a size
(each line also shows what program_id, %cluster_ctarank, %clusterid.x and num_programs read in
the first four CTAs).
"""

from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.constexpr_function
def _bases(t):
    """CGA bases passed as a tuple of tuples (launch-cache keys must hash) as the lists Gluon's
    layouts normalise to: a layout built from tuples differs from the same one that gl.sum or a
    slice rebuilds from lists ("Layout mismatch in broadcast": the gather's failure on the H100 on 2026-12-05)."""
    return [list(b) for b in getattr(t, "value", t)]


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


@gluon.jit
def _gather_sums(a_desc, Y, B1: gl.constexpr, B2: gl.constexpr, CTAS: gl.constexpr):
    """The cluster merge in miniature: CTA g (its index in the grid) loads rows 64 g .. 64 g + 63
    of A (64 columns) by TMA, sums each row, and leaves the 64 sums in its shared memory; after a
    cluster barrier rank 0 adds up its peers' sums through DSMEM and stores them: Y[cluster] =
    the row sums of the cluster's CTAS tiles, added. The sums are exchanged through the tile's
    first 256 bytes (global_smem + 0: the 1024-byte-aligned tile is the first allocation, the
    barrier follows it), written only after every thread has read the tile."""
    a = gl.allocate_shared_memory(gl.bfloat16, [64, 64],
                                  gl.NVMMASharedLayout(128, 16, 2, cga_layout=_bases(B2).value))
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout(cga_layout=_bases(B1).value))
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=_bases(B2).value)
    row_l: gl.constexpr = gl.SliceLayout(1, blk)
    r = gl.arange(0, 64, layout=row_l)
    mbarrier.init(bar, count=1)
    fence_async_shared()
    g = _sreg("%ctaid.x")
    rank = _sreg("%cluster_ctarank")
    mbarrier.expect(bar, 64 * 64 * 2)
    tma.async_copy_global_to_shared(a_desc, [g * 64, 0], bar, a)
    mbarrier.wait(bar, 0)
    sums = gl.sum(a.load(blk).to(gl.float32), 1)  # [64], row_l
    gl.thread_barrier()
    gl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, global_smem; mad.lo.u32 a, $1, 4, a; st.shared.f32 [a], $2; }"
        " // $0", "=r,r,f", [r, sums], dtype=gl.int32, is_pure=False, pack=1)
    _cluster_sync()
    total = gl.zeros([64], gl.float32, row_l)
    for peer in gl.static_range(CTAS):
        total += gl.inline_asm_elementwise(
            "{ .reg .u32 a, p; mov.u32 a, global_smem; mad.lo.u32 a, $1, 4, a; "
            "mapa.shared::cluster.u32 p, a, $2; ld.shared::cluster.f32 $0, [p]; }",
            "=f,r,r", [r, gl.full([64], peer, gl.int32, row_l)], dtype=gl.float32, is_pure=False,
            pack=1)
    _cluster_sync()
    gl.store(Y + gl.program_id(0) * 64 + r, total + 0.0 * rank.to(gl.float32))


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
    for log2 in (1, 2, 3, 4):  # the merge in miniature: per-CTA TMA tiles, sums gathered by rank 0
        c = 1 << log2
        clusters = 132 // c
        a = torch.randn(clusters * c * 64, 64, device="cuda").to(torch.bfloat16)
        y = torch.full((clusters, 64), float("nan"), device="cuda")
        try:
            lay = gl.NVMMASharedLayout(128, 16, 2, cga_layout=[[0, 0]] * log2)
            desc = TensorDescriptor(a, list(a.shape), [64, 1], [64, 64], lay)
            # constexpr arguments key the launch cache: tuples (lists are unhashable there)
            _gather_sums[(clusters,)](desc, y, ((0,),) * log2, ((0, 0),) * log2, c, num_warps=4,
                                      num_ctas=c)
            torch.cuda.synchronize()
            want = a.float().view(clusters, c, 64, 64).sum(3).sum(1)
            err = float(((y - want).abs().max() / want.abs().max()).item())
            good = err < 1e-4
            print(f"gather cluster {c:2d} x {clusters:3d}: {'ok' if good else 'WRONG'}; max rel "
                  f"err {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a failing size is the result
            good = False
            # the cause of a CompilationError is at its end (its head alone did not name it)
            print(f"gather cluster {c:2d}: {type(e).__name__}: {str(e)[-1200:]}", flush=True)
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
