"""`bench kernel --check` and the verify kernel's variants: each implementation of the dispatch
table forced by name (`VARIANTS`, which `--compare` times side by side), and the GPU checks of
every case the table runs against a float64 reference (`CHECK_CASES`)."""

from __future__ import annotations

from dataclasses import replace

import torch


def _tile(impl: str, m_rows: int):
    from treeflash.kernels.mla_verify import tile

    return tile(impl, m_rows, torch.bfloat16, "sm_90")


# name -> m_rows -> kwargs of mla_verify_attention_triton: the dispatch table's choice ("auto")
# and each implementation forced (`kernels/mla_verify/__init__.py`, TABLE and TILES; a Hopper
# config a call does not suit runs the table without the Hopper row).
VARIANTS = {
    "auto": lambda m: {},
    "hopper": lambda m: {"config": _tile("hopper", m)},
    "hopper-direct": lambda m: {"config": _tile("hopper", m), "num_splits": 1},  # one split: no combine
    "portable_tree": lambda m: {"config": _tile("portable_tree", m)},
    "portable": lambda m: {"config": _tile("portable", m)},
    "gathered": lambda m: {"config": _tile("gathered", m)},
}


HOPPER_CASES = [  # check_gpu's Hopper cases (lens, n, h, d, v, page, layout, tree, dtype, variant)
    # the DDTree shapes (8 x 32; 8 x 33 bushy: a ragged last M tile, whose rows past M must not
    # be stored: they are the next split's partial rows), 64 x 16 chain with batch 2, 128 x 1,
    # 8 x 1, batches with prefixes 0 / not a multiple of 64 / a multiple of 64 on shuffled
    # page-64 and page-128 tables, 17 x 128 chain, batch 3 with 8 x 33 rows (the Q TMA box of the
    # last M tile reads past the tensor: zeros), fp16, the direct path (one split), a q that is
    # not one TMA row block (Q through registers)
    ([70001], 32, 8, 576, 512, 64, "contiguous", "bushy", torch.bfloat16, "hopper"),
    ([70001], 33, 8, 576, 512, 64, "contiguous", "bushy", torch.bfloat16, "hopper"),
    ([20000, 9000], 16, 64, 576, 512, 64, "contiguous", "chain", torch.bfloat16, "hopper"),
    ([33003], 1, 128, 576, 512, 64, "contiguous", "chain", torch.bfloat16, "hopper"),
    ([12000, 3001], 1, 8, 576, 512, 64, "scattered", "chain", torch.bfloat16, "hopper"),
    ([5000, 301, 0], 17, 128, 576, 512, 64, "scattered", "chain", torch.bfloat16, "hopper"),
    ([4096, 0, 4033], 33, 8, 576, 512, 128, "scattered", "bushy", torch.bfloat16, "hopper"),
    ([2000, 64, 7000], 33, 8, 576, 512, 64, "scattered", "bushy", torch.bfloat16, "hopper"),
    ([1000, 4097], 16, 16, 576, 512, 64, "scattered", "bushy", torch.float16, "hopper"),
    ([9000, 130], 16, 16, 576, 512, 64, "scattered", "bushy", torch.bfloat16, "hopper-direct"),
    ([3001], 63, 1, 576, 512, 64, "contiguous", "chain", torch.bfloat16, "hopper-direct"),
    ([6000, 131], 16, 16, 576, 512, 64, "scattered", "bushy", torch.bfloat16, "hopper-qstrided"),
    # prefill chunks (causal, 16 masked 64-key tiles per M tile)
    ([8000], 1024, 8, 576, 512, 64, "contiguous", "chain", torch.bfloat16, "hopper"),
    ([3000, 77], 300, 16, 576, 512, 64, "contiguous", "chain", torch.bfloat16, "hopper"),
    # calls the Hopper kernel does not suit (page 16, page 1, fp32) run the table without it
    ([33003], 64, 8, 576, 512, 16, "contiguous", "bushy", torch.bfloat16, "hopper"),
    ([1000, 4097], 16, 16, 576, 512, 1, "scattered", "bushy", torch.bfloat16, "hopper"),
    ([3000, 77], 5, 4, 576, 512, 64, "scattered", "bushy", torch.float32, "hopper"),
]


