"""Per-phase %clock64 stamps inside v5b's CTA (mla_verify_v5 constexpr TRACE; DESIGN_NOTES.md
1.4: ~3600 clk a 64-key tile against 2176 of tensor work; where do ~1400 go?).

For each shape (8 heads x 32 nodes bushy tree, 64 heads x 16 chain; 256k context, contiguous
page 64, bf16), one normal call through `mla_verify_attention_triton` (the default v5b path;
warm-up, compile), then the same call with `launch_v5(..., trace=buf)` (a TRACE compile of the
same kernel): one thread a partition stores %clock64 at each phase of the first TRACE_TILES
tiles of 4 CTAs (pid_m, pid_s, b) = (0,0,0), (0,1,0), (0,last split,0), (last M tile,0,0) into
buf [CTA, partition (WG0, WG1, loader), tile (+ a header row), event]. Then per partition:
median / mean over tiles 2 .. TRACE_TILES-1 of the delta between consecutive events
(`+x` = clocks since the previous event of the same partition), the tile-to-tile period, and
cross-partition latencies (one CTA = one SM: the clocks are comparable). Also: traced vs plain
output equal (bitwise), and the time of each (the stamps' cost).

  PYTHONPATH=src python3 benchmarks/lab/trace_v5.py --out $OUT           # on the H200 (< 60 s)
  PYTHONPATH=/tmp/tri36:src python benchmarks/lab/trace_v5.py --compile-only   # sm_90, no GPU

Exit status: 0 ok, 2 when a compile (or the traced launch) fails (the error is printed).
How to read it: the printed sections "<shape> / cta (pid_m,pid_s,b)" list, per partition, each
event with `+median (mean)` clocks since the previous event of that partition; "period" is
top(i+1) - top(i) of that partition (the tile time: ~3600 expected, 2176 = tensor floor);
"cross" lists handoffs between partitions (e.g. WG0 p_handed -> WG1 p_full_seen).
Stamps are approximate where only arithmetic separates them (softmax_done, WG1 rescaled:
ptxas may schedule ALU work across a clock read); waits, wgmma issue / wait and barrier
arrivals are ordered.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("TRITON_INTERPRET", "0")

D_LATENT = 576
V_DIM = 512
SHAPES = (  # (name, context, nodes, heads, tree)
    ("8x32-bushy-256k", 262144, 32, 8, "bushy"),
    ("64x16-chain-256k", 262144, 16, 64, "chain"),
    # the fixed cost a call (DESIGN_NOTES.md 1.4): only with --shape
    ("8x32-bushy-32k", 32768, 32, 8, "bushy"),
    ("8x1-chain-32k", 32768, 1, 8, "chain"),
)
DEFAULT_SHAPES = ("8x32-bushy-256k", "64x16-chain-256k")
CTA_NAMES = ("(0,0,0)", "(0,1,0)", "(0,last split,0)", "(last M tile,0,0)")
PART_NAMES = ("WG0", "WG1", "loader")
STEADY_FROM = 2
# compile-only: (name, Q_TMA, STAGE, causal, direct)
TRACE_VARIANTS = (
    ("v5b-trace-tree-split", True, False, False, False),
    ("v5b-trace-causal-split", True, False, True, False),
    ("v5b-trace-tree-direct", True, False, False, True),
    ("v5b-qreg-trace-tree-split", False, False, False, False),
    ("v5c-trace-tree-split", True, True, False, False),
)


# ----------------------------------------------------------------------------------- compile only
def compile_trace(name, q_tma, stage, is_causal, direct, page=64, dtype="bf16"):
    from compile_v5 import compile_v5

    return compile_v5(is_causal, direct, page, dtype, q_tma=q_tma, stage=stage, trace=True)


def compile_only(args) -> int:
    import re

    from compile_v5 import disassemble, sass_counts

    smem_limit = 232448
    rows, bad = [], False
    sass_dir = Path(args.sass) if args.sass else None
    if sass_dir:
        sass_dir.mkdir(parents=True, exist_ok=True)
    for name, q_tma, stage, causal, direct in TRACE_VARIANTS:
        try:
            k = compile_trace(name, q_tma, stage, causal, direct)
        except Exception as e:  # noqa: BLE001 - a failing compile is the result
            print(f"{name}: COMPILE FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
            rows.append({"tile": name, "error": f"{type(e).__name__}: {str(e)[:3000]}"})
            bad = True
            continue
        regs, stack, sass = disassemble(k, name)
        if sass_dir:
            (sass_dir / f"{name}.sass").write_text(sass)
            (sass_dir / f"{name}.ptx").write_text(k.asm["ptx"])
        c = sass_counts(sass)
        lines = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)
        row = {"tile": name, "registers": regs, "stack_bytes": stack, "shared_bytes": k.metadata.shared,
               "fits_smem": k.metadata.shared <= smem_limit,
               "clock_reads": sum(bool(re.search(r"SR_CLOCK", x)) for x in lines),
               "globaltimer_reads": sum(bool(re.search(r"SR_GLOBALTIMER", x)) for x in lines),
               "STG_64": sum(bool(re.search(r"\bSTG\.E\.64", x)) for x in lines),
               **c}
        row["ok"] = (row["stack_bytes"] == 0 and c["LDL"] == 0 and c["STL"] == 0 and row["fits_smem"])
        bad |= not row["ok"]
        rows.append(row)
    hdr = (f"{'variant':<28} {'regs':>4} {'stack':>5} {'LDL/STL':>7} {'smem':>7} {'fits':>4} "
           f"{'HGMMA':>5} {'waits':>5} {'clock':>5} {'gtimer':>6} {'insts':>6} setmaxnreg")
    print(hdr)
    for r in rows:
        if "error" in r:
            print(f"{r['tile']:<28} ERROR")
            continue
        regs = sorted({x.split()[-1] for x in r["setmaxnreg"]})
        print(f"{r['tile']:<28} {r['registers']:>4} {r['stack_bytes']:>5} "
              f"{r['LDL']:>3}/{r['STL']:<3} {r['shared_bytes']:>7} {str(r['fits_smem']):>4} "
              f"{r['HGMMA']:>5} {r['wgmma_waits']:>5} {r['clock_reads']:>5} "
              f"{r['globaltimer_reads']:>6} {r['instructions']:>6} {','.join(regs)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 2 if bad else 0


# ------------------------------------------------------------------------------------ analysis
def _med_mean(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None, 0
    return statistics.median(xs), statistics.fmean(xs), len(xs)


def analyse(buf, names) -> dict:
    """buf: nested list [CTA][partition][tile + 1][event] of int (-1 = not written)."""
    from treeflash.kernels import mla_verify_v5 as v5

    K = v5.TRACE_TILES
    hdr_names = v5.TRACE_HDR
    ev_names = (v5.TRACE_WG0, v5.TRACE_WG1, v5.TRACE_LOADER)
    out = {}
    for c, cname in enumerate(CTA_NAMES):
        parts = buf[c]
        hdrs = [dict(zip(hdr_names, parts[p][K][: len(hdr_names)])) for p in range(3)]
        if hdrs[0]["clock_start"] == -1:
            out[cname] = {"traced": False}
            continue
        n_tiles = hdrs[0]["n_tiles"]
        kk = min(K, n_tiles if n_tiles >= 0 else 0)
        steady = list(range(STEADY_FROM, kk - 1 if kk > STEADY_FROM + 1 else kk))
        res = {"traced": True, "header": {PART_NAMES[p]: hdrs[p] for p in range(3)},
               "tiles_stamped": kk, "steady_tiles": steady, "parts": {}, "cross": {}}
        g = hdrs[0]
        if g["gtime_end"] > g["gtime_start"] and g["clock_end"] > g["clock_start"]:
            res["clock_mhz_est"] = (g["clock_end"] - g["clock_start"]) / (
                g["gtime_end"] - g["gtime_start"]) * 1e3
            res["cta_us"] = (g["gtime_end"] - g["gtime_start"]) / 1e3
            res["cta_clk_per_tile"] = (g["clock_end"] - g["clock_start"]) / max(n_tiles, 1)

        def ev(p, i, name, parts=parts):
            v = parts[p][i][ev_names[p].index(name)]
            return None if v == -1 else v

        for p in range(3):
            names_p = ev_names[p]
            rows = []
            for e in range(len(names_p)):
                ds = []
                for i in steady:
                    if e == 0:  # from the previous tile's last event
                        a, b = parts[p][i - 1][len(names_p) - 1], parts[p][i][0]
                    else:
                        a, b = parts[p][i][e - 1], parts[p][i][e]
                    ds.append(None if -1 in (a, b) else b - a)
                med, mean, n = _med_mean(ds)
                rows.append({"event": names_p[e], "median": med, "mean": mean, "n": n,
                             "since": names_p[e - 1] if e else f"{names_p[-1]} (prev tile)"})
            per = [parts[p][i + 1][0] - parts[p][i][0] for i in steady
                   if i + 1 < kk and -1 not in (parts[p][i + 1][0], parts[p][i][0])]
            med, mean, n = _med_mean(per)
            res["parts"][PART_NAMES[p]] = {"events": rows, "period_median": med, "period_mean": mean}

        # cross-partition latencies: (label, (part, event, tile offset), (part, event, tile offset))
        cross = (
            ("WG0 p_handed(i) -> WG1 p_full_seen(i)", (0, "p_handed", 0), (1, "p_full_seen", 0)),
            ("WG0 pv_lo_issued(i) -> WG1 pv_hi_issued(i)", (0, "pv_lo_issued", 0),
             (1, "pv_hi_issued", 0)),
            ("WG1 released(i) -> WG0 p_empty_seen(i+1)", (1, "released", 0), (0, "p_empty_seen", 1)),
            ("WG1 pv_hi_done(i) -> WG0 qk_done(i+1)", (1, "pv_hi_done", 0), (0, "qk_done", 1)),
            ("WG0 qk_done(i) -> loader rope_empty_seen(i+2)", (0, "qk_done", 0),
             (2, "rope_empty_seen", 2)),
            ("WG1 released(i) -> loader hi_empty_seen(i+2)", (1, "released", 0),
             (2, "hi_empty_seen", 2)),
            ("WG0 pv_lo_done(i) -> loader lo_empty_seen(i+2)", (0, "pv_lo_done", 0),
             (2, "lo_empty_seen", 2)),
            ("loader rope_issued(i) -> WG0 rope_full(i)", (2, "rope_issued", 0), (0, "rope_full", 0)),
            ("loader hi_issued(i) -> WG0 hi_full(i)", (2, "hi_issued", 0), (0, "hi_full", 0)),
            ("loader lo_issued(i) -> WG0 lo_full(i)", (2, "lo_issued", 0), (0, "lo_full", 0)),
            ("WG0 pv_lo_done(i) -> WG0 rope_full(i+1) [wait for next tile]", (0, "pv_lo_done", 0),
             (0, "rope_full", 1)),
            ("WG0 top(i) -> WG0 top(i+1) [WG0 period]", (0, "top", 0), (0, "top", 1)),
        )
        for label, (pa, ea, oa), (pb, eb, ob) in cross:
            ds = []
            for i in steady:
                if i + max(oa, ob) >= kk:
                    continue
                a, b = ev(pa, i + oa, ea), ev(pb, i + ob, eb)
                ds.append(None if a is None or b is None else b - a)
            med, mean, n = _med_mean(ds)
            res["cross"][label] = {"median": med, "mean": mean, "n": n}
        # one CTA's raw timeline: every stamp relative to WG0 top of tile STEADY_FROM
        t0 = parts[0][min(STEADY_FROM, max(kk - 1, 0))][0]
        res["timeline_rel_clk"] = {
            PART_NAMES[p]: [[None if x == -1 else x - t0 for x in parts[p][i][: len(ev_names[p])]]
                            for i in range(kk)] for p in range(3)}
        out[cname] = res
    return out


def print_analysis(shape, meta, an) -> None:
    print(f"\n=== {shape}: grid {meta.get('grid')} splits {meta.get('splits')} | plain "
          f"{meta.get('plain_us', float('nan')):.1f} us, traced {meta.get('traced_us', float('nan')):.1f}"
          f" us | traced == plain: {meta.get('bitwise_equal')}")
    starts = [r["header"]["WG0"]["gtime_start"] for r in an.values() if r.get("traced")]
    t0 = min(starts) if starts else 0
    for res in an.values():
        if res.get("traced"):  # globaltimer (ns): where this CTA's loop sat in the grid's time
            g = res["header"]["WG0"]
            res["start_us_after_first"] = (g["gtime_start"] - t0) / 1e3
            res["end_us_after_first"] = (g["gtime_end"] - t0) / 1e3
    for cname, res in an.items():
        if not res.get("traced"):
            print(f"--- cta {cname}: not traced (no such CTA)")
            continue
        extra = ""
        if "clock_mhz_est" in res:
            extra = (f" | clock ~{res['clock_mhz_est']:.0f} MHz, CTA {res['cta_us']:.1f} us, "
                     f"{res['cta_clk_per_tile']:.0f} clk/tile over all {res['header']['WG0']['n_tiles']}"
                     f" tiles (sm {res['header']['WG0']['smid']}), loop {res['start_us_after_first']:.1f}"
                     f" -> {res['end_us_after_first']:.1f} us after the first traced CTA's start")
        print(f"--- cta {cname}: steady tiles {res['steady_tiles'][:1]}..{res['steady_tiles'][-1:]}"
              f"{extra}")
        for pn, pr in res["parts"].items():
            chain = " -> ".join(
                f"{r['event']} +{r['median']:.0f}" + (f"({r['mean']:.0f})" if r['mean'] is not None else "")
                if r["median"] is not None else f"{r['event']} +?" for r in pr["events"])
            per = f"{pr['period_median']:.0f} ({pr['period_mean']:.0f})" if pr["period_median"] else "?"
            print(f"  {pn:<6} period {per} clk | {chain}")
        print("  cross (median (mean) clk):")
        for label, r in res["cross"].items():
            if r["median"] is not None:
                print(f"    {label:<62} {r['median']:>7.0f} ({r['mean']:.0f})")
        if cname == TIMELINE_CTA:
            _print_timeline(res)


TIMELINE_CTA = CTA_NAMES[1]
# (partition, event) columns of the per-tile timeline, in clocks after WG0's top of the same tile
TIMELINE_COLS = (("WG0", "rope_full"), ("WG0", "lo_full"), ("WG0", "qk_done"),
                 ("WG0", "softmax_done"), ("WG0", "p_handed"), ("WG0", "pv_lo_done"),
                 ("WG1", "p_full_seen"), ("WG1", "pv_hi_issued"), ("WG1", "pv_hi_done"),
                 ("loader", "rope_issued"), ("loader", "lo_issued"))


def _print_timeline(res) -> None:
    """One CTA, every stamped tile: the columns above relative to WG0 top(i), and WG0's period."""
    from treeflash.kernels import mla_verify_v5 as v5

    names = {"WG0": v5.TRACE_WG0, "WG1": v5.TRACE_WG1, "loader": v5.TRACE_LOADER}
    tl = res["timeline_rel_clk"]
    print("  per-tile timeline (clk after WG0 top(i); period = WG0 top(i+1) - top(i)):")
    print("    " + f"{'tile':>4} {'period':>6} " + " ".join(f"{p[:3] + '.' + e[:10]:>14}" for p, e in TIMELINE_COLS))
    w0 = tl["WG0"]
    for i in range(len(w0)):
        t0 = w0[i][0]
        per = (w0[i + 1][0] - t0) if i + 1 < len(w0) and None not in (t0, w0[i + 1][0]) else None
        cells = []
        for p, e in TIMELINE_COLS:
            x = tl[p][i][names[p].index(e)] if i < len(tl[p]) else None
            cells.append(f"{'?' if x is None or t0 is None else x - t0:>14}")
        print(f"    {i:>4} {'' if per is None else per:>6} " + " ".join(cells))


