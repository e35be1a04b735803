"""The grouped MoE experts at decode sizes, gate_up with and without split K
(`kernels/moe_gemm.py`, `plan_split_k`): device time of one routed-experts call (routing,
gate_up, down, the top-k sum) replayed in a CUDA graph, against the bytes of the touched
experts at the device's bandwidth.

    python benchmarks/bench_moe_split.py [--out benchmarks/results] [--experts 384 --inter 256
        --hidden 7168 --top-k 8]          # the defaults: one GPU's slice of Kimi K2 under TP8

For each row count (1 = plain decode, 16-64 = a tree's verify) the routing is random (uniform,
as the sweep's random weights give), the splits are 1 (the kernel before split K), the auto
plan, and 2 / 4 / 8, each checked against the torch twin before it is timed and again after
its graph's replays (split K's tile counters must be back at zero). Prints a table
and writes JSON (GPU, date, commit, the floor of every row).

--shared adds one shared expert of the routed width (Kimi K2 / DeepSeek-V3 at TP8) and times,
for each row count: `routed` (the routed experts alone), `separate` (the routed call, then the
shared MLP as three cuBLAS GEMMs, silu, mul and the add: what MoE.forward ran before), `fused`
(the shared expert as a ninth expert of weight 1 in the same two launches, auto split plan) and
fused at the fixed --splits.
The floor then counts the shared expert's bytes too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from benchutil import graph_us, write_rows  # noqa: E402

from treeflash.bench import floors  # noqa: E402
from treeflash.kernels import moe_gemm, reference  # noqa: E402
from treeflash.kernels.testing import assert_close  # noqa: E402


def _experts(e, inter, hid, dev, dt):
    """One layer's random expert weights (gate, up [e, inter, hid], down [e, hid, inter])."""
    s = hid ** -0.5
    return ((torch.randn(e, inter, hid, device=dev) * s).to(dt), (torch.randn(e, inter, hid, device=dev) * s).to(dt),
            (torch.randn(e, hid, inter, device=dev) * inter ** -0.5).to(dt))


def _routing(t, e, hid, k, dev, dt):
    """t rows, uniform random top-k routing: (x, ids, weights, experts touched)."""
    g = torch.Generator(device=dev).manual_seed(t)
    x = torch.randn(t, hid, device=dev, generator=g).to(dt)
    ids = torch.rand(t, e, device=dev, generator=g).topk(k, dim=-1).indices
    w = torch.rand(t, k, device=dev, generator=g) + 0.1
    return x, ids, w, int((torch.bincount(ids.reshape(-1), minlength=e) > 0).sum())


def _checked_us(call, want, dt, what: str, sets: int, calls: int) -> float:
    """us a call of call(i) (i cycling through `sets` weight sets) replayed in a CUDA graph;
    call(0) checked against want before and after the replays (split K's tile counters must be
    back at zero, else the call after them is wrong)."""
    assert_close(call(0), want, dt, what)
    it = iter(range(10 ** 9))
    us = graph_us(lambda: call(next(it) % sets), calls=calls)
    assert_close(call(0), want, dt, f"{what}, after the graph's replays")
    return us