CHECK_CASES = [  # check_gpu's cases: lens, n, h, d, v, page, layout, tree, dtype, num_splits or variant
    ([1000, 4097], 16, 16, 576, 512, 1, "scattered", "bushy", torch.bfloat16, None),
    ([70001], 1, 64, 576, 512, 64, "contiguous", "chain", torch.bfloat16, None),
    ([33003], 64, 8, 576, 512, 16, "contiguous", "bushy", torch.bfloat16, None),
    ([5000, 301, 0], 17, 128, 576, 512, 64, "scattered", "chain", torch.bfloat16, None),
    ([8000], 1024, 8, 576, 512, 64, "contiguous", "chain", torch.bfloat16, None),
    ([777], 3, 3, 576, 512, 1, "scattered", "bushy", torch.float16, None),
    ([3000, 77], 5, 4, 576, 512, 1, "scattered", "bushy", torch.float32, None),
    ([2049], 17, 4, 48, 32, 3, "scattered", "bushy", torch.bfloat16, None),
    ([20000, 9000], 16, 16, 576, 512, 64, "scattered", "bushy", torch.bfloat16, 1),
    ([20000, 9000], 16, 16, 576, 512, 64, "scattered", "bushy", torch.bfloat16, 300),
    # the portable kernel: pointer and TMA tiles, gathered tiles, the direct path
    ([70001], 1, 64, 576, 512, 64, "contiguous", "chain", torch.bfloat16, "portable"),
    ([12000, 3001], 1, 8, 576, 512, 64, "contiguous", "chain", torch.bfloat16, "portable"),
    ([12000, 3001], 1, 8, 576, 512, 64, "scattered", "chain", torch.bfloat16, "portable"),
    ([5000, 301, 0], 17, 128, 576, 512, 64, "scattered", "chain", torch.bfloat16, "portable"),
    ([33003], 64, 8, 576, 512, 16, "contiguous", "bushy", torch.bfloat16, "portable"),
    ([1000, 4097], 16, 16, 576, 512, 1, "scattered", "bushy", torch.bfloat16, "portable"),
    ([8000], 1024, 8, 576, 512, 64, "contiguous", "chain", torch.bfloat16, "portable"),
    ([2049], 17, 4, 48, 32, 64, "scattered", "bushy", torch.bfloat16, "portable"),
    ([20000, 9000], 16, 16, 576, 512, 64, "contiguous", "bushy", torch.bfloat16, "portable-ptr"),
    # the portable tree kernel (S once, two value halves): TMA tiles on shuffled page-64
    # tables with a zero prefix, page 16 and page 1 (gathered rows), the DDTree verify shape
    # (8 heads x 33 nodes), D = 48, the direct prefill path, pointer tiles
    ([5000, 301, 0], 17, 128, 576, 512, 64, "scattered", "chain", torch.bfloat16, "portable_tree"),
    ([70001], 33, 8, 576, 512, 64, "contiguous", "bushy", torch.bfloat16, "portable_tree"),
    ([33003], 64, 8, 576, 512, 16, "contiguous", "bushy", torch.bfloat16, "portable_tree"),
    ([1000, 4097], 16, 16, 576, 512, 1, "scattered", "bushy", torch.bfloat16, "portable_tree"),
    ([2049], 17, 4, 48, 32, 64, "scattered", "bushy", torch.bfloat16, "portable_tree"),
    ([8000], 1024, 8, 576, 512, 64, "contiguous", "chain", torch.bfloat16, "portable_tree"),
    ([20000, 9000], 33, 8, 576, 512, 64, "scattered", "bushy", torch.bfloat16, "portable_tree-ptr"),
    ([777], 3, 7, 576, 512, 1, "scattered", "bushy", torch.float16, "portable_tree"),
    *HOPPER_CASES,
]


def check_gpu(args) -> list[dict]:
    """Triton vs a float64 reference on the GPU, NaN-poisoned pages, out-of-range padding
    (`CHECK_CASES`, `--check-only` a comma list of case prefixes), a chain of dependent calls
    under a CUDA graph, and the KV write / commit against their torch twins."""
    only = tuple(args.check_only.split(",")) if args.check_only else ()
    results = [_check_case(i, *case) for i, case in enumerate(CHECK_CASES)
               if not only or str(case[-1]).startswith(only)]
    if not only or any("hopper".startswith(c) for c in only):
        results += _check_chain()
    return results + [_check_kv_ops()]


def _check_case(i: int, lens, n, h, d, v, ps, layout, tree, dtype, ns) -> dict:
    """One case of `CHECK_CASES`. Its last field: None or an int (the default path, that many
    splits), or a VARIANTS name, "-qstrided" added for q as a [B, H, N, D] transpose (not one
    TMA row block), "-ptr" for the tile without TMA (its pointer fallback)."""
    from treeflash.kernels import reference
    from treeflash.kernels.mla_verify import mla_verify_attention_triton
    from treeflash.kernels.testing import LSE_TOLERANCES, TOLERANCES, random_paged_kv, random_tree_masks, relative_error

    g = torch.Generator().manual_seed(100 + i)
    kv = random_paged_kv([x + n for x in lens], d, ps, dtype, layout, "cuda", g)
    q = torch.randn(len(lens), n, h, d, generator=g).to("cuda", dtype)
    if str(ns).endswith("-qstrided"):  # same values, [B, H, N, D]: not one TMA row block
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    mask = None if tree == "chain" else random_tree_masks(len(lens), n, g).cuda()
    prefix = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if isinstance(ns, str):
        kw = VARIANTS[ns.removesuffix("-qstrided").removesuffix("-ptr")](n * h)
        if ns.endswith("-ptr"):
            kw["config"] = replace(kw["config"], tma=False)
    else:
        kw = {"num_splits": ns}
    out, lse = mla_verify_attention_triton(q, kv.kv_cache, kv.page_table, prefix, mask,
                                           d ** -0.5, v, **kw)
    ref, ref_lse = reference.mla_verify_attention(q.double(), kv.kv_cache.double(),
                                                  kv.page_table, prefix, mask, d ** -0.5, v)
    err, lerr = relative_error(out, ref), relative_error(lse, ref_lse)
    ok = bool(torch.isfinite(out).all()) and err <= TOLERANCES[dtype] and \
        lerr <= LSE_TOLERANCES[dtype]
    result = {"case": f"lens={lens} N={n} H={h} D={d} v={v} page={ps} {layout} {tree} "
                      f"{str(dtype)[6:]} splits={ns}", "err": err, "lse_err": lerr, "ok": ok}
    print(f"check {'ok ' if ok else 'BAD'} err={err:.2e} lse={lerr:.2e} {result['case']}", flush=True)
    return result