# ------------------------------------------------------------------------------------- GPU run
def run_shape(name, ctx, n, h, tree, seed=0, splits=None) -> tuple[dict, list]:
    import torch

    from treeflash.bench.kernel import LayerCaches, _make_call
    from treeflash.kernels import mla_verify_v5 as v5

    caches = LayerCaches(1, ctx + n, "contiguous", seed)
    call, _ = _make_call(caches, ctx, n, h, tree, seed, **({"num_splits": splits} if splits else {}))
    meta = {"shape": name, "context": ctx, "n": n, "h": h, "tree": tree, "forced_splits": splits}
    orig = v5.launch_v5
    state = {"trace": None, "calls": []}

    def wrapped(grid, *a, **kw):
        state["calls"].append({"grid": list(grid), "splits": a[13],
                               "staged_store": kw.get("staged_store")})
        if state["trace"] is not None:
            kw["trace"] = state["trace"]
        return orig(grid, *a, **kw)

    v5.launch_v5 = wrapped
    try:
        ref, _ = call(0)  # warm-up + compile of the plain kernel
        torch.cuda.synchronize()
        if not state["calls"]:
            raise RuntimeError("the call did not run launch_v5 (not v5 / v5b: check "
                               "TREEFLASH_VERIFY_KERNEL and the GPU)")
        meta.update(state["calls"][-1])
        buf = torch.full((v5.TRACE_NUMEL,), -1, dtype=torch.int64, device="cuda")
        state["trace"] = buf
        out, _ = call(0)  # the TRACE compile + launch
        torch.cuda.synchronize()
        meta["bitwise_equal"] = bool(torch.equal(out, ref))
        meta["max_abs_diff"] = float((out.float() - ref.float()).abs().max())

        def timed(traced, reps=5):
            state["trace"] = buf if traced else None
            ts = []
            for _ in range(reps):
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                call(0)
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) * 1e3)
            return statistics.median(ts)

        meta["plain_us"] = timed(False)
        meta["traced_us"] = timed(True)
        # the analysed buffer: a fresh traced call
        buf.fill_(-1)
        state["trace"] = buf
        call(0)
        torch.cuda.synchronize()
        raw = buf.view(v5.TRACE_CTAS, v5.TRACE_PARTS, v5.TRACE_TILES + 1, v5.TRACE_EVENTS).cpu().tolist()
    finally:
        v5.launch_v5 = orig
        state["trace"] = None
    del caches
    torch.cuda.empty_cache()
    return meta, raw


