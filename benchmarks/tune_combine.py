"""The verify call's LSE combine alone, over its tile and warp choices (DESIGN_NOTES.md 1.3: on
the H200 the combine took 2.9-10 us a call of 20-84 us at 32k-64k, reading ~8.6 MB of
bf16 partials that the split kernel has just written, i.e. 0.9-1.7 TB/s from L2).

For each (rows, splits) of the engine's shapes (8 heads x 1 / 16 / 32 nodes, 64 x 1 / 16 / 32),
random bf16 partials [1, rows, splits, 512] (split-minor since a7f6384) and float32 partial
LSEs, the combine kernel (`kernels/mla_verify/combine.py`) with every (BLOCK_S, BLOCK_VC,
num_warps) candidate: checked
against a float64 torch combine, then timed as the per-launch time of a CUDA graph of 50
launches (partials L2-resident, as after the split kernel). Prints a table (us, effective
TB/s, the engine's current choice marked) and writes DIR/tune-combine-<date>.json.

    PYTHONPATH=src python3 benchmarks/tune_combine.py --out $OUT        (CUDA, ~30 s)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from benchutil import graph_us, write_rows  # noqa: E402  (this folder)

V = 512
SHAPES = ((8, 129), (64, 129), (128, 65), (256, 33), (1024, 8), (2048, 4))  # (rows, splits)


def engine_choice(rows: int, splits: int, sms: int) -> tuple[int, int, int]:
    from treeflash.kernels.mla_verify.combine import hopper_tiles

    return hopper_tiles(splits, V, rows, sms)


def reference(po, plse):
    lse = plse.double()[0]  # [R, S] log2 units
    w = torch.softmax(lse * 0.6931471805599453, dim=1)  # over splits
    return (w[..., None] * po.double()[0]).sum(1)  # [R, V]


def launch(po, plse, pl, out, lse, rows, splits, bs, bvc, warps):
    import triton

    from treeflash.kernels.mla_verify.combine import _combine_kernel

    _combine_kernel[(rows, triton.cdiv(V, bvc), 1)](
        po, plse, pl, out, lse, rows, 1, rows, V, splits,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        BLOCK_S=bs, BLOCK_VC=bvc, BLOCK_N=64, num_warps=warps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_combine needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_out = []
    for rows, splits in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(rows * 1000 + splits)
        po = torch.randn(1, rows, splits, V, device="cuda", generator=g).to(torch.bfloat16)
        plse = torch.randn(1, rows, splits, device="cuda", generator=g) * 4 + 20
        total = splits * 64 * 16
        pl = torch.tensor([total - 1], dtype=torch.int32, device="cuda")
        out = torch.empty(1, 1, rows, V, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(1, 1, rows, device="cuda", dtype=torch.float32)
        ref = reference(po, plse)
        mine = engine_choice(rows, splits, sms)
        nbytes = po.numel() * 2 + plse.numel() * 4 + out.numel() * 2
        bs_all = sorted({min(256, triton.next_power_of_2(splits)), 8, 16, 32})
        for bs in bs_all:
            for bvc in (32, 64, 128, 256, 512):
                for warps in (1, 2, 4, 8):
                    if bs * bvc > 32 * 32 * warps * 4 or bs * bvc < 32 * warps:  # <= 128 fp32 a thread
                        continue
                    cfg = (po, plse, pl, out, lse, rows, splits, bs, bvc, warps)
                    fn = lambda cfg=cfg: launch(*cfg)  # noqa: E731
                    try:
                        out.fill_(float("nan"))
                        fn()
                        torch.cuda.synchronize()
                        # relative to the bf16 output's rounding (2^-8 of the value)
                        err = float(((out[0, 0].double() - ref).abs() / (ref.abs() + 1e-2)).max())
                        us = graph_us(fn)
                    except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result
                        rows_out.append({"rows": rows, "splits": splits, "block_s": bs, "block_vc": bvc,
                                         "warps": warps, "error": repr(e)[:300]})
                        continue
                    r = {"rows": rows, "splits": splits, "block_s": bs, "block_vc": bvc, "warps": warps,
                         "us": round(us, 2), "tbps": round(nbytes / us / 1e6, 3), "max_err": err,
                         "ok": err < 2 ** -7, "engine": (bs, bvc, warps) == mine}
                    rows_out.append(r)
        best = sorted((r for r in rows_out if r["rows"] == rows and r["splits"] == splits and "us" in r
                       and r["ok"]), key=lambda r: r["us"])
        eng = [r for r in rows_out if r["rows"] == rows and r["splits"] == splits and r.get("engine")]
        print(f"rows {rows:5d} splits {splits:4d} ({nbytes / 1e6:.1f} MB): engine {mine} "
              f"{eng[0]['us'] if eng else float('nan'):.2f} us | best:", flush=True)
        for r in best[:6]:
            print(f"    BLOCK_S {r['block_s']:4d} BLOCK_VC {r['block_vc']:4d} warps {r['warps']}: {r['us']:6.2f} us "
                  f"{r['tbps']:.2f} TB/s rel err {r['max_err']:.1e}", flush=True)
        bad = [r for r in rows_out if r["rows"] == rows and r["splits"] == splits and not r.get("ok", True)]
        if bad:
            print(f"    {len(bad)} configs over the error bound (first: {bad[0]})", flush=True)
    write_rows(args.out, "tune-combine", rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
