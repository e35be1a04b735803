"""GPU check and cost of two launch fusions in a decode layer, each against what it replaces:

- `kernels.mla_latent_prep` (kv_a_layernorm, k_pe's rotation, the cache store and q_a_layernorm
  in one launch) against the four launches MLA ran (`TREEFLASH_MLA_PREP=0`): the cache rows and
  the normalised q_a must be the same bits; Kimi K2 / DeepSeek-V3 shapes (c_kv 512, k_pe 64,
  q_lora 1536), bf16 and fp32, 1 / 16 / 64 rows over a 64-row-page cache.
- the MoE's top-k (+ shared) sum inside the down launch (`TREEFLASH_MOE_FUSED_SUM=0`: its own
  `_sum_rows_kernel` launch) at Kimi K2 TP8 (384 experts of inter 256, top 8, shared 1 chunk):
  within float32 rounding of the separate sum (another fixed order), the same bits on a second
  call, the arrival counters back at zero.

    python benchmarks/check_layer_fusions.py --out benchmarks/results     (CUDA)

Times: us a call in a CUDA graph. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from benchutil import graph_us, write_rows  # noqa: E402

from treeflash import kernels  # noqa: E402
from treeflash.kernels import moe_gemm  # noqa: E402


def _prep_rows(dev, g, fails):
    r, half, ql, page = 512, 32, 1536, 64
    rows = []
    for dt in (torch.bfloat16, torch.float32):
        for n in (1, 16, 64):
            b = 1
            a = torch.randn(b, n, 2 * half + r + ql, device=dev, generator=g).to(dt) * 2
            latents, qa = a[..., : r + 2 * half], a[..., r + 2 * half:]
            table = torch.randperm(64, device=dev, generator=g).to(torch.int32).view(1, 64)
            start = torch.tensor([1000], device=dev, dtype=torch.int32)
            cache = torch.full((64, page, r + 2 * half), float("nan"), device=dev, dtype=dt)
            ang = torch.rand(b, n, half, device=dev, generator=g) * 6
            cos, sin = ang.cos().to(dt), ang.sin().to(dt)
            wkv = (1 + 0.2 * torch.randn(r, device=dev, generator=g)).to(dt)
            wq = (1 + 0.2 * torch.randn(ql, device=dev, generator=g)).to(dt)
            want_cache = cache.clone()

            def apart(cache=want_cache, latents=latents, qa=qa, cos=cos, sin=sin, wkv=wkv, wq=wq, table=table,
                      start=start):
                lat = latents.clone()  # (MLA normalises in place in the GEMM's output; a copy here)
                kernels.rms_norm(lat[..., :r], wkv, 1e-6, out=lat[..., :r], impl="triton")
                kernels.rope(lat[..., r:], cos, sin, True, out=lat[..., r:], impl="triton")
                kernels.kv_write(cache, table, start, lat, impl="triton")
                return kernels.rms_norm(qa, wq, 1e-6, impl="triton")

            def one(cache=cache, latents=latents, qa=qa, cos=cos, sin=sin, wkv=wkv, wq=wq, table=table, start=start):
                return kernels.mla_latent_prep(latents, cache, table, start, wkv, 1e-6, cos, sin, True,
                                               qa=qa, q_weight=wq, q_eps=1e-6, impl="triton")

            want_q, got_q = apart(), one()
            written = ~torch.isnan(want_cache)
            ok = (torch.equal(torch.isnan(cache), ~written) and torch.equal(cache[written], want_cache[written])
                  and torch.equal(got_q, want_q))
            lat_copy_us = graph_us(lambda latents=latents: latents.clone())
            row = {"fusion": "mla_latent_prep", "dtype": str(dt).split(".")[-1], "rows": n, "ok": ok,
                   "fused_us": graph_us(one), "apart_us": graph_us(apart) - lat_copy_us}
            rows.append(row)
            if not ok:
                fails.append(f"prep {row['dtype']} N{n}: not the separate launches' bits")
            print(f"prep {row['dtype']:8s} rows {n:3d} | {'ok' if ok else 'DIFFERENT'} | one launch "
                  f"{row['fused_us']:6.2f} us | four launches {row['apart_us']:6.2f} us", flush=True)
    return rows


def _sum_rows(dev, g, fails, hid=7168, inter=256, e=384, k=8):
    rows = []
    dt = torch.bfloat16
    s = hid ** -0.5
    wg = (torch.randn(e, inter, hid, device=dev, generator=g) * s).to(dt)
    wu = (torch.randn(e, inter, hid, device=dev, generator=g) * s).to(dt)
    wd = (torch.randn(e, hid, inter, device=dev, generator=g) * inter ** -0.5).to(dt)
    shared = tuple((torch.randn(*shape, device=dev, generator=g) * sc).to(dt)
                   for shape, sc in (((inter, hid), s), ((inter, hid), s), ((hid, inter), inter ** -0.5)))
    for t in (1, 8, 32):
        x = torch.randn(t, hid, device=dev, generator=g).to(dt)
        ids = torch.rand(t, e, device=dev, generator=g).topk(k, dim=-1).indices
        w = torch.rand(t, k, device=dev, generator=g) + 0.1

        def call(x=x, w=w, ids=ids):
            return moe_gemm.moe_experts_triton(x, w, ids, wg, wu, wd, shared=shared)

        os.environ["TREEFLASH_MOE_FUSED_SUM"] = "0"
        apart = call()
        apart_us = graph_us(call)
        os.environ.pop("TREEFLASH_MOE_FUSED_SUM")
        fused, again = call(), call()
        torch.cuda.synchronize()
        zero = not moe_gemm._tile_counters(dev, 1).any().item()
        # each output is one float32 sum of 9 rows rounded to bf16: at most one bf16 ulp apart
        diff = ((fused.float() - apart.float()).abs() / apart.float().abs().clamp_min(1e-3)).max().item()
        ok = torch.equal(fused, again) and zero and diff <= 2 * torch.finfo(dt).eps
        row = {"fusion": "moe_sum_in_down", "dtype": "bfloat16", "rows": t, "ok": ok, "max_rel_diff": diff,
               "counters_zero": zero, "fused_us": graph_us(call), "apart_us": apart_us}
        rows.append(row)
        if not ok:
            fails.append(f"sum t{t}: diff {diff:.2e}, repeat equal {torch.equal(fused, again)}, counters zero {zero}")
        print(f"moe sum rows {t:3d} | {'ok' if ok else 'FAILED'} (max rel diff {diff:.1e}) | in the down launch "
              f"{row['fused_us']:6.2f} us | own launch {row['apart_us']:6.2f} us (whole expert call)", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    fails: list[str] = []
    rows = _prep_rows(dev, g, fails) + _sum_rows(dev, g, fails)
    write_rows(args.out, "check-layer-fusions", rows, fails=fails,
               command="python benchmarks/check_layer_fusions.py " + " ".join(argv or sys.argv[1:]))
    print("FAILED: " + "; ".join(fails) if fails else "all checks ok")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