def gpu_run(args) -> int:
    import torch

    t_start = time.time()
    os.environ["TREEFLASH_VERIFY_KERNEL"] = args.kernel
    from treeflash.bench.sweep import git_commit
    from treeflash.kernels import mla_verify_v5 as v5

    if not torch.cuda.is_available():
        print("no CUDA device", flush=True)
        return 2
    res = {"gpu": torch.cuda.get_device_name(0),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "kernel": args.kernel, "torch": torch.__version__,
           "trace_ctas": CTA_NAMES, "trace_tiles": v5.TRACE_TILES, "steady_from": STEADY_FROM,
           "events": {"WG0": v5.TRACE_WG0, "WG1": v5.TRACE_WG1, "loader": v5.TRACE_LOADER,
                      "header": v5.TRACE_HDR},
           "shapes": []}
    try:
        import triton
        res["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    print(f"{res['gpu']} | commit {res['commit']} | kernel {args.kernel} | {res['date']}", flush=True)
    status = 0
    shapes = [s for s in SHAPES if s[0] in (args.shape or DEFAULT_SHAPES)]
    runs = [(s, None) for s in shapes] + [(s, k) for k in args.splits for s in shapes]
    for (name, ctx, n, h, tree), splits in runs:
        if splits:
            name = f"{name}-splits{splits}"
        try:
            meta, raw = run_shape(name, ctx, n, h, tree, splits=splits)
        except Exception as e:  # noqa: BLE001 - compile / launch failure is the result
            msg = f"{type(e).__name__}: {str(e)[:4000]}"
            print(f"{name}: FAILED {msg}", flush=True)
            traceback.print_exc()
            res["shapes"].append({"shape": name, "error": msg})
            status = 2
            continue
        an = analyse(raw, None)
        print_analysis(name, meta, an)
        res["shapes"].append({**meta, "analysis": an, "raw": raw})
        print(f"[{time.time() - t_start:.1f} s]", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"trace-v5-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"\nwrote {path} ({time.time() - t_start:.1f} s)", flush=True)
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                   help="folder for the JSON (GPU run)")
    p.add_argument("--compile-only", action="store_true",
                   help="compile the TRACE variants for sm_90 (no GPU; Triton 3.6 e.g. /tmp/tri36)")
    p.add_argument("--sass", default="", help="compile-only: keep SASS / PTX here")
    p.add_argument("--json", default="", help="compile-only: write the rows here")
    p.add_argument("--kernel", default="v5b", choices=("v5b", "v5c"),
                   help="TREEFLASH_VERIFY_KERNEL for the call (TRACE exists in v5b / v5c)")
    p.add_argument("--shape", action="append", default=[],
                   help=f"only these shapes (repeatable): {[s[0] for s in SHAPES]}")
    p.add_argument("--splits", default="",
                   help="also run each shape with these split counts (comma list): fewer CTAs "
                        "pull tiles from L2 at once; a tile period that falls with them says L2 "
                        "load sets it (DESIGN_NOTES.md 1.4)")
    args = p.parse_args(argv)
    args.splits = [int(x) for x in args.splits.split(",") if x.strip()]
    if args.compile_only:
        return compile_only(args)
    try:
        return gpu_run(args)
    except Exception:  # noqa: BLE001 - e.g. an import or CUDA failure outside one shape
        traceback.print_exc()
        return 2


if __name__ == "__main__":
    sys.exit(main())
