"""Sweep the TMA fill probe (src/treeflash/kernels/probe_fill.py): is the verify kernel's ~4.7 TB/s
L2 -> shared fill (DESIGN_NOTES.md 1.4) bound by bytes in flight
a SM (latency), by L2 bandwidth for M tiles sharing key tiles, or by shared-memory bandwidth
(wgmma operand reads + TMA writes)?

Per config: total keys 256k of a bf16 [keys, 576] tensor (302 MB), grid (m_tiles, splits) with
splits = SMs // m_tiles (the CTAs of one split read the same keys: m_tiles readers a tile), a
ring of NUM_SLOTS x TILE_KEYS x 576, optional resident 72 KB "Q" buffer (q72), consumer spin
(clock cycles a tile; 2176 x TILE_KEYS / 64 = the tensor time of a tile at peak) or the tile's real
QK + PV wgmma (mma). Figures: time (median of reps, CUDA events, after warm-up), fill TB/s =
m_tiles x bytes / time (L2 -> shared, all SMs), HBM TB/s = bytes / time, fill / 6.3 TB/s (the rate
that feeds the tensor cores at peak with 64 x 64 tiles).

  python benchmarks/lab/probe_fill.py --dry-run            # config list, no GPU, no Triton
  PYTHONPATH=/tmp/tri36:src python benchmarks/lab/probe_fill.py --compile-only   # sm_90, no GPU
  PYTHONPATH=src python benchmarks/lab/probe_fill.py --budget-s 60   # on the H200
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: benchutil, compile_v5

D = 576
SMEM_LIMIT = 232448
TILE_CLK_64 = 2176  # tensor clk of a 64 x 64-key tile (64 x 64 x 1088 MACs x 2 FLOP) at peak
FEED_TBS = 6.3  # L2 -> shared rate that keeps 132 SMs' tensor cores at peak (64-row tiles)

# (tile_keys, num_slots, q72): q72 = the resident 72 KB Q buffer. A block may have 227 KB: 64-key
# tiles with 3 slots and 32-key tiles with 6 fit only without it (3 x 72 + 72 = 288 KB), and 64-key
# tiles with 4 slots (288 KB) never fit, so that ring is not in the sweep. 16-key tiles x 8 (the
# same 144 KB in flight as v5's 2 x 64, in 8 steps) test granularity at equal bytes.
# Every variant compiles to 255 registers x 8 warps (4 + 1 loader, padded): 1 CTA a SM regardless
# of shared memory, so q72 changes the shared footprint (and adds Q's 9 boxes), not occupancy.
RINGS = ((64, 1, True), (64, 2, True), (64, 1, False), (64, 2, False), (64, 3, False),
         (32, 2, True), (32, 3, True), (32, 4, True), (32, 4, False), (32, 6, False),
         (16, 8, True))
M_TILES = (1, 2, 4, 8)


def smem_estimate(tile_keys: int, num_slots: int, q72: bool) -> int:
    return num_slots * tile_keys * D * 2 + (64 * D * 2 if q72 else 0) + 16 * num_slots + 8


def configs(args) -> list[dict]:
    """Every (ring, mode, spin, m_tiles) to run, in run order: the cheap, most telling ones first
    (spin 0 / the rings closest to v5) so a cut-off sweep still answers the question."""
    sms = args.sms
    rows = []
    modes = [("spin", 0), ("spin", 1)] + ([("mma", 0)] if args.mma else [])
    for mode, spin_on in modes:
        for tk, ns, q72 in RINGS:
            if mode == "mma" and (not q72 or tk < 32):
                continue  # the QK reads Q from the resident buffer; N = 16 wgmma: not v5's work
            for m in M_TILES:
                rows.append({"mode": mode, "tile_keys": tk, "num_slots": ns, "q72": q72,
                             "spin": TILE_CLK_64 * tk // 64 if spin_on else 0,
                             "m_tiles": m, "splits": sms // m, "ctas": m * (sms // m),
                             "ring_kb": ns * tk * D * 2 / 1024,
                             "smem_est": smem_estimate(tk, ns, q72)})
    return rows


def variants(rows) -> list[tuple]:
    """The distinct compiled kernels: (tile_keys, num_slots, q72, mma)."""
    seen = []
    for r in rows:
        v = (r["tile_keys"], r["num_slots"], r["q72"], r["mode"] == "mma")
        if v not in seen:
            seen.append(v)
    return seen


# ---- compile for sm_90 without a GPU (compile_v5.py's way) ---------------------------------------
def compile_variant(tk: int, ns: int, q72: bool, mma: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from treeflash.kernels import probe_fill as pf

    layout = pf.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    sig = {"kv_desc": f"tensordesc<bf16[{tk}, 64],{layout!r}>",
           "q_desc": f"tensordesc<bf16[64, 64],{layout!r}>",
           "SINK": "*i32", "total_keys": "i32", "chunk": "i32", "spin": "i32"}
    cx = {"TILE_KEYS": tk, "NUM_SLOTS": ns, "Q_RES": q72, "MMA": mma}
    sig.update({k: "constexpr" for k in cx})
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names)
             if k in ("SINK", "total_keys", "chunk")}
    return triton.compile(GluonASTSource(fn=pf.probe_fill_kernel, signature=sig, constexprs=cx,
                                         attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": pf.NUM_WARPS, "num_stages": 1})


def compile_report(rows) -> list[dict]:
    import triton
    from compile_v5 import disassemble

    out = []
    for tk, ns, q72, mma in variants(rows):
        tag = f"t{tk}-s{ns}-{'q72' if q72 else 'q0'}{'-mma' if mma else ''}"
        try:
            k = compile_variant(tk, ns, q72, mma)
        except Exception as e:  # noqa: BLE001 - a failing compile is the result
            out.append({"variant": tag, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            print(f"{tag}: {out[-1]['error']}", flush=True)
            continue
        regs, stack, sass = disassemble(k, f"probe-{tag}")
        lines = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)
        cnt = lambda pat, lines=lines: sum(bool(re.search(pat, x)) for x in lines)  # noqa: E731
        shared = k.metadata.shared
        out.append({"variant": tag, "triton": triton.__version__,
                    "registers": regs, "stack_bytes": stack,
                    "num_warps": k.metadata.num_warps, "shared_bytes": shared,
                    "fits": shared <= SMEM_LIMIT,
                    "ctas_per_sm_by_smem": SMEM_LIMIT // max(shared, 1) if shared else None,
                    "ctas_per_sm_by_regs": (65536 // (regs * 32 * k.metadata.num_warps)
                                            if regs else None),
                    "TMA_loads": cnt(r"UTMALDG"), "HGMMA": cnt(r"\bHGMMA"),
                    "mbarrier_waits": cnt(r"SYNCS\.PHASECHK"), "clock_reads": cnt(r"CS2R.*SR_CLOCK"),
                    "LDL": cnt(r"\bLDL"), "STL": cnt(r"\bSTL")})
    print(f"{'variant':<18} {'regs':>5} {'warps':>5} {'shared B':>9} {'fits':>5} {'CTA/SM':>6} {'UTMALDG':>7} "
          f"{'HGMMA':>5} {'clock':>5} {'LDL/STL':>7}")
    for r in out:
        if "error" in r:
            print(f"{r['variant']:<18} ERROR")
            continue
        print(f"{r['variant']:<18} {r['registers']:>5} {r['num_warps']:>5} {r['shared_bytes']:>9} "
              f"{str(r['fits']):>5} {min(r['ctas_per_sm_by_smem'], r['ctas_per_sm_by_regs']):>6} "
              f"{r['TMA_loads']:>7} {r['HGMMA']:>5} "
              f"{r['clock_reads']:>5} {r['LDL']}/{r['STL']:>3}")
    return out


# ---- the GPU sweep ------------------------------------------------------------------------------
def git_commit() -> str:
    try:
        from treeflash.bench.sweep import git_commit as gc
        return gc()
    except Exception:  # noqa: BLE001
        return os.environ.get("TREEFLASH_COMMIT", "unknown")


def sweep(args, rows) -> dict:
    import torch
    import triton

    from treeflash.kernels import probe_fill as pf

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    keys = args.keys
    nbytes = keys * D * 2
    flat = (torch.randn(keys, D, device=dev) * 0.01).to(torch.bfloat16)
    sink = torch.zeros(1024, dtype=torch.int32, device=dev)
    l2_flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # > 60 MB L2: cold start
    res = {"gpu": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
           "l2_bytes": getattr(props, "L2_cache_size", None),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "torch": torch.__version__, "triton": triton.__version__,
           "keys": keys, "bytes": nbytes, "feed_tbs": FEED_TBS, "tile_clk_64": TILE_CLK_64,
           "fill": "m_tiles x bytes / time (L2 -> shared, all CTAs)", "hbm": "bytes / time",
           "args": {k: v for k, v in vars(args).items()}, "rows": [], "skipped": []}
    t0 = time.time()
    for r in rows:
        if time.time() - t0 > args.budget_s:
            res["skipped"].append(r)
            continue
        tk, ns = r["tile_keys"], r["num_slots"]
        chunk = -(-keys // r["splits"])
        chunk = -(-chunk // 64) * 64  # v5's split rounding: 64-key multiples
        r = dict(r, chunk=chunk, active_ctas=r["m_tiles"] * -(-keys // chunk))

        def call(r=r, chunk=chunk, tk=tk, ns=ns):
            pf.launch(flat, sink, r["m_tiles"], r["splits"], chunk, r["spin"], tk, ns, r["q72"],
                      r["mode"] == "mma")

        try:
            for _ in range(args.warmup):
                call()
            torch.cuda.synchronize()
            sink.zero_()
            call()
            torch.cuda.synchronize()
            got = int(sink[: r["ctas"]].sum().item())  # each CTA: its tiles (+0 from spin / mma)
            want = r["m_tiles"] * -(-keys // tk)
            ts = []
            for _ in range(args.reps):
                l2_flush.zero_()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                call()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) * 1e-3)
        except Exception as e:  # noqa: BLE001 - keep the other configs
            r["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            res["rows"].append(r)
            print(f"ERROR {r}", flush=True)
            continue
        ts.sort()
        t = ts[len(ts) // 2]
        r.update(time_us=t * 1e6, time_min_us=ts[0] * 1e6, tiles_ok=got == want,
                 fill_tbs=r["m_tiles"] * nbytes / t / 1e12, hbm_tbs=nbytes / t / 1e12)
        r["fill_frac_feed"] = r["fill_tbs"] / FEED_TBS
        # Little's law at spin 0 (every slot can be in flight): the latency a ring-full of bytes
        # would need to give this CTA's rate. Constant across slot counts -> latency-bound.
        per_cta = r["fill_tbs"] * 1e12 / r["active_ctas"]
        r["ring_latency_us"] = r["num_slots"] * tk * D * 2 / per_cta * 1e6
        # what the spin alone would allow: tiles a CTA x spin clk at the SM clock
        clk = props.clock_rate * 1e3 if hasattr(props, "clock_rate") else None
        if r["spin"] and clk:
            r["spin_floor_us"] = -(-chunk // tk) * r["spin"] / clk * 1e6
        res["rows"].append(r)
        print(row_line(r), flush=True)
    res["wall_s"] = time.time() - t0
    return res


def header() -> str:
    return (f"{'mode':<4} {'tile':>4} {'slots':>5} {'q72':>3} {'ringKB':>6} {'spin':>5} {'m':>2} "
            f"{'splits':>6} {'time us':>8} {'fill TB/s':>9} {'/6.3':>5} {'HBM TB/s':>8} {'ok':>3} "
            f"{'ring/rate us':>12}")


def row_line(r) -> str:
    s = (f"{r['mode']:<4} {r['tile_keys']:>4} {r['num_slots']:>5} {'y' if r['q72'] else 'n':>3} "
         f"{r['ring_kb']:>6.0f} {r['spin']:>5} {r['m_tiles']:>2} {r['splits']:>6}")
    if "time_us" in r:
        s += (f" {r['time_us']:>8.1f} {r['fill_tbs']:>9.2f} {r['fill_frac_feed']:>5.2f} "
              f"{r['hbm_tbs']:>8.2f} {'y' if r['tiles_ok'] else 'N':>3} {r['ring_latency_us']:>12.2f}")
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the configs only (CPU)")
    p.add_argument("--compile-only", action="store_true",
                   help="compile every variant for sm_90 (no GPU) and report shared memory")
    p.add_argument("--budget-s", type=float, default=60.0, help="skip the configs left after this")
    p.add_argument("--keys", type=int, default=256 * 1024)
    p.add_argument("--sms", type=int, default=0, help="default: the GPU's SM count (132 on CPU)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-mma", dest="mma", action="store_false",
                   help="skip the mode with the tile's real QK + PV wgmma (run last)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if not args.sms:
        try:
            import torch
            args.sms = (torch.cuda.get_device_properties(0).multi_processor_count
                        if torch.cuda.is_available() else 132)
        except Exception:  # noqa: BLE001
            args.sms = 132
    rows = configs(args)
    if args.dry_run:
        print(f"{len(rows)} configs, {len(variants(rows))} kernels; keys {args.keys} "
              f"({args.keys * D * 2 / 1e6:.0f} MB), SMs {args.sms}")
        print(header())
        for r in rows:
            print(row_line(r) + f"  smem~{r['smem_est']}")
        return 0
    if args.compile_only:
        os.environ.setdefault("TRITON_INTERPRET", "0")
        rep = compile_report(rows)
        return 0 if all(r.get("fits") for r in rep) else 1
    res = sweep(args, rows)
    print(header())
    for r in res["rows"]:
        print(row_line(r))
    if res["skipped"]:
        print(f"skipped {len(res['skipped'])} configs (budget {args.budget_s} s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out / f"probe-fill-{stamp}{('-' + args.tag) if args.tag else ''}.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
