"""GPU check and cost of a launch fusion in a decode layer against what it replaces:
`kernels.mla_latent_prep` (kv_a_layernorm, k_pe's rotation, the cache store and q_a_layernorm in
one launch) against the four launches MLA runs with the runtime option mla_prep=0, at Kimi K2 /
DeepSeek-V3 shapes (c_kv 512, k_pe 64, q_lora 1536), bf16 and fp32, 1 / 16 / 64 rows over a
64-row-page cache. Also q_pe's rotation inside the absorb launch against the rope
launch + the absorb, and the residual add inside the next input norm against the add + the norm,
both bf16 and bitwise. In 16-bit the cache rows and the normalised q_a must be the same bits; in
float32 within 4 ulps, because the norms' sums of squares are reduced over another warp count
(the separate norm launches run 2 warps for c_kv's 512 columns and 8 for q_a's 1536, this one 4),
so their order differs (H200, 2026-12-06: bf16 bitwise, float32 not; DESIGN_NOTES section 4).

(Its version at faa29f0 also checked the MoE's top-k sum inside the down launch; that fusion
was slower than its own launch and was removed: DESIGN_NOTES section 3.)

    python benchmarks/check_layer_fusions.py --out benchmarks/results     (CUDA)

Times: us a call in a CUDA graph. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from benchutil import finish_checks, graph_us  # noqa: E402

from treeflash import kernels  # noqa: E402


def _record(table, fails, what, ok, one, apart, n_apart, **key):
    """Time `one` and `apart` (us a call in a CUDA graph), keep the row, print it, and note a
    failure if the fused launch did not give the separate launches' result."""
    row = {"fusion": what, **key, "ok": ok, "fused_us": graph_us(one), "apart_us": graph_us(apart)}
    table.append(row)
    shape = " ".join(f"{k} {v}" for k, v in key.items())
    if not ok:
        fails.append(f"{what} {shape}: differs from the separate launches")
    print(f"{what:12s} {shape:24s} | {'ok' if ok else 'DIFFERENT'} | one launch {row['fused_us']:6.2f} us | "
          f"{n_apart} launches {row['apart_us']:6.2f} us", flush=True)
    return row


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
            rtol = 4 * torch.finfo(dt).eps if dt == torch.float32 else 0.0

            def same(a, b, rtol=rtol):
                return torch.equal(a, b) if rtol == 0 else torch.allclose(a, b, rtol=rtol, atol=0)
            ok = (torch.equal(torch.isnan(cache), ~written) and same(cache[written], want_cache[written])
                  and same(got_q, want_q))
            row = _record(rows, fails, "latent_prep", ok, one, apart, 4, dtype=str(dt).split(".")[-1], rows=n)
            row["apart_us"] -= graph_us(lambda latents=latents: latents.clone())  # (apart's latent copy)
    return rows


def _absorb_rope_rows(dev, g, fails):
    """q_pe's rotation inside the absorb launch (`head_matmul(rope=)`) against the rope launch +
    the absorb: Kimi K2 TP8 (8 heads) and DeepSeek-V3 TP1 (128 heads), bf16, the same bits."""
    nope, rope, r, rows = 128, 64, 512, []
    for h in (8, 128):
        for m in (1, 16, 32, 64):
            q = torch.randn(m, h, nope + rope, device=dev, generator=g).to(torch.bfloat16)
            w = (torch.randn(h, nope, r, device=dev, generator=g) / nope ** 0.5).to(torch.bfloat16)
            ang = torch.rand(m, rope // 2, device=dev, generator=g) * 6
            cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
            q_one, q_two = (torch.empty(m, h, r + rope, device=dev, dtype=torch.bfloat16) for _ in range(2))

            def one(q=q, w=w, cos=cos, sin=sin, o=q_one):
                kernels.head_matmul(q[..., :nope], w, out=o[..., :r], impl="triton",
                                    rope=(q[..., nope:], cos, sin, True, o[..., r:]))

            def apart(q=q, w=w, cos=cos, sin=sin, o=q_two):
                kernels.rope(q[..., nope:], cos, sin, True, out=o[..., r:], impl="triton")
                kernels.head_matmul(q[..., :nope], w, out=o[..., :r], impl="triton")

            one(), apart()
            ok = torch.equal(q_one, q_two)
            row = _record(rows, fails, "absorb_rope", ok, one, apart, 2, heads=h, rows=m)
            # which launch gives torch's bits (they differed until 1f2196f turned FP contraction off)
            want = kernels.rope(q[..., nope:], cos, sin, True, impl="torch")
            for name, got in (("one", q_one[..., r:]), ("apart", q_two[..., r:])):
                row[f"rope_equal_torch_{name}"] = (got == want).float().mean().item()
            if not ok:
                print(f"    rotated columns equal to torch's: one launch {row['rope_equal_torch_one']:.4f}, "
                      f"apart {row['rope_equal_torch_apart']:.4f}", flush=True)
    return rows


def _add_norm_rows(dev, g, fails):
    """The layer's residual add inside the next input norm (`rms_norm(residual=)`) against the
    add + the norm, hidden 7168, bf16: the same bits (sum and normed row)."""
    rows = []
    for m in (1, 16, 64):
        x = torch.randn(m, 7168, device=dev, generator=g).to(torch.bfloat16)
        d = torch.randn(m, 7168, device=dev, generator=g).to(torch.bfloat16)
        w = (1 + 0.2 * torch.randn(7168, device=dev, generator=g)).to(torch.bfloat16)

        def one(x=x, d=d, w=w):
            return kernels.rms_norm(d, w, 1e-6, residual=x, impl="triton")

        def apart(x=x, d=d, w=w):
            s = x + d
            return kernels.rms_norm(s, w, 1e-6, impl="triton"), s

        (n1, s1), (n2, s2) = one(), apart()
        ok = torch.equal(n1, n2) and torch.equal(s1, s2)
        _record(rows, fails, "add_in_norm", ok, one, apart, 2, rows=m)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    fails: list[str] = []
    rows = _prep_rows(dev, g, fails) + _absorb_rope_rows(dev, g, fails) + _add_norm_rows(dev, g, fails)
    return finish_checks(args.out, "check-layer-fusions", rows, fails, argv)


if __name__ == "__main__":
    sys.exit(main())
