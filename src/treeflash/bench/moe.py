"""`treeflash bench moe`: one MoE layer's experts, INT4 (W4A16) beside bf16 and humming-kernels,
every figure against its floor.

Geometry (defaults): Kimi K2 / K2.6 under TP8: 384 routed experts, top-8, hidden 7168, expert
intermediate 2048 / 8 = 256, one shared expert of 256 columns (bf16), INT4 groups of 32 along the
input dim with bf16 scales (compressed-tensors pack-quantized). The rows of each row count are
routed by a real router (sigmoid scores, noaux_tc with a correction bias, routed scaling 2.827:
`kernels.reference.moe_gate`), so the touched experts are what routing gives. Every variant is
checked on the device against the torch reference (bf16 tolerance; for INT4, NaN scales in every
untouched expert of the checked layer), then timed as one call a layer in a CUDA graph cycling
over --layers weight sets (distinct weights: nothing stays in L2), and checked again after.

Floors, per layer and call: bytes = touched experts x an expert's bytes (INT4: packed words +
scales; bf16: weights) + the shared expert's bf16 weights + x and the output; byte floor = bytes /
the copy rate; matmul floor = 2 x rows x (top_k x 3 x inter + 3 x shared) x hidden / the bf16
matmul rate (both measured on this GPU, `bench.floors.default_ceilings`); floor = the larger;
frac = floor / time (1.00 = at the floor). At Kimi K2 TP8 the byte floor is the larger up to
~3k rows (~20 rows an expert at 1024 rows is still below the H100's ~230 flop/byte ridge).

Variants (--variants): bf16 (`kernels/moe_gemm.py` on the same layer in bf16), portable (the
portable W4A16 kernel at its default tiles and split: the first measured default), mma (the MMA
kernel as `kernels/moe_w4a16/dispatch.py` sets it up), humming (vLLM's indexed W4A16 MoE on the
same INT4 tensors, `kernels/moe_w4a16/humming.py`, when it imports), and in a second pass (sweep) the MMA
kernel at each --mma-tiles and each fixed --splits. Writes one JSON (GPU, date, commit,
switches, ceilings, every figure with its floor), rewritten after each row so a cut-off run
keeps what it measured; --merge prints the table of several such files (one device call may time
the variants in separate processes, so that a kernel that faults cannot take the others' figures
with it) and the dispatch rows they support (`dispatch_rows`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

from treeflash import knobs

DEFAULT_ROWS = "1,2,4,8,16,32,64,128,256,512,1024"
SCALING = 2.827  # Kimi K2.x routed_scaling_factor


@dataclasses.dataclass(frozen=True)
class Geometry:
    experts: int
    top_k: int
    hidden: int
    inter: int
    shared_inter: int
    group: int

    def int4_expert_bytes(self) -> int:
        """Packed words (half a byte a weight) + bf16 group scales of gate, up and down."""
        values = 3 * self.inter * self.hidden
        return values // 2 + values // self.group * 2

    def bf16_expert_bytes(self) -> int:
        return 3 * self.inter * self.hidden * 2

    def shared_bytes(self) -> int:
        return 3 * self.shared_inter * self.hidden * 2

    def flops(self, rows: int) -> float:
        return 2.0 * rows * (self.top_k * 3 * self.inter + 3 * self.shared_inter) * self.hidden


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default=DEFAULT_ROWS, help=f"row counts (default {DEFAULT_ROWS})")
    p.add_argument("--experts", type=int, default=384, help="routed experts on this GPU (default 384)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=256, help="an expert's intermediate size on this GPU (TP8: 256)")
    p.add_argument("--shared-inter", type=int, default=256, help="the shared expert's columns (0: none)")
    p.add_argument("--group", type=int, default=32, help="INT4 group size along the input dim")
    p.add_argument("--layers", type=int, default=8, help="INT4 weight sets the graph cycles through")
    p.add_argument("--bf16-layers", type=int, default=3, help="bf16 weight sets (4.2 GB each at the defaults)")
    p.add_argument("--calls", type=int, default=16, help="calls a graph (cycling the weight sets)")
    p.add_argument("--replays", type=int, default=5, help="graph replays (median)")
    p.add_argument("--variants", default="bf16,portable,mma,humming,sweep",
                   help="what to time: bf16, portable, mma, humming, sweep (the second pass)")
    p.add_argument("--mma-tiles", default="", help="second pass: MMA tile configs, comma-separated "
                   "BLOCK_M:GU_N:DOWN_N:NJ:WARPS:DEPTH[@LO-HI] (@: only at LO <= rows <= HI)")
    p.add_argument("--splits", default="", help="second pass: fixed gate_up split counts for the default MMA tiles")
    p.add_argument("--split-max-rows", type=int, default=64, help="rows up to which --splits are timed")
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--no-humming", action="store_true")
    p.add_argument("--budget-s", type=float, default=0.0, help="stop timing new variants after this (0: none)")
    p.add_argument("--bandwidth", type=float, default=None, help="copy ceiling, bytes/s (default: measured)")
    p.add_argument("--matmul", type=float, default=None, help="bf16 matmul ceiling, flop/s (default: measured)")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu (cpu: the Triton interpreter, eager)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results", help="JSON path, or a folder for moe-<stamp>.json")
    p.add_argument("--tag", default="", help="suffix of the JSON file name")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="print the table and the dispatch rows of these result files (no timing)")


# ---------------------------------------------------------------- weights and routing
def _int4(e: int, n: int, k: int, group: int, g: torch.Generator):
    """Random INT4 words (every nibble) and bf16 scales of ~1 / (4 sqrt(k)) (unit-scale rows)."""
    from treeflash.kernels.int4 import Int4Weight

    dev = g.device
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=dev, generator=g).view(torch.int32)
    scale = ((torch.rand(e, n, k // group, device=dev, generator=g) + 0.5) * (0.25 * k ** -0.5)).to(torch.bfloat16)
    return Int4Weight(packed, scale, group)


def _bf16(e: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(e, n, k, device=g.device, generator=g) * k ** -0.5).to(torch.bfloat16)


def make_layers(geo: Geometry, n_int4: int, n_bf16: int, device: torch.device, seed: int) -> dict:
    """Weight sets: INT4 (gate, up, down) stacks, bf16 stacks, one bf16 shared expert per INT4 set."""
    g = torch.Generator(device).manual_seed(seed)
    e, i, h = geo.experts, geo.inter, geo.hidden
    int4 = [(_int4(e, i, h, geo.group, g), _int4(e, i, h, geo.group, g), _int4(e, h, i, geo.group, g))
            for _ in range(n_int4)]
    bf16 = [(_bf16(e, i, h, g), _bf16(e, i, h, g), _bf16(e, h, i, g)) for _ in range(n_bf16)]
    shared = [None] * n_int4
    if geo.shared_inter:
        si = geo.shared_inter
        shared = [(_bf16(1, si, h, g)[0], _bf16(1, si, h, g)[0], _bf16(1, h, si, g)[0]) for _ in range(n_int4)]
    return {"int4": int4, "bf16": bf16, "shared": shared}


def route(geo: Geometry, rows: int, router: tuple, g: torch.Generator):
    """rows of x (bf16) routed by the router (weight [E, hidden] float32, bias [E]): (x, weights, ids)."""
    from treeflash.kernels import reference

    x = torch.randn(rows, geo.hidden, device=g.device, generator=g).to(torch.bfloat16)
    logits = x.float() @ router[0].T
    w, ids = reference.moe_gate(logits, router[1], "sigmoid", "noaux_tc", 1, 1, geo.top_k, True, SCALING)
    return x, w, ids


@contextlib.contextmanager
def poisoned(layer: tuple, ids: torch.Tensor):
    """NaN in the scales of every expert no pair picked, for the check; restored after."""
    untouched = torch.ones(layer[0].packed.shape[0], dtype=torch.bool, device=ids.device)
    untouched[ids.reshape(-1)] = False
    saved = [w.scale[untouched].clone() for w in layer]
    for w in layer:
        w.scale[untouched] = float("nan")
    try:
        yield
    finally:
        for w, s in zip(layer, saved):
            w.scale[untouched] = s


# ---------------------------------------------------------------- timing and checks
def time_us(call, layers: int, calls: int, replays: int, device: torch.device) -> float:
    """us a call of call(i), i cycling through the weight sets: the median replay of a CUDA graph of
    `calls` calls / calls; on the CPU the mean of eager calls."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for i in range(calls):
            call(i % layers)
        return (time.perf_counter() - t0) * 1e6 / calls
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % layers)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def check(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """{"ok", "rel_err", "error"}: `kernels.testing.assert_close` at bf16 tolerance."""
    from treeflash.kernels.testing import assert_close, relative_error

    res = {"ok": True, "rel_err": relative_error(out.float(), ref.float())}
    try:
        assert_close(out, ref, torch.bfloat16, "moe")
    except AssertionError as exc:
        res.update(ok=False, error=str(exc))
    return res


def measure(name: str, call, ref, n_layers: int, args, device, floor_us: float, extra: dict | None = None) -> dict:
    """One variant: checked (call(0) against ref), timed, checked again; its record."""
    rec = dict(extra or {})
    try:
        rec["check"] = check(call(0), ref)
        rec["us"] = time_us(call, n_layers, args.calls, args.replays, device)
        rec["frac_floor"] = floor_us / rec["us"]
        after = check(call(0), ref)
        rec["check_after"] = after
        rec["ok"] = rec["check"]["ok"] and after["ok"]
    except Exception:  # noqa: BLE001 - one variant's failure must not lose the others' figures
        rec["ok"] = False
        rec["error"] = traceback.format_exc()[-1500:]
    us = f"{rec['us']:9.1f} us ({rec['frac_floor']:.2f})" if "us" in rec else "   failed"
    print(f"    {name:34s} {us}{'' if rec['ok'] else '  CHECK FAILED'}", flush=True)
    return rec


def floors_of(geo: Geometry, rows: int, touched: int, ceilings) -> dict:
    io = 2 * rows * geo.hidden * 2  # x in, out back (bf16)
    b4 = touched * geo.int4_expert_bytes() + geo.shared_bytes() + io
    b16 = touched * geo.bf16_expert_bytes() + geo.shared_bytes() + io
    flops = geo.flops(rows)
    mm = 1e6 * flops / ceilings.matmul
    f4, f16 = 1e6 * b4 / ceilings.bandwidth, 1e6 * b16 / ceilings.bandwidth
    return {"bytes_int4": b4, "bytes_bf16": b16, "flops": flops, "byte_floor_int4_us": f4, "byte_floor_bf16_us": f16,
            "matmul_floor_us": mm, "floor_int4_us": max(f4, mm), "floor_bf16_us": max(f16, mm)}


# ---------------------------------------------------------------- the run
def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench moe --device cuda: no CUDA device here (--device cpu runs the interpreter)")
    return dev


def _header(args, geo: Geometry, device: torch.device, ceilings) -> dict:
    import triton

    from treeflash.bench import floors
    from treeflash.bench.sweep import git_commit

    return {"gpu": floors.device_name(device), "device": str(device),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "switches": knobs.switched(), "torch": torch.__version__,
            "triton": triton.__version__, "geometry": dataclasses.asdict(geo),
            "expert_bytes": {"int4": geo.int4_expert_bytes(), "bf16": geo.bf16_expert_bytes(),
                             "shared_bf16": geo.shared_bytes()},
            "ceilings": {"bytes_per_s": ceilings.bandwidth, "flops_per_s": ceilings.matmul, "source": ceilings.source},
            "floor": "max((touched x expert bytes + shared bf16 bytes + x and out) / bytes_per_s, "
                     "2 x rows x (top_k x 3 x inter + 3 x shared_inter) x hidden / flops_per_s), one layer",
            "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}, "rows": []}


def _out_path(args) -> Path:
    out = Path(args.out)
    if out.suffix == ".json":
        out.parent.mkdir(parents=True, exist_ok=True)
        return out
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return out / f"moe-{stamp}{('-' + args.tag) if args.tag else ''}.json"


def _humming(layers: dict, args, res: dict, device: torch.device):
    """humming's experts for every INT4 weight set, or None (the reason in res["humming"])."""
    from treeflash.kernels.moe_w4a16 import humming as moe_humming

    if args.no_humming:
        res["humming"] = {"skipped": "--no-humming"}
        return None
    err = moe_humming.import_error()
    if err:
        res["humming"] = {"unavailable": err}
        print(f"humming-kernels: unavailable ({err})", flush=True)
        return None
    t0 = time.time()
    try:
        experts = [moe_humming.HummingExperts(*w, torch.bfloat16) for w in layers["int4"]]
    except Exception:  # noqa: BLE001 - reported, the rest of the run goes on
        res["humming"] = {"version": moe_humming.version(), "error": traceback.format_exc()[-2000:]}
        print(f"humming-kernels: setup failed\n{res['humming']['error']}", flush=True)
        return None
    res["humming"] = {"version": moe_humming.version(), "setup_s": time.time() - t0}
    print(f"humming-kernels {res['humming']['version']}: {len(experts)} layers transformed in "
          f"{res['humming']['setup_s']:.1f} s", flush=True)
    return experts


def _cases(geo: Geometry, rows_list: list[int], device: torch.device, seed: int) -> list[dict]:
    """x, routing weights and ids for each row count (one router for all), the touched count."""
    g = torch.Generator(device).manual_seed(seed + 1)
    router = (torch.randn(geo.experts, geo.hidden, device=device, generator=g) * geo.hidden ** -0.5,
              (torch.rand(geo.experts, device=device, generator=g) - 0.5) * 0.1)
    cases = []
    for rows in rows_list:
        x, w, ids = route(geo, rows, router, g)
        cases.append({"rows": rows, "x": x, "w": w, "ids": ids, "touched": int(ids.unique().numel())})
    return cases


def _core(case: dict, rec: dict, layers: dict, humming, args, device) -> None:
    """Pass 1: bf16, the portable W4A16 kernel at its defaults, the MMA kernel at the dispatch's,
    humming (as --variants asks)."""
    from treeflash.kernels import moe_gemm, moe_w4a16, reference

    x, w, ids = case["x"], case["w"], case["ids"]
    sh, int4, bf16 = layers["shared"], layers["int4"], layers["bf16"]
    var, want, geo = rec["variants"], args.variants, args.geo
    if bf16 and "bf16" in want:
        ref16 = reference.moe_experts(x, w, ids, *bf16[0], shared=sh[0])
        var["bf16"] = measure("bf16 (moe_gemm)", lambda i: moe_gemm.moe_experts_triton(
            x, w, ids, *bf16[i], shared=sh[i]), ref16, len(bf16), args, device, rec["floor_bf16_us"])
    chunks = geo.shared_inter // geo.inter
    with poisoned(int4[0], ids):
        case["ref"] = ref = reference.moe_experts(x, w, ids, *int4[0], shared=sh[0])
        if "portable" in want:
            tiles, split, _ = moe_w4a16.call_plan(case["rows"], geo.top_k, geo.experts, geo.inter, geo.hidden,
                                                  chunks, device)
            var["portable"] = measure(f"portable {tiles.spec()} s{split}", lambda i: moe_w4a16.moe_experts_w4a16(
                x, w, ids, *int4[i], shared=sh[i], impl="portable"), ref, len(int4), args, device,
                rec["floor_int4_us"], {"tiles": tiles.spec(), "split": split})
        if "mma" in want:
            plan = moe_w4a16.mma.plan(case["rows"], geo.top_k, geo.experts, geo.inter, geo.hidden, chunks, device)
            var["mma"] = measure(f"mma {plan.tiles.spec()} s{plan.split_r}", lambda i: moe_w4a16.moe_experts_w4a16(
                x, w, ids, *int4[i], shared=sh[i], impl="mma"), ref, len(int4), args, device, rec["floor_int4_us"],
                {"tiles": plan.tiles.spec(), "split": plan.split_r, "slots": plan.slots})
        if humming is not None and "humming" in want:
            var["humming"] = measure("humming-kernels (+ cuBLAS shared)", lambda i: moe_w4a16.moe_experts_w4a16(
                x, w, ids, *int4[i], shared=sh[i], impl="humming", humming=humming[i]), ref, len(humming), args,
                device, rec["floor_int4_us"])


def _sweep(case: dict, rec: dict, layers: dict, args, device, t_start: float) -> None:
    """Pass 2: the MMA kernel at each --mma-tiles (planned split) and each fixed --splits (default tiles)."""
    from treeflash.kernels import moe_w4a16

    x, w, ids, ref = case["x"], case["w"], case["ids"], case["ref"]
    sh, int4 = layers["shared"], layers["int4"]
    runs = [(f"mma {spec}", tiles, None) for spec, tiles, lo, hi in _tile_specs(args.mma_tiles)
            if lo <= case["rows"] <= hi]
    if case["rows"] <= args.split_max_rows:
        runs += [(f"mma split {s}", None, int(s)) for s in args.splits.split(",") if s.strip()]
    with poisoned(int4[0], ids):
        for name, tiles, split in runs:
            if args.budget_s and time.time() - t_start > args.budget_s:
                rec["variants"][name] = {"ok": None, "skipped": "budget"}
                continue
            rec["variants"][name] = measure(name, lambda i, tiles=tiles, split=split: moe_w4a16.moe_experts_w4a16(
                x, w, ids, *int4[i], shared=sh[i], impl="mma", mma_tiles=tiles, split_k=split), ref, len(int4), args,
                device, rec["floor_int4_us"], {"tiles": tiles.spec() if tiles else None, "split": split})


def _tile_specs(text: str) -> list[tuple]:
    """--mma-tiles: (spec, MmaTiles, lo, hi) for each 'A:B:...[@LO-HI]' (no range: every row count)."""
    from treeflash.kernels.moe_w4a16.mma import MmaTiles

    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        spec, _, rows = item.partition("@")
        lo, _, hi = rows.partition("-")
        values = [int(v) for v in spec.split(":")]
        if len(values) != 6 or min(values) < 1:
            raise ValueError(f"--mma-tiles {item!r}: expected 6 positive integers separated by ':'")
        out.append((spec, MmaTiles.parse(values), int(lo or 0), int(hi or 1 << 30)))
    return out


W4A16 = ("portable", "mma")  # the names of our W4A16 variants start with one of these


def _best(rec: dict) -> None:
    """The fastest correct W4A16 variant of ours, and humming's time over the MMA default's, the
    portable's and the best's."""
    ours = {k: v for k, v in rec["variants"].items() if k.startswith(W4A16) and v.get("ok") and "us" in v}
    if ours:
        best = min(ours, key=lambda k: ours[k]["us"])
        rec["best_w4a16"], rec["best_w4a16_us"] = best, ours[best]["us"]
        rec["best_frac_floor"] = rec["floor_int4_us"] / ours[best]["us"]
    hum = rec["variants"].get("humming", {})
    if "us" in hum and hum.get("ok"):
        for name in ("mma", "portable"):
            if name in ours:
                rec[f"humming_over_{name}"] = hum["us"] / ours[name]["us"]
        if ours:
            rec["humming_over_best"] = hum["us"] / rec["best_w4a16_us"]


def run(args) -> dict:
    from treeflash.bench import floors
    from treeflash.kernels import moe_w4a16  # noqa: F401 - first: without CUDA it selects the interpreter

    device = _device(args.device)
    geo = args.geo = Geometry(args.experts, args.top_k, args.hidden, args.inter, args.shared_inter, args.group)
    if geo.shared_inter % geo.inter:
        raise ValueError(f"--shared-inter {geo.shared_inter} must be a multiple of --inter {geo.inter}")
    ceilings = floors.default_ceilings(device, torch.bfloat16, args.bandwidth, args.matmul)
    res, path, t_start = _header(args, geo, device, ceilings), _out_path(args), time.time()
    print(f"bench moe on {res['gpu']}: {geo.experts} experts top-{geo.top_k}, hidden {geo.hidden}, inter "
          f"{geo.inter}, shared {geo.shared_inter}, INT4 group {geo.group}; ceilings {ceilings.bandwidth / 1e12:.2f} "
          f"TB/s, {ceilings.matmul / 1e12:.0f} TFLOP/s ({ceilings.source})", flush=True)
    args.variants = {v.strip() for v in args.variants.split(",") if v.strip()}
    unknown = args.variants - {"bf16", "portable", "mma", "humming", "sweep"}
    if unknown:
        raise ValueError(f"--variants: unknown {sorted(unknown)}")
    _tile_specs(args.mma_tiles)  # a bad spec fails before any weight is made
    no_bf16 = args.no_bf16 or "bf16" not in args.variants
    layers = make_layers(geo, args.layers, 0 if no_bf16 else args.bf16_layers, device, args.seed)
    humming = _humming(layers, args, res, device) if "humming" in args.variants else None
    cases = _cases(geo, [int(r) for r in args.rows.split(",") if r.strip()], device, args.seed)
    for case in cases:
        rec = {"rows": case["rows"], "pairs": case["rows"] * geo.top_k, "touched": case["touched"],
               **floors_of(geo, case["rows"], case["touched"], ceilings), "variants": {}}
        res["rows"].append(rec)
        print(f"rows {rec['rows']:5d}: {rec['touched']} experts touched, INT4 floor {rec['floor_int4_us']:.1f} us "
              f"(bytes {rec['byte_floor_int4_us']:.1f}, matmul {rec['matmul_floor_us']:.1f}), bf16 floor "
              f"{rec['floor_bf16_us']:.1f} us", flush=True)
        _core(case, rec, layers, humming, args, device)
        _best(rec)
        _write(res, path, t_start)
    if "sweep" in args.variants and (args.mma_tiles or args.splits):
        print("second pass: MMA tiles and splits", flush=True)
        for i in _spread(len(cases)):  # small and large row counts alternate: a budget cut leaves no end bare
            case, rec = cases[i], res["rows"][i]
            print(f"rows {rec['rows']:5d}:", flush=True)
            _sweep(case, rec, layers, args, device, t_start)
            _best(rec)
            _write(res, path, t_start)
    print(table(res))
    print(f"wrote {path} ({res['wall_s']:.0f} s)")
    return res


def _spread(n: int) -> list[int]:
    """0, n-1, 1, n-2, ...: the second pass's order over the row counts."""
    return [i // 2 if i % 2 == 0 else n - 1 - i // 2 for i in range(n)]


def _write(res: dict, path: Path, t_start: float) -> None:
    res["wall_s"] = time.time() - t_start
    path.write_text(json.dumps(res, indent=1, default=str))


def _cell(v: dict | None) -> str:
    if not v or "us" not in v:
        return f"{'-':>15s}"
    return f"{v['us']:8.1f} {v['frac_floor']:4.2f}{'' if v.get('ok') else '!'}"


def table(res: dict) -> str:
    """us a layer and fraction of floor per variant (! = failed its check); mm: the matmul floor over
    the faster of our best and humming (the issue's large-row bar reads that fraction)."""
    lines = ["us per MoE layer (fraction of floor; INT4 variants against the INT4 floor, bf16 against its own)",
             f"{'rows':>5s} {'touched':>7s} {'int4 floor':>10s} {'bytes|mm':>13s} {'portable':>15s} {'mma':>15s} "
             f"{'best ours':>15s} {'bf16':>15s} {'humming':>15s} {'hum/mma':>8s} {'mm':>5s}  best"]
    for r in res["rows"]:
        v = r["variants"]
        best = v.get(r.get("best_w4a16", ""), None)
        ratio = f"{r['humming_over_mma']:8.2f}" if "humming_over_mma" in r else f"{'-':>8s}"
        fastest = min([c["us"] for c in (best, v.get("humming")) if c and c.get("ok") and "us" in c] or [0])
        mm = f"{r['matmul_floor_us'] / fastest:5.2f}" if fastest else f"{'-':>5s}"
        lines.append(f"{r['rows']:5d} {r['touched']:7d} {r['floor_int4_us']:10.1f} {r['byte_floor_int4_us']:6.1f}|"
                     f"{r['matmul_floor_us']:6.1f} {_cell(v.get('portable'))} {_cell(v.get('mma'))} {_cell(best)} "
                     f"{_cell(v.get('bf16'))} {_cell(v.get('humming'))} {ratio} {mm}  {r.get('best_w4a16', '')}")
    return "\n".join(lines)


def dispatch_rows(res: dict) -> str:
    """`kernels/moe_w4a16/dispatch.py`'s RULES as this run measured them: each measured row count
    takes the rows above the previous one, with its fastest correct variant of ours (a fixed split
    that won goes in as the rule's split), marked humming=True where humming was faster."""
    out = [f"# {res.get('gpu', '?')}, commit {res.get('commit', '?')}: the fastest correct W4A16 variant a row count"]
    rows = sorted((r for r in res["rows"] if "best_w4a16" in r), key=lambda r: r["rows"])
    for i, r in enumerate(rows):
        name, v = r["best_w4a16"], r["variants"][r["best_w4a16"]]
        cap = "1 << 62" if i == len(rows) - 1 else str(r["rows"])
        note = f"# {r['rows']} rows: {name} {v['us']:.1f} us ({v['frac_floor']:.2f} of the floor)"
        hum = ""
        if "humming_over_best" in r:
            note += f"; humming {r['variants']['humming']['us']:.1f} us ({r['humming_over_best']:.2f}x ours)"
            hum = ", humming=True" if r["humming_over_best"] < 1.0 else ""
        if name.startswith("portable"):
            out.append(f"Rule({cap}, PORTABLE{hum}),  {note}")
            continue
        tiles = v.get("tiles") or r["variants"].get("mma", {}).get("tiles")
        split = f", split={v['split']}" if name.startswith("mma split") else ""
        out.append(f"Rule({cap}, MMA, MmaTiles({', '.join(tiles.split(':'))}){split}{hum}),  {note}")
    return "\n".join(out)


def merge(paths: list[str]) -> dict:
    """One result from several files of one machine (variants of the same row counts side by side)."""
    merged: dict | None = None
    for path in paths:
        res = json.loads(Path(path).read_text())
        if merged is None:
            merged = res
            continue
        by_rows = {r["rows"]: r for r in merged["rows"]}
        for r in res["rows"]:
            if r["rows"] in by_rows:
                by_rows[r["rows"]]["variants"].update(r["variants"])
            else:
                merged["rows"].append(r)
        merged["rows"].sort(key=lambda r: r["rows"])
    for r in merged["rows"]:
        _best(r)
    return merged


def cmd(args) -> int:
    """`treeflash bench moe`: exit 1 when a variant failed its check. --merge: the table and the
    dispatch rows of result files, written next to the first as moe-merged.json and
    w4a16-dispatch.txt."""
    if args.merge:
        res = merge(args.merge)
        folder = Path(args.merge[0]).parent
        (folder / "moe-merged.json").write_text(json.dumps(res, indent=1, default=str))
        rows = dispatch_rows(res)
        (folder / "w4a16-dispatch.txt").write_text(rows + "\n")
        print(table(res))
        print(rows)
        return 0
    res = run(args)
    failed = [(r["rows"], k) for r in res["rows"] for k, v in r["variants"].items() if v.get("ok") is False]
    print("check:", "all ok" if not failed else f"FAILURES {failed}")
    return 1 if failed else 0