def _record(row: dict, key: str, name: str, us: float, floor_us: float) -> str:
    """row[key + "_us"], row[key + "_x_floor"]; the table's cell."""
    row[f"{key}_us"] = us
    row[f"{key}_x_floor"] = us / floor_us
    return f" {name} {us:6.1f} ({us / floor_us:4.2f}x)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=384)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--splits", default="1,auto,2,4,8")
    p.add_argument("--calls", type=int, default=16, help="calls a graph")
    p.add_argument("--layers", type=int, default=4,
                   help="weight sets the calls cycle through (4 x 4.2 GB at the defaults: no L2 reuse)")
    p.add_argument("--shared", action="store_true", help="time the shared expert: separate vs in the call")
    p.add_argument("--tiles", default="", help="with --shared: more fused variants at these tiles, "
                   "'gate_up BLOCK_N:BLOCK_K:down BLOCK_N:BLOCK_K:stages' comma-separated (auto split)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.shared:
        return shared_main(args, argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    bw = floors.default_ceilings(dev, dt).bandwidth
    e, inter, hid, k = args.experts, args.inter, args.hidden, args.top_k
    # weight sets the graph's calls cycle through, as a model's layers do: nothing stays in L2
    layers = [_experts(e, inter, hid, dev, dt) for _ in range(args.layers)]
    per_expert = 3 * inter * hid * 2
    sms = moe_gemm._num_sms(dev.index or 0)
    rows_out = []
    print(f"{torch.cuda.get_device_name()}: {e} experts, inter {inter}, hidden {hid}, top {k}, "
          f"{sms} SMs, {bw / 1e12:.2f} TB/s; us a call (x the touched experts' bytes at that bandwidth)")
    for t in (int(r) for r in args.rows.split(",")):
        x, ids, w, touched = _routing(t, e, hid, k, dev, dt)
        floor_us = 1e6 * touched * per_expert / bw
        auto = moe_gemm.plan_split_k(t * k, e, inter, hid, *moe_gemm.GPU_TILES[:2], sms)
        row = {"rows": t, "pairs": t * k, "touched_experts": touched, "floor_us": floor_us,
               "auto_split_k": auto}
        ref = reference.moe_experts(x, w, ids, *layers[0])
        line = f"rows {t:3d} touched {touched:3d} floor {floor_us:6.1f} us | auto = {auto}:"
        for name in args.splits.split(","):
            split = auto if name == "auto" else int(name)

            def call(i, split=split, x=x, w=w, ids=ids):
                return moe_gemm.moe_experts_triton(x, w, ids, *layers[i], split_k=split)

            us = _checked_us(call, ref, dt, f"rows {t} split {split}", args.layers, args.calls)
            line += _record(row, f"split_{name}", name, us, floor_us)
        print(line, flush=True)
        rows_out.append(row)
    write_rows(args.out, "moe-split", rows_out, experts=e, inter=inter, hidden=hid, top_k=k,
               bandwidth=bw, command="python benchmarks/bench_moe_split.py " + " ".join(argv or sys.argv[1:]))
    return 0


def shared_main(args, argv) -> int:
    dev, dt = torch.device("cuda"), torch.bfloat16
    bw = floors.default_ceilings(dev, dt).bandwidth
    e, inter, hid, k = args.experts, args.inter, args.hidden, args.top_k
    s = hid ** -0.5
    layers = [_experts(e, inter, hid, dev, dt) for _ in range(args.layers)]
    shared = [((torch.randn(inter, hid, device=dev) * s).to(dt), (torch.randn(inter, hid, device=dev) * s).to(dt),
               (torch.randn(hid, inter, device=dev) * inter ** -0.5).to(dt)) for _ in range(args.layers)]
    per_expert = 3 * inter * hid * 2
    sms = moe_gemm._num_sms(dev.index or 0)
    rows_out = []
    print(f"{torch.cuda.get_device_name()}: {e} experts + 1 shared, inter {inter}, hidden {hid}, top {k}, "
          f"{sms} SMs, {bw / 1e12:.2f} TB/s; us a call (x the bytes of the touched + shared experts)")
    for t in (int(r) for r in args.rows.split(",")):
        x, ids, w, touched = _routing(t, e, hid, k, dev, dt)
        floor_us = 1e6 * (touched + 1) * per_expert / bw
        sh_blocks = (t + moe_gemm.BLOCK_M - 1) // moe_gemm.BLOCK_M
        auto = moe_gemm.plan_split_k(t * k, e, inter, hid, *moe_gemm.GPU_TILES[:2], sms, sh_blocks)
        row = {"rows": t, "pairs": t * k, "touched_experts": touched, "floor_us": floor_us,
               "auto_split_k_fused": auto}
        ref = reference.moe_experts(x, w, ids, *layers[0], shared=shared[0])
        line = f"rows {t:3d} touched {touched:3d}+1 floor {floor_us:6.1f} us | auto = {auto}:"

        def separate(x, w, ids, i, split=None):
            sg, su, sd = shared[i]
            out = moe_gemm.moe_experts_triton(x, w, ids, *layers[i], split_k=split)
            return out + F.linear(F.silu(F.linear(x, sg)) * F.linear(x, su), sd)

        def fused(x, w, ids, i, split=None):
            return moe_gemm.moe_experts_triton(x, w, ids, *layers[i], split_k=split, shared=shared[i])

        def routed(x, w, ids, i, split=None):
            return moe_gemm.moe_experts_triton(x, w, ids, *layers[i], split_k=split)

        variants = [("routed", routed, None), ("separate", separate, None), ("fused", fused, None)]
        variants += [(f"fused_s{n}", fused, int(n)) for n in args.splits.split(",") if n not in ("auto", "1")]
        for spec in filter(None, args.tiles.split(",")):
            tiles = tuple(int(v) for v in spec.split(":"))
            variants.append((f"t{spec}", lambda x, w, ids, i, split=None, tiles=tiles: moe_gemm.moe_experts_triton(
                x, w, ids, *layers[i], split_k=split, shared=shared[i], tiles=tiles), None))
        ref_routed = reference.moe_experts(x, w, ids, *layers[0])
        for name, fn, split in variants:
            want = ref_routed if name == "routed" else ref

            def call(i, fn=fn, split=split, x=x, w=w, ids=ids):
                return fn(x, w, ids, i, split)

            try:
                us = _checked_us(call, want, dt, f"rows {t} {name}", args.layers, args.calls)
            except Exception as exc:  # noqa: BLE001 - a tile that does not launch is a result, not the end
                if not name.startswith("t"):
                    raise
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                line += f" {name} error"
                continue
            line += _record(row, name, name, us, floor_us)
        print(line, flush=True)
        rows_out.append(row)
    write_rows(args.out, "moe-shared", rows_out, experts=e, inter=inter, hidden=hid, top_k=k,
               bandwidth=bw, command="python benchmarks/bench_moe_split.py " + " ".join(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
