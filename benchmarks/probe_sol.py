"""Speed of light of a per-call streaming read on this GPU: what fraction of the memory floor can ANY
attention kernel reach that reads one layer's latent KV cache once per call, when the 61 calls (one
per layer, each over its own layer's buffer) are replayed in one CUDA graph?

Per context L: 61 distinct bf16 [L, 576] buffers (random); floor per call = L x 576 x 2 B / 4.24e12
B/s. Variants (plain Triton `tl`, no Gluon), each summing its whole buffer in fp32:
  one    one kernel a call: P programs, each reads its contiguous share of the buffer in whole blocks
         of BLOCK_ROWS x 576 (grid `split`), or P programs stride over the blocks (grid `stride`,
         persistent); loads are 9 contiguous 1-D chunks a block (`ptr`) or 9 [BLOCK_ROWS, 64] TMA
         boxes through a host tensor descriptor (`tma`); the block loop pipelines with tl.range's
         num_stages (shared ring of stages-1 blocks; 1: no pipelining, `ptr` loads straight to
         registers); one fp32 partial a program
  two    `one` + a 1-program kernel summing the P partials (a split kernel + its combine: 2 launches)
  torch  torch.sum(buf, dtype=float32, out=...) (the library's reduction, for reference)
Each config runs once eagerly and is checked against the float64 sum of buffer 0 (rel. err < 1e-3,
PASS / FAIL), then 61 calls (call i reads buffer i) are captured in one graph, replayed 3x to warm
up, then 20x timed (CUDA events); per call = median / 61. The best passing config per (L, variant)
is marked `best`. JSON: OUT/probe-sol.json (GPU, UTC date, commit, floor, every row).

  PYTHONPATH=src python3 benchmarks/probe_sol.py --out $OUT          # on the H200 (~2-3 min)
  TRITON_INTERPRET=1 python3 benchmarks/probe_sol.py --self-check    # CPU, tiny sizes, no timing
Sweep flags: --contexts --programs --persistent --block-rows --stages --warps --loaders (comma
lists). The self-check needs an interpreter that takes a program_id-derived loop bound (Triton
3.9 does; 3.6's fails on it with NumPy 2.4).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
if "--self-check" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the triton import
os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # no host TMA descriptors: the `ptr` loader only
    TensorDescriptor = None

D = 576
CHUNKS = D // 64
FLOOR_BPS = 4.24e12
CALLS = 61


@triton.jit
def _bounds(n_blocks, per_prog, STRIDE: tl.constexpr):
    pid = tl.program_id(0)
    if STRIDE:
        return pid, n_blocks, tl.num_programs(0)
    else:
        lo = pid * per_prog
        return lo, tl.minimum(lo + per_prog, n_blocks), 1


@triton.jit
def _sum_ptr(X, PART, n_elems, n_blocks, per_prog, BLOCK_ROWS: tl.constexpr, STRIDE: tl.constexpr,
             MASKED: tl.constexpr, STAGES: tl.constexpr):
    CH: tl.constexpr = BLOCK_ROWS * 64  # a block = 9 contiguous chunks of CH elements
    offs = tl.arange(0, CH)
    acc = tl.zeros([CH], dtype=tl.float32)
    lo, hi, step = _bounds(n_blocks, per_prog, STRIDE)
    for b in tl.range(lo, hi, step, num_stages=STAGES):  # explicit: without it nothing pipelines
        base = tl.cast(b, tl.int64) * (BLOCK_ROWS * 576)
        for c in tl.static_range(9):
            o = base + c * CH + offs
            if MASKED:
                x = tl.load(X + o, mask=o < n_elems, other=0.0)
            else:
                x = tl.load(X + o)
            acc += x.to(tl.float32)
    tl.store(PART + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _sum_tma(desc, PART, n_blocks, per_prog, BLOCK_ROWS: tl.constexpr, STRIDE: tl.constexpr,
             STAGES: tl.constexpr):
    acc = tl.zeros([BLOCK_ROWS, 64], dtype=tl.float32)
    lo, hi, step = _bounds(n_blocks, per_prog, STRIDE)
    for b in tl.range(lo, hi, step, num_stages=STAGES):  # explicit: without it nothing pipelines
        for c in tl.static_range(9):  # TMA zero-fills rows past the end
            acc += desc.load([b * BLOCK_ROWS, c * 64]).to(tl.float32)
    tl.store(PART + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _combine(PART, OUT, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(OUT, tl.sum(tl.load(PART + o, mask=o < n, other=0.0), axis=0))


def make_call(cfg: dict, buf: torch.Tensor, part: torch.Tensor, out: torch.Tensor | None):
    """A no-argument launcher of config `cfg` over `buf` writing partials to `part` ([P] fp32) and,
    when `out` is given ([1] fp32), the combine into it (variant `two`)."""
    L, br, P = buf.shape[0], cfg["block_rows"], cfg["programs"]
    n_blocks = triton.cdiv(L, br)
    per_prog = triton.cdiv(n_blocks, P)
    kw = {"num_warps": cfg["warps"], "num_stages": cfg["stages"]}
    stride = cfg["grid"] == "stride"
    if cfg["loader"] == "tma":
        desc = TensorDescriptor.from_tensor(buf, [br, 64])
        first = lambda: _sum_tma[(P,)](desc, part, n_blocks, per_prog, BLOCK_ROWS=br, STRIDE=stride,
                                       STAGES=cfg["stages"], **kw)
    else:
        masked = L % br != 0
        first = lambda: _sum_ptr[(P,)](buf, part, L * D, n_blocks, per_prog, BLOCK_ROWS=br, STRIDE=stride,
                                       MASKED=masked, STAGES=cfg["stages"], **kw)
    if out is None:
        return first
    block = triton.next_power_of_2(P)

    def both():
        first()
        _combine[(1,)](part, out, P, BLOCK=block, num_warps=4)
    return both


def configs(args) -> list[dict]:
    loaders = [x for x in args.loaders if x != "tma" or TensorDescriptor is not None]
    grids = [("split", p) for p in args.programs] + [("stride", p) for p in args.persistent]
    return [{"loader": ld, "block_rows": br, "stages": st, "warps": w, "grid": g, "programs": p}
            for ld in loaders for br in args.block_rows for st in args.stages for w in args.warps
            for g, p in grids]


def tag(cfg: dict) -> str:
    return f"{cfg['loader']} r{cfg['block_rows']} s{cfg['stages']} w{cfg['warps']} {cfg['grid']} P{cfg['programs']}"


def rel_err(got: float, ref: float) -> float:
    return abs(got - ref) / max(abs(ref), 1e-30)


def self_check() -> int:
    """Kernels `one` and `two` on CPU under TRITON_INTERPRET=1 against torch.sum (no graph, no timing)."""
    torch.manual_seed(0)
    ok = True
    for L in (256, 200):  # 200: a partial last block (masked loads / TMA zero-fill)
        bufs = [torch.rand(L, D).to(torch.bfloat16) for _ in range(3)]
        for cfg in configs(argparse.Namespace(loaders=["ptr", "tma"], block_rows=[32, 64], stages=[3],
                                              warps=[4], programs=[4, 8], persistent=[3])):
            P, e1, e2 = cfg["programs"], 0.0, 0.0  # P=8 > 4 blocks of 64 rows: idle programs
            for buf in bufs:
                ref = buf.double().sum().item()
                part, out = torch.zeros(P), torch.zeros(1)
                make_call(cfg, buf, part, None)()
                e1 = max(e1, rel_err(part.double().sum().item(), ref))
                part.zero_()
                make_call(cfg, buf, part, out)()
                e2 = max(e2, rel_err(out.item(), ref))
            good = e1 < 1e-3 and e2 < 1e-3
            ok &= good
            print(f"L={L} x{len(bufs)} {tag(cfg):<28} one {e1:.1e} two {e2:.1e} {'PASS' if good else 'FAIL'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def time_graph(calls: list, reps: int, warmup: int) -> float:
    """Per-call us: one graph of `calls`, `warmup` replays, median of `reps` timed replays / len(calls)."""
    from benchutil import replay_us

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    us = replay_us(g, reps, len(calls))
    del g
    return us


def run_context(L: int, args, rows: list) -> None:
    nbytes = L * D * 2
    floor_us = nbytes / FLOOR_BPS * 1e6
    t0 = time.time()
    print(f"\n== L={L}: allocating {args.calls} x {nbytes / 1e6:.1f} MB (floor {floor_us:.2f} us/call)", flush=True)
    bufs = [torch.rand(L, D, device="cuda", dtype=torch.bfloat16) for _ in range(args.calls)]
    ref = bufs[0].double().sum().item()
    torch.cuda.synchronize()
    print(f"   allocated in {time.time() - t0:.1f} s", flush=True)

    def record(variant, cfg, calls, result):
        row = {"L": L, "variant": variant, "config": tag(cfg) if cfg else "torch.sum", **(cfg or {}),
               "bytes": nbytes, "floor_us": floor_us}
        try:
            calls[0]()
            torch.cuda.synchronize()
            err = rel_err(result(), ref)
            row.update(rel_err=err, check="PASS" if err < 1e-3 else "FAIL")
            us = time_graph(calls, args.reps, args.warmup)
            row.update(us=us, tbs=nbytes / us / 1e6, frac=floor_us / us)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: keep the other configs
            row.update(check="ERROR", error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(line(row), flush=True)

    outs = torch.zeros(args.calls, 1, device="cuda")
    record("torch", None, [lambda b=b, o=o: torch.sum(b.view(-1), 0, dtype=torch.float32, out=o[0])
                           for b, o in zip(bufs, outs)], lambda: outs[0, 0].item())
    for cfg in configs(args):
        parts = torch.zeros(args.calls, cfg["programs"], device="cuda")
        record("one", cfg, [make_call(cfg, b, p, None) for b, p in zip(bufs, parts)],
               lambda parts=parts: parts[0].double().sum().item())
        record("two", cfg, [make_call(cfg, b, p, o) for b, p, o in zip(bufs, parts, outs)],
               lambda: outs[0, 0].item())
    del bufs
    torch.cuda.empty_cache()
    print(f"   L={L} done in {time.time() - t0:.1f} s", flush=True)


def line(r: dict) -> str:
    s = f"{r['L']:>7} {r['variant']:<5} {r['config']:<30}"
    if "us" in r:
        return s + f" {r['us']:>8.2f} {r['tbs']:>6.2f} {r['frac']:>6.3f} {r['check']}"
    return s + f" {r['check']} {r.get('error', '')}"


def header() -> str:
    return f"{'L':>7} {'var':<5} {'config':<30} {'us/call':>8} {'TB/s':>6} {'floor':>6} check"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p.add_argument("--self-check", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny sizes")
    p.add_argument("--contexts", type=ints, default=[32768, 65536, 131072, 262144])
    p.add_argument("--programs", type=ints, default=[132, 264, 528], help="grids of the contiguous split")
    p.add_argument("--persistent", type=ints, default=[132], help="grids of the strided persistent loop")
    p.add_argument("--block-rows", type=ints, default=[32, 64])
    p.add_argument("--stages", type=ints, default=[1, 3, 4], help="1: direct loads, no pipelining")
    p.add_argument("--warps", type=ints, default=[4])
    p.add_argument("--loaders", type=lambda s: s.split(","), default=["tma", "ptr"])
    p.add_argument("--calls", type=int, default=CALLS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    if args.self_check:
        return self_check()
    if not torch.cuda.is_available():
        print("no CUDA device", flush=True)
        return 2
    print(f"{torch.cuda.get_device_name(0)} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{len(configs(args))} configs x (one, two) + torch | {args.calls} calls a graph", flush=True)
    print(header())
    rows, t0 = [], time.time()
    for L in args.contexts:
        run_context(L, args, rows)
    for L in args.contexts:
        for v in ("one", "two", "torch"):
            ok = [r for r in rows if r["L"] == L and r["variant"] == v and r["check"] == "PASS"]
            if ok:
                min(ok, key=lambda r: r["us"])["best"] = True
    print(f"\nbest per (L, variant); floor = bytes / {FLOOR_BPS:.3g} B/s\n{header()}")
    for r in rows:
        if r.get("best"):
            print(line(r))
    try:
        from treeflash.bench.sweep import git_commit
        commit = git_commit()
    except Exception:  # noqa: BLE001 - the package may not import on a bare device copy
        commit = os.environ.get("TREEFLASH_COMMIT", "unknown")
    doc = {"gpu": torch.cuda.get_device_name(0),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit, "floor_bps": FLOOR_BPS, "torch": torch.__version__, "triton": triton.__version__,
           "calls": args.calls, "reps": args.reps, "warmup": args.warmup, "wall_s": time.time() - t0,
           "rows": rows}
    path = Path(args.out) / "probe-sol.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
