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
  dyn    `one` (`ptr`, P programs) taking blocks dynamically: CHUNK consecutive blocks per relaxed
         int32 atomic on the call's counter (one per buffer; one int32 tensor of 61), the next grab
         issued before the current chunk's loads; the chunk loop pipelines with tl.range's num_stages.
         The graph starts with ONE counters.zero_() (memset): per call includes 1/61 of it
  torch  torch.sum(buf, dtype=float32, out=...) (the library's reduction, for reference)
  paged  `one` (`ptr`) through a page table like the cache's (pages of 64 rows, an int32 table of a
         random permutation): a program loads the row count `total` (1-element int32 device tensor),
         derives its share of pages (`split`: contiguous, `stride`); a block loads its page id, then rows
  paged2 `paged` + a partial of R=8 rows x 512 bf16 + R fp32 LSEs a program ([R, P, 512] / [R, P],
         one workspace; empty: 0 / -inf) + a combine like ours: grid (R, 512 // 32), 4 warps, each
         merges its row's P partials x 32 columns (max / exp2 / weighted sum, BLOCK_S next_pow2(P))
  paged2len  `paged2` whose combine loads `total` too and merges min(P, cdiv(pages, pages a program))
Paged variants: only ptr r32 s3 w4 split+stride P132 unless --paged-configs sweep; L % 64 == 0 (GPU).
Each config runs once eagerly and is checked against the float64 sum of buffer 0 (rel. err < 1e-3;
paged2*: + the merge against torch's of the same partials, < 1e-2; PASS / FAIL), then 61 calls (call
i reads buffer i) are captured in one graph, replayed 3x to warm up, then 20x timed (CUDA events);
per call = median / 61. The best passing config per (L, variant) is marked `best`. JSON:
OUT/probe-sol.json (GPU, UTC date, commit, floor, every row).

  PYTHONPATH=src python3 benchmarks/lab/probe_sol.py --out $OUT          # on the H200 (~2-3 min)
  TRITON_INTERPRET=1 python3 benchmarks/lab/probe_sol.py --self-check    # CPU, tiny sizes, no timing
  PYTHONPATH=src python3 benchmarks/lab/probe_sol.py --out $OUT --variants paged,paged2,paged2len
Sweep flags: --variants --contexts --programs --persistent --block-rows --stages --warps --loaders
(comma lists). The self-check needs an interpreter that takes a program_id-derived loop bound (Triton
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: benchutil, compile_v5
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
PAGE = 64  # rows a page of the paged variants
R = 8  # partial rows a program (paged2*): 8 heads x 1 node
VDIM = 512  # partial columns (the latent's value part)
MERGE_COLS = 32  # columns a combine program
VARIANTS = ("one", "two", "torch", "paged", "paged2", "paged2len", "dyn")
PAGED = VARIANTS[3:6]


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
        acc = _add_block(X, acc, offs, tl.cast(b, tl.int64) * (BLOCK_ROWS * 576), n_elems, CH, MASKED)
    tl.store(PART + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _add_block(X, acc, offs, base, n_elems, CH: tl.constexpr, MASKED: tl.constexpr):
    """acc + the block at element `base`: 9 contiguous chunks of CH elements (masked past n_elems)."""
    for c in tl.static_range(9):
        o = base + c * CH + offs
        if MASKED:
            x = tl.load(X + o, mask=o < n_elems, other=0.0)
        else:
            x = tl.load(X + o)
        acc += x.to(tl.float32)
    return acc


@triton.jit
def _sum_dyn(X, PART, CNT, IDX, n_elems, n_blocks, BLOCK_ROWS: tl.constexpr, CHUNK: tl.constexpr,
             MASKED: tl.constexpr, STAGES: tl.constexpr):
    CH: tl.constexpr = BLOCK_ROWS * 64
    offs = tl.arange(0, CH)
    acc = tl.zeros([CH], dtype=tl.float32)
    blk = tl.atomic_add(CNT + IDX, CHUNK, sem="relaxed")
    while blk < n_blocks:
        nxt = tl.atomic_add(CNT + IDX, CHUNK, sem="relaxed")  # in flight while this chunk loads
        for j in tl.range(0, CHUNK, num_stages=STAGES):  # blocks past the end: masked (o >= n_elems)
            acc = _add_block(X, acc, offs, tl.cast(blk + j, tl.int64) * (BLOCK_ROWS * 576), n_elems,
                             CH, MASKED)
        blk = nxt
    tl.store(PART + tl.program_id(0), tl.sum(acc, axis=0))


def make_dyn(cfg: dict, buf: torch.Tensor, part: torch.Tensor, cnt: torch.Tensor, idx: int):
    """A launcher of `dyn` over `buf` taking blocks from counter cnt[idx] (zero before each call)."""
    L, br, ch = buf.shape[0], cfg["block_rows"], cfg["chunk"]
    return lambda: _sum_dyn[(cfg["programs"],)](
        buf, part, cnt, idx, L * D, triton.cdiv(L, br), BLOCK_ROWS=br, CHUNK=ch, MASKED=L % (br * ch) != 0,
        STAGES=cfg["stages"], num_warps=cfg["warps"], num_stages=cfg["stages"])


def dyn_configs(args) -> list[dict]:
    return [{"loader": "ptr", "block_rows": 32, "stages": 3, "warps": 4, "grid": f"dyn{c}", "programs": 132,
             "chunk": c} for c in args.dyn_chunk]


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


@triton.jit
def _paged_share(TOTAL, STRIDE: tl.constexpr):
    """(first page, page step, pages) of this program from the device row count; and that count."""
    pid, nprog, total = tl.program_id(0), tl.num_programs(0), tl.load(TOTAL)
    n_pages = tl.cdiv(total, 64)
    if STRIDE:
        return pid, nprog, tl.cdiv(tl.maximum(n_pages - pid, 0), nprog), total
    else:
        per = tl.cdiv(n_pages, nprog)
        lo = pid * per
        return lo, 1, tl.maximum(tl.minimum(n_pages - lo, per), 0), total


@triton.jit
def _paged_sum(X, PT, TOTAL, PART, PO, PLSE, BLOCK_ROWS: tl.constexpr, STRIDE: tl.constexpr,
               MASKED: tl.constexpr, STAGES: tl.constexpr, PARTIALS: tl.constexpr, R: tl.constexpr):
    CH: tl.constexpr = BLOCK_ROWS * 64  # a block = 9 contiguous chunks of CH elements of one page
    BPP: tl.constexpr = 64 // BLOCK_ROWS  # blocks a page
    offs = tl.arange(0, CH)
    acc = tl.zeros([CH], dtype=tl.float32)
    first, step, count, total = _paged_share(TOTAL, STRIDE)
    for i in tl.range(0, count * BPP, num_stages=STAGES):
        page = first + (i // BPP) * step
        row0 = (i % BPP) * BLOCK_ROWS  # in the page
        phys = tl.load(PT + page)
        base = (tl.cast(phys, tl.int64) * 64 + row0) * 576
        lim = (total - page * 64 - row0) * 576  # valid elements of this block (MASKED)
        for c in tl.static_range(9):
            o = c * CH + offs
            if MASKED:
                x = tl.load(X + base + o, mask=o < lim, other=0.0)
            else:
                x = tl.load(X + base + o)
            acc += x.to(tl.float32)
    s, pid, nprog = tl.sum(acc, axis=0), tl.program_id(0), tl.num_programs(0)
    tl.store(PART + pid, s)
    if PARTIALS:  # R x 512 bf16 values and R fp32 LSEs; an empty program: 0 and -inf
        r, col = tl.arange(0, R), tl.arange(0, 512)
        # distinct by program, row and column, so that a misplaced or dropped partial shows
        val = s * 1e-6 + ((pid % 5) * 4 + r[:, None] + col[None, :] % 16).to(tl.float32)
        val = tl.where(count > 0, val, 0.0)
        lse = tl.where(count > 0, s * 1e-6 + (pid % 3) + r.to(tl.float32) * 0.25, float("-inf"))
        tl.store(PO + (r[:, None] * nprog + pid) * 512 + col[None, :], val.to(tl.bfloat16))
        tl.store(PLSE + r * nprog + pid, lse)


@triton.jit
def _merge(PO, PLSE, OUT, TOTAL, P, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
           USE_LEN: tl.constexpr, STRIDE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if USE_LEN:  # only the partials that can hold keys (the share rule of _paged_share)
        n_pages = tl.cdiv(tl.load(TOTAL), 64)
        if STRIDE:
            n_valid = tl.minimum(n_pages, P)
        else:
            per = tl.maximum(tl.cdiv(n_pages, P), 1)
            n_valid = tl.minimum(tl.cdiv(n_pages, per), P)
    else:
        n_valid = P
    s_ok = tl.arange(0, BLOCK_S) < n_valid
    p_row = row * P + tl.arange(0, BLOCK_S)
    lse = tl.load(PLSE + p_row, mask=s_ok, other=float("-inf"), eviction_policy="evict_first")
    o = tl.load(PO + p_row[:, None] * 512 + cols[None, :], mask=s_ok[:, None], other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty partials (-inf) weigh 0
    den = tl.sum(w, 0)
    tl.store(OUT + row * 512 + cols, (tl.sum(w[:, None] * o, 0) / tl.where(den == 0.0, 1.0, den)).to(tl.bfloat16))


def make_paged(cfg: dict, variant: str, buf: torch.Tensor, pt: torch.Tensor, total: torch.Tensor,
               L: int, part: torch.Tensor, ws: tuple | None):
    """A launcher of `variant` (paged*) over the pages of `buf` named by `pt` ([pages] int32) and
    `total` ([1] int32 = L): sums into `part` ([P] fp32); paged2*: ws = (po, plse, out) too."""
    P, br, stride = cfg["programs"], cfg["block_rows"], cfg["grid"] == "stride"
    assert PAGE % br == 0, br
    po, plse, out = ws if variant != "paged" else (part, part, None)

    def call():
        _paged_sum[(P,)](buf, pt, total, part, po, plse, BLOCK_ROWS=br, STRIDE=stride, MASKED=L % PAGE != 0,
                         STAGES=cfg["stages"], PARTIALS=out is not None, R=R, num_warps=cfg["warps"],
                         num_stages=cfg["stages"])
        if out is not None:
            _merge[(R, VDIM // MERGE_COLS)](po, plse, out, total, P, BLOCK_S=triton.next_power_of_2(P),
                                            BLOCK_C=MERGE_COLS, USE_LEN=variant == "paged2len",
                                            STRIDE=stride, num_warps=4)
    return call


def paged_ref(buf: torch.Tensor, pt: torch.Tensor, L: int) -> float:
    """The float64 sum of the first L logical rows of the paged `buf`."""
    return buf.view(-1, PAGE, D)[pt.long()].reshape(-1, D)[:L].double().sum().item()


def merge_err(ws: tuple) -> float:
    """Max abs error of the merged rows against torch's merge of the same partials / max |ref|."""
    po, plse, out = ws
    m = plse.double().max(1, keepdim=True).values
    w = torch.exp2(plse.double() - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    ref = (w[..., None] * po.double()).sum(1) / w.sum(1, keepdim=True).clamp_min(1e-300)
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


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


def paged_configs(args) -> list[dict]:
    """The paged variants' configs: the best `one` config, or (sweep) the sweep flags' `ptr` ones."""
    if args.paged_configs == "best":
        return [{"loader": "ptr", "block_rows": 32, "stages": 3, "warps": 4, "grid": g, "programs": 132}
                for g in ("split", "stride")]
    return [c for c in configs(argparse.Namespace(**{**vars(args), "loaders": ["ptr"]}))
            if PAGE % c["block_rows"] == 0]


def tag(cfg: dict) -> str:
    return f"{cfg['loader']} r{cfg['block_rows']} s{cfg['stages']} w{cfg['warps']} {cfg['grid']} P{cfg['programs']}"


def rel_err(got: float, ref: float) -> float:
    return abs(got - ref) / max(abs(ref), 1e-30)


def self_check() -> int:
    """All kernels on CPU under TRITON_INTERPRET=1 against torch (no graph, no timing)."""
    torch.manual_seed(0)
    ok = True
    for L in (256, 200):  # 200: a partial last block (masked loads / TMA zero-fill) / page
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
        n_pages = triton.cdiv(L, PAGE)  # 4 pages; rows past L (the last page's padding): 1000
        pt, total = torch.randperm(n_pages).to(torch.int32), torch.tensor([L], dtype=torch.int32)
        pbufs = [torch.cat([torch.rand(L, D), torch.full((n_pages * PAGE - L, D), 1e3)]).to(torch.bfloat16)
                 .view(n_pages, PAGE, D)[torch.argsort(pt)].reshape(-1, D) for _ in range(2)]  # page j at pt[j]
        for cfg in configs(argparse.Namespace(loaders=["ptr"], block_rows=[32, 64], stages=[3], warps=[4],
                                              programs=[3, 4, 8], persistent=[3, 8])):
            P, errs = cfg["programs"], {v: [0.0, 0.0] for v in PAGED}  # P=3 split: 2 pages a program
            for buf in pbufs:
                ref = paged_ref(buf, pt, L)
                for v in PAGED:
                    part, ws = torch.zeros(P), (torch.zeros(R, P, VDIM).bfloat16(), torch.zeros(R, P),
                                                torch.zeros(R, VDIM).bfloat16())
                    make_paged(cfg, v, buf, pt, total, L, part, ws)()
                    e = errs[v]
                    e[:] = max(e[0], rel_err(part.double().sum().item(), ref)), max(e[1], merge_err(ws))
            good = all(e[0] < 1e-3 and e[1] < 1e-2 for e in errs.values())
            ok &= good
            print(f"L={L} x{len(pbufs)} {tag(cfg):<28} " + " ".join(
                f"{v} {e[0]:.1e}" + (f"/{e[1]:.1e}" if v != "paged" else "") for v, e in errs.items())
                + f" {'PASS' if good else 'FAIL'}")
        for P, ch in ((4, 1), (8, 1), (4, 2), (8, 4)):  # dyn: counter 1 of 3 (IDX); 200 rows: masked
            cfg, e = {"block_rows": 32, "stages": 3, "warps": 4, "programs": P, "chunk": ch}, 0.0
            for buf in bufs:
                part, cnt = torch.zeros(P), torch.zeros(3, dtype=torch.int32)
                make_dyn(cfg, buf, part, cnt, 1)()
                e = max(e, rel_err(part.double().sum().item(), buf.double().sum().item()))
            good = e < 1e-3 and cnt[0] == cnt[2] == 0
            ok &= good
            print(f"L={L} x{len(bufs)} dyn r32 P{P} chunk{ch:<14} dyn {e:.1e} {'PASS' if good else 'FAIL'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def time_graph(calls: list, reps: int, warmup: int, pre=None) -> float:
    """Per-call us: one graph of `calls` (after `pre`, e.g. a memset, once), `warmup` replays, median
    of `reps` timed replays / len(calls)."""
    from benchutil import replay_us

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        if pre is not None:
            pre()
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

    def record(variant, cfg, calls, result, merge=None, pre=None):
        if variant not in args.variants:
            return
        row = {"L": L, "variant": variant, "config": tag(cfg) if cfg else "torch.sum", **(cfg or {}),
               "bytes": nbytes, "floor_us": floor_us}
        try:
            if pre is not None:
                pre()
            calls[0]()
            torch.cuda.synchronize()
            err = rel_err(result(), ref)
            good = err < 1e-3
            if merge is not None:  # paged2*: the merged rows against torch's merge of the partials
                row["merge_err"] = merge()
                good &= row["merge_err"] < 1e-2
            row.update(rel_err=err, check="PASS" if good else "FAIL")
            us = time_graph(calls, args.reps, args.warmup, pre)
            row.update(us=us, tbs=nbytes / us / 1e6, frac=floor_us / us)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: keep the other configs
            row.update(check="ERROR", error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(line(row), flush=True)

    outs = torch.zeros(args.calls, 1, device="cuda")
    record("torch", None, [lambda b=b, o=o: torch.sum(b.view(-1), 0, dtype=torch.float32, out=o[0])
                           for b, o in zip(bufs, outs)], lambda: outs[0, 0].item())
    for cfg in configs(args) if {"one", "two"} & set(args.variants) else []:
        parts = torch.zeros(args.calls, cfg["programs"], device="cuda")
        record("one", cfg, [make_call(cfg, b, p, None) for b, p in zip(bufs, parts)],
               lambda parts=parts: parts[0].double().sum().item())
        record("two", cfg, [make_call(cfg, b, p, o) for b, p, o in zip(bufs, parts, outs)],
               lambda: outs[0, 0].item())
    for cfg in dyn_configs(args) if "dyn" in args.variants else []:  # graph: 1 memset + 61 calls
        parts, cnt = torch.zeros(args.calls, cfg["programs"], device="cuda"), torch.zeros(
            args.calls, device="cuda", dtype=torch.int32)
        record("dyn", cfg, [make_dyn(cfg, b, p, cnt, i) for i, (b, p) in enumerate(zip(bufs, parts))],
               lambda parts=parts: parts[0].double().sum().item(), pre=cnt.zero_)
    if set(PAGED) & set(args.variants) and L % PAGE:
        print(f"   L={L}: not whole pages of {PAGE} rows, no paged variants", flush=True)
    elif set(PAGED) & set(args.variants):  # one page table and one row count for all calls (layers)
        pt = torch.randperm(L // PAGE, device="cuda").to(torch.int32)
        total = torch.tensor([L], device="cuda", dtype=torch.int32)
        for cfg in paged_configs(args):
            P = cfg["programs"]
            parts = torch.zeros(args.calls, P, device="cuda")
            ws = (torch.zeros(R, P, VDIM, device="cuda", dtype=torch.bfloat16),  # one workspace
                  torch.zeros(R, P, device="cuda"), torch.zeros(R, VDIM, device="cuda", dtype=torch.bfloat16))
            for v in PAGED:
                record(v, cfg, [make_paged(cfg, v, b, pt, total, L, p, ws) for b, p in zip(bufs, parts)],
                       lambda parts=parts: parts[0].double().sum().item(),
                       None if v == "paged" else lambda ws=ws: merge_err(ws))
    del bufs
    torch.cuda.empty_cache()
    print(f"   L={L} done in {time.time() - t0:.1f} s", flush=True)


def line(r: dict) -> str:
    s = f"{r['L']:>7} {r['variant']:<9} {r['config']:<30}"
    if "us" in r:
        return s + f" {r['us']:>8.2f} {r['tbs']:>6.2f} {r['frac']:>6.3f} {r['check']}"
    return s + f" {r['check']} {r.get('error', '')}"


def header() -> str:
    return f"{'L':>7} {'var':<9} {'config':<30} {'us/call':>8} {'TB/s':>6} {'floor':>6} check"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p.add_argument("--self-check", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny sizes")
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                   help="comma list of " + ",".join(VARIANTS))
    p.add_argument("--paged-configs", choices=("best", "sweep"), default="best",
                   help="paged variants: the best `one` config, or the sweep flags (ptr, block rows | 64)")
    p.add_argument("--contexts", type=ints, default=[32768, 65536, 131072, 262144])
    p.add_argument("--programs", type=ints, default=[132, 264, 528], help="grids of the contiguous split")
    p.add_argument("--persistent", type=ints, default=[132], help="grids of the strided persistent loop")
    p.add_argument("--block-rows", type=ints, default=[32, 64])
    p.add_argument("--stages", type=ints, default=[1, 3, 4], help="1: direct loads, no pipelining")
    p.add_argument("--warps", type=ints, default=[4])
    p.add_argument("--loaders", type=lambda s: s.split(","), default=["tma", "ptr"])
    p.add_argument("--dyn-chunk", type=ints, default=[1, 2, 4], help="dyn: blocks per atomic (comma list)")
    p.add_argument("--calls", type=int, default=CALLS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    if set(args.variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(set(args.variants) - set(VARIANTS))}; known: {','.join(VARIANTS)}")
    if args.self_check:
        return self_check()
    if not torch.cuda.is_available():
        print("no CUDA device", flush=True)
        return 2
    print(f"{torch.cuda.get_device_name(0)} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{len(configs(args))} configs x (one, two) + torch, {len(paged_configs(args))} x paged* | "
          f"variants {','.join(args.variants)} | {args.calls} calls a graph" + (
              f" | dyn ptr r32 s3 w4 P132 chunk {args.dyn_chunk}: per call includes 1/{args.calls} of one "
              "counters.zero_() memset at the graph's start" if "dyn" in args.variants else ""), flush=True)
    print(header())
    rows, t0 = [], time.time()
    for L in args.contexts:
        run_context(L, args, rows)
    for L in args.contexts:
        for v in args.variants:
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