def _check_kv_ops() -> dict:
    """kv_write / kv_commit on the GPU against the torch twins: the same bits."""
    from treeflash.kernels import kv_commit, kv_write, reference
    from treeflash.kernels.testing import random_paged_kv

    g = torch.Generator().manual_seed(7)
    kvp = random_paged_kv([40, 90], 576, 1, torch.bfloat16, "scattered", "cuda", g)
    pool = torch.stack([kvp.kv_cache, kvp.kv_cache.roll(1, -1)])
    lat = torch.randn(2, 9, 576, generator=g).to("cuda", torch.bfloat16)
    start = torch.tensor([30, 80], dtype=torch.int32, device="cuda")
    a, b = pool.clone(), pool.clone()
    kv_write(a[0], kvp.page_table, start, lat, impl="triton")
    reference.kv_write(b[0], kvp.page_table, start, lat)
    acc = torch.tensor([[0, 2, 3, 7], [0, 1, 5, 8]], device="cuda")
    num = torch.tensor([4, 3], device="cuda")
    kv_commit(a, kvp.page_table, start, acc, num, impl="triton")
    reference.kv_commit(b, kvp.page_table, start, acc, num)
    same = bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
    print(f"check {'ok ' if same else 'BAD'} kv_write + kv_commit", flush=True)
    return {"case": "kv_write + kv_commit (2 layers, page 1 scattered, bf16)", "ok": same}


def _check_chain(variant: str = "hopper") -> list[dict]:
    """A chain of dependent calls of `variant`, run eagerly and as a CUDA graph: the outputs must
    be bitwise equal. Per step, q is rewritten by an elementwise kernel from the previous output
    right before the split kernel reads it, then two calls run back to back on two caches: the
    second call's split kernel reuses the first call's freed partial buffers, which the first
    combine must have finished reading."""
    from treeflash.kernels.mla_verify import mla_verify_attention_triton
    from treeflash.kernels.testing import random_paged_kv, random_tree_masks

    g = torch.Generator().manual_seed(4242)
    lens, n, h = [30001, 7000], 32, 8
    kv = random_paged_kv([x + n for x in lens], 576, 64, torch.bfloat16, "scattered", "cuda", g)
    kv2 = kv.kv_cache.roll(1, -1)  # a second "layer" (NaN rows stay NaN rows)
    q0 = torch.randn(len(lens), n, h, 576, generator=g).to("cuda", torch.bfloat16)
    mask = random_tree_masks(len(lens), n, g).cuda()
    prefix = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cfg = VARIANTS[variant](n * h)["config"]

    def chain():
        q, outs = q0.clone(), []
        for _ in range(4):
            a = mla_verify_attention_triton(q, kv.kv_cache, kv.page_table, prefix, mask, 576 ** -0.5,
                                            512, config=cfg)[0]
            b = mla_verify_attention_triton(q, kv2, kv.page_table, prefix, mask, 576 ** -0.5, 512,
                                            config=cfg)[0]
            outs += [a, b]
            q = q0.clone()
            q[..., :512] += 0.5 * (a - b)  # written right before the next split kernel reads it
        return torch.stack(outs)

    results = []
    ref = chain()
    torch.cuda.synchronize()
    ok = bool(torch.isfinite(ref).all())
    results.append({"case": f"{variant} chain: 8 dependent calls eager, finite", "ok": ok})
    print(f"check {'ok ' if ok else 'BAD'} {variant} chain eager (finite)", flush=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = chain()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        ok = torch.equal(ref, static)
        results.append({"case": f"{variant} chain: CUDA graph vs eager (bitwise)", "ok": ok})
        print(f"check {'ok ' if ok else 'BAD'} {variant} chain in a CUDA graph (bitwise vs eager)",
              flush=True)
        del graph
    except Exception as e:  # noqa: BLE001 - a rejected capture is reported as a failure
        msg = f"{type(e).__name__}: {str(e)[:200]}"
        results.append({"case": f"{variant} chain: CUDA graph", "ok": False, "note": msg})
        print(f"check BAD {variant} chain in a CUDA graph: capture failed ({msg})", flush=True)
    return results
