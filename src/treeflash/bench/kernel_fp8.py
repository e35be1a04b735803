"""`treeflash bench kernel --kv-dtype fp8`: the verify kernels over fp8_e4m3 rows (`kvcache.format`).

What the kernel bench needs beyond its 16-bit self: the bytes a cached token takes (the floor),
layer caches of fp8 rows, the GPU correctness pass over fp8 rows (every implementation against
a float64 reference on the decoded cache, a CUDA-graph chain of the Hopper fp8 kernel, the
quantising writes against their torch twins, bitwise), and the table of fp8 against bf16 for
the shapes both ran.
"""

from __future__ import annotations

import torch

from treeflash.kvcache.format import fp8_row_bytes

D_LATENT, V_DIM = 576, 512
KV_DTYPES = ("bf16", "fp8")


def kv_dtypes(text: str) -> list[str]:
    """'bf16', 'fp8' or 'bf16,fp8' (fp8_e4m3 and auto accepted as their names)."""
    names = {"bf16": "bf16", "bfloat16": "bf16", "auto": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8"}
    out = []
    for tok in text.split(","):
        name = names.get(tok.strip().lower())
        if name is None:
            raise ValueError(f"--kv-dtype {tok!r}: expected bf16, fp8 or a comma list of both")
        out.append(name)
    return list(dict.fromkeys(out))


def row_bytes(kv_dtype: str) -> int:
    """Bytes one token's latent row takes in one layer: 1152 (bf16) or 656 (fp8_e4m3)."""
    return fp8_row_bytes(D_LATENT, V_DIM) if kv_dtype == "fp8" else 2 * D_LATENT


def cache_dtype(kv_dtype: str) -> torch.dtype:
    """The cache tensor's dtype the dispatch table keys on (uint8: fp8 rows)."""
    return torch.uint8 if kv_dtype == "fp8" else torch.bfloat16


def fill_fp8(kv: torch.Tensor, generator: torch.Generator, chunk_rows: int = 1 << 18) -> None:
    """kv [layers, pages, page_size, 656] uint8 <- fp8 rows of unit-normal latents (quantised
    on the device, a chunk of rows at a time)."""
    from treeflash.kvcache.format import quantize_rows

    flat = kv.view(kv.shape[0], -1, kv.shape[-1])
    for layer in flat:
        for a in range(0, layer.shape[0], chunk_rows):
            b = min(layer.shape[0], a + chunk_rows)
            x = torch.randn(b - a, D_LATENT, device=kv.device, generator=generator)
            layer[a:b] = quantize_rows(x.to(torch.bfloat16), V_DIM)


FP8_CASES = [  # (lens, n, h, page, layout, tree, q dtype, variant or splits): q [B, N, H, 576]
    # the Hopper fp8 kernel: the DDTree shapes (8 x 32; 8 x 33: a ragged last M tile), 64 x 16
    # chain with batch 2, 128 x 1, batches with prefixes 0 / not a multiple of 64 on shuffled
    # page-64 and page-128 tables, 17 x 128 chain, the direct path, Q through registers, prefill
    # chunks; then the table's own choices (8 x 1: the portable 16-row tile), the portable and
    # tree kernels forced, page 1 (gathered), fp16 q (no Hopper fp8: portable), fp32 q (gathered)
    ([70001], 32, 8, 64, "contiguous", "bushy", torch.bfloat16, "hopper"),
    ([70001], 33, 8, 64, "contiguous", "bushy", torch.bfloat16, "hopper"),
    ([20000, 9000], 16, 64, 64, "contiguous", "chain", torch.bfloat16, "hopper"),
    ([33003], 1, 128, 64, "contiguous", "chain", torch.bfloat16, "hopper"),
    ([12000, 3001], 1, 8, 64, "scattered", "chain", torch.bfloat16, "hopper"),
    ([5000, 301, 0], 17, 128, 64, "scattered", "chain", torch.bfloat16, "hopper"),
    ([4096, 0, 4033], 33, 8, 128, "scattered", "bushy", torch.bfloat16, "hopper"),
    ([2000, 64, 7000], 33, 8, 64, "scattered", "bushy", torch.bfloat16, "hopper"),
    ([9000, 130], 16, 16, 64, "scattered", "bushy", torch.bfloat16, "hopper-direct"),
    ([3001], 63, 1, 64, "contiguous", "chain", torch.bfloat16, "hopper-direct"),
    ([6000, 131], 16, 16, 64, "scattered", "bushy", torch.bfloat16, "hopper-qstrided"),
    ([8000], 1024, 8, 64, "contiguous", "chain", torch.bfloat16, "hopper"),
    ([3000, 77], 300, 16, 64, "contiguous", "chain", torch.bfloat16, "hopper"),
    ([70001], 1, 8, 64, "contiguous", "chain", torch.bfloat16, None),
    ([12000, 3001], 1, 64, 64, "scattered", "chain", torch.bfloat16, None),
    ([20000, 9000], 16, 16, 64, "scattered", "bushy", torch.bfloat16, 300),
    ([12000, 3001], 1, 8, 64, "scattered", "chain", torch.bfloat16, "portable"),
    ([20000, 9000], 16, 16, 64, "contiguous", "bushy", torch.bfloat16, "portable-ptr"),
    ([70001], 33, 8, 64, "contiguous", "bushy", torch.bfloat16, "portable_tree"),
    ([33003], 64, 8, 16, "contiguous", "bushy", torch.bfloat16, "portable_tree"),
    ([1000, 4097], 16, 16, 1, "scattered", "bushy", torch.bfloat16, None),
    ([777], 3, 3, 1, "scattered", "bushy", torch.float16, None),
    ([20000, 9000], 16, 16, 64, "scattered", "bushy", torch.float16, None),
    ([3000, 77], 5, 4, 64, "scattered", "bushy", torch.float32, None),
]


def _case_kwargs(variant, n: int, h: int) -> dict:
    from dataclasses import replace

    from treeflash.bench.kernel_checks import VARIANTS

    if variant is None or isinstance(variant, int):
        return {} if variant is None else {"num_splits": variant}
    kw = VARIANTS[variant.removesuffix("-qstrided").removesuffix("-ptr")](n * h)
    if variant.endswith("-ptr"):
        kw["config"] = replace(kw["config"], tma=False)
    return kw


def check_gpu_fp8(args, device: str = "cuda", cases: list | None = None) -> list[dict]:
    """Every fp8 case of `FP8_CASES` against a float64 reference on the decoded rows (0xFF in
    every slot that must not be read, page-table padding out of range), the Hopper fp8 kernel's
    chain eager against a CUDA graph (CUDA only), and the quantising writes against their torch
    twins. `device` / `cases`: tests run small cases on the CPU (Triton interpreter)."""
    from treeflash.kernels import reference
    from treeflash.kernels.mla_verify import mla_verify_attention_triton
    from treeflash.kernels.testing import (
        LSE_TOLERANCES,
        TOLERANCES,
        random_paged_kv,
        random_tree_masks,
        relative_error,
    )

    results = []
    for i, (lens, n, h, ps, layout, tree, dtype, variant) in enumerate(cases or FP8_CASES):
        if args.check_only and not str(variant).startswith(tuple(args.check_only.split(","))):
            continue
        g = torch.Generator().manual_seed(500 + i)
        kv = random_paged_kv([x + n for x in lens], D_LATENT, ps, torch.uint8, layout, device, g, v_dim=V_DIM)
        q = torch.randn(len(lens), n, h, D_LATENT, generator=g).to(device, dtype)
        if str(variant).endswith("-qstrided"):
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        mask = None if tree == "chain" else random_tree_masks(len(lens), n, g).to(device)
        prefix = torch.tensor(lens, dtype=torch.int32, device=device)
        scale = D_LATENT ** -0.5
        out, lse = mla_verify_attention_triton(q, kv.kv_cache, kv.page_table, prefix, mask, scale, V_DIM,
                                               **_case_kwargs(variant, n, h))
        ref, ref_lse = reference.mla_verify_attention(q.double(), kv.kv_cache, kv.page_table, prefix, mask,
                                                      scale, V_DIM)
        err, lerr = relative_error(out, ref), relative_error(lse, ref_lse)
        ok = bool(torch.isfinite(out).all()) and err <= TOLERANCES[dtype] and lerr <= LSE_TOLERANCES[dtype]
        results.append({"case": f"fp8 lens={lens} N={n} H={h} page={ps} {layout} {tree} {str(dtype)[6:]} "
                                f"{variant}", "err": err, "lse_err": lerr, "ok": ok})
        print(f"check {'ok ' if ok else 'BAD'} err={err:.2e} lse={lerr:.2e} {results[-1]['case']}", flush=True)
        del kv, ref, ref_lse
    if device == "cuda" and (not args.check_only or any("hopper".startswith(c) for c in args.check_only.split(","))):
        results += check_chain_fp8()
    results += check_writes_fp8(device)
    return results


def check_chain_fp8() -> list[dict]:
    """The Hopper fp8 kernel in dependent calls, eager and in a CUDA graph: bitwise equal
    (as `kernel._check_chain` for the 16-bit kernel; q rewritten from the last output right
    before each call, two caches back to back reusing freed partial buffers)."""
    from treeflash.bench.kernel_checks import VARIANTS
    from treeflash.kernels.mla_verify import mla_verify_attention_triton
    from treeflash.kernels.testing import random_paged_kv, random_tree_masks
    from treeflash.kvcache.format import quantize_rows

    g = torch.Generator().manual_seed(4343)
    lens, n, h = [30001, 7000], 32, 8
    kv = random_paged_kv([x + n for x in lens], D_LATENT, 64, torch.uint8, "scattered", "cuda", g, v_dim=V_DIM)
    kv2 = kv.kv_cache.clone()  # a second "layer": other rows in the same slots (poison kept)
    valid = (kv2 != 0xFF).any(-1)
    kv2[valid] = quantize_rows(torch.randn(int(valid.sum()), D_LATENT, generator=g).cuda() * 2, V_DIM)
    q0 = torch.randn(len(lens), n, h, D_LATENT, generator=g).to("cuda", torch.bfloat16)
    mask = random_tree_masks(len(lens), n, g).cuda()
    prefix = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cfg = VARIANTS["hopper"](n * h)["config"]

    def chain():
        q, outs = q0.clone(), []
        for _ in range(4):
            a = mla_verify_attention_triton(q, kv.kv_cache, kv.page_table, prefix, mask, 0.05, V_DIM, config=cfg)[0]
            b = mla_verify_attention_triton(q, kv2, kv.page_table, prefix, mask, 0.05, V_DIM, config=cfg)[0]
            outs += [a, b]
            q = q0.clone()
            q[..., :V_DIM] += 0.5 * (a - b)
        return torch.stack(outs)

    ref = chain()
    torch.cuda.synchronize()
    results = [{"case": "hopper fp8 chain: 8 dependent calls eager, finite", "ok": bool(torch.isfinite(ref).all())}]
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = chain()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        results.append({"case": "hopper fp8 chain: CUDA graph vs eager (bitwise)", "ok": torch.equal(ref, static)})
    except Exception as e:  # noqa: BLE001 - a rejected capture is a failure
        results.append({"case": "hopper fp8 chain: CUDA graph", "ok": False, "note": f"{type(e).__name__}: {e}"[:300]})
    for r in results:
        print(f"check {'ok ' if r['ok'] else 'BAD'} {r['case']}", flush=True)
    return results


def check_writes_fp8(device: str = "cuda") -> list[dict]:
    """kv_write, mla_latent_prep and kv_commit into fp8 rows on the GPU against their torch twins
    (bytes equal: the encoders are integer arithmetic; the prep against the write of the separate
    launches' row)."""
    from treeflash import kernels
    from treeflash.kernels import reference
    from treeflash.kernels.testing import random_paged_kv

    g = torch.Generator().manual_seed(8)
    kvp = random_paged_kv([40, 90], D_LATENT, 1, torch.uint8, "scattered", device, g, v_dim=V_DIM)
    pool = torch.stack([kvp.kv_cache, kvp.kv_cache.clone()])
    lat = torch.randn(2, 9, D_LATENT, generator=g).to(device, torch.bfloat16) * 3
    start = torch.tensor([30, 80], dtype=torch.int32, device=device)
    a, b = pool.clone(), pool.clone()
    kernels.kv_write(a[0], kvp.page_table, start, lat, impl="triton", v_dim=V_DIM)
    reference.kv_write(b[0], kvp.page_table, start, lat, v_dim=V_DIM)
    ok_write = torch.equal(a, b)
    acc = torch.tensor([[0, 2, 3, 7], [0, 1, 5, 8]], device=device)
    num = torch.tensor([4, 3], device=device)
    kernels.kv_commit(a, kvp.page_table, start, acc, num, impl="triton")
    reference.kv_commit(b, kvp.page_table, start, acc, num)
    ok_commit = torch.equal(a, b)
    half = 32
    ang = torch.rand(2, 9, half, generator=g).to(device) * 6
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    w = (1 + 0.1 * torch.randn(V_DIM, generator=g)).to(device, torch.bfloat16)
    fused, separate = pool[0].clone(), pool[0].clone()
    kernels.mla_latent_prep(lat, fused, kvp.page_table, start, w, 1e-6, cos, sin, True, impl="triton")
    row = lat.clone()
    kernels.rms_norm(row[..., :V_DIM], w, 1e-6, out=row[..., :V_DIM], impl="triton")
    kernels.rope(row[..., V_DIM:], cos, sin, True, out=row[..., V_DIM:], impl="triton")
    kernels.kv_write(separate, kvp.page_table, start, row, impl="triton", v_dim=V_DIM)
    results = [{"case": "fp8 kv_write vs torch (bytes)", "ok": ok_write},
               {"case": "fp8 kv_commit vs torch (bytes)", "ok": ok_commit},
               {"case": "fp8 mla_latent_prep vs the separate launches' kv_write (bytes)",
                "ok": torch.equal(fused, separate)}]
    for r in results:
        print(f"check {'ok ' if r['ok'] else 'BAD'} {r['case']}", flush=True)
    return results


def speedup_table(rows: list[dict]) -> str:
    """fp8 against bf16 for every (mode, H, N, tree, context) both ran: graph per-layer us of
    each, bf16 / fp8, and each one's fraction of its own floor."""
    by = {}
    for r in rows:
        if "step_ms" in r:
            by[(r.get("mode"), r["h"], r["n"], r["tree"], r["context"], r.get("kv_dtype", "bf16"))] = r
    lines = ["fp8_e4m3 against bf16 cache (graph per-layer us; fraction of each one's own floor)",
             f"{'mode':10s} {'H':>4s} {'N':>4s} {'tree':5s} {'ctx':>6s} {'bf16 us':>9s} {'fp8 us':>9s} "
             f"{'speedup':>7s} {'bf16 fr':>7s} {'fp8 fr':>7s}"]
    for key, fp8 in by.items():
        if key[-1] != "fp8" or (*key[:-1], "bf16") not in by:
            continue
        bf = by[(*key[:-1], "bf16")]
        lines.append(f"{key[0]:10s} {key[1]:4d} {key[2]:4d} {key[3]:5s} {key[4] // 1024:5d}k "
                     f"{bf['step_ms'] * 1e3:9.1f} {fp8['step_ms'] * 1e3:9.1f} "
                     f"{bf['step_ms'] / fp8['step_ms']:7.2f} {bf['frac_floor']:7.2f} {fp8['frac_floor']:7.2f}")
    return "\n".join(lines)

