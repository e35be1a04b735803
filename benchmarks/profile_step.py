"""Where an eager step's time goes on the GPU: launch costs, then torch.profiler tables.

    python benchmarks/profile_step.py --out DIR        (CUDA; writes DIR/profile-*.txt)

1. launch: host microseconds per launch of an empty Triton kernel (12 arguments, as our
   kernels have), of a tiny torch op, and of our MoE / verify-attention wrappers at their
   smallest shapes, each with and without a sync per call.
2. profiles (torch.profiler, CPU + CUDA): grouped MoE at 1 row on the kimi-k2-tp8 expert
   geometry; one plain decode step and one ddtree step of the kimi-k2-tp8 preset at 8k; one
   plain decode step of the embedded pair. Tables sorted by self CPU time and by CUDA time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from treeflash import kernels  # noqa: E402
from treeflash.bench.presets import build_preset, load_rig  # noqa: E402
from treeflash.bench.sweep import place_request  # noqa: E402


@triton.jit
def _empty(a, b, c, d, e, f, g, h, i, j, k, m, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < 0:
        tl.store(a + pid, tl.load(b + pid))


def per_call_us(fn, n: int, sync_each: bool) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / n


def table(prof, sort: str, rows: int = 30) -> str:
    try:
        return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60)
    except Exception:  # older/newer names of the device-time column
        return prof.key_averages().table(sort_by="device_time_total", row_limit=rows, max_name_column_width=60)


def profiled(name: str, fn, out: Path, iters: int) -> None:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    text = (f"== {name}: {iters} iterations\n-- by self CPU time\n{table(prof, 'self_cpu_time_total')}\n"
            f"-- by CUDA time\n{table(prof, 'cuda_time_total')}\n")
    (out / f"profile-{name}.txt").write_text(text)
    print(text[:6000])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=8192)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    res = {}
    x = torch.zeros(1024, device=dev)
    ints = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    res["empty_triton_us"] = per_call_us(lambda: _empty[(1,)](x, x, *ints, BLOCK=16), 2000, False)
    res["empty_triton_sync_us"] = per_call_us(lambda: _empty[(1,)](x, x, *ints, BLOCK=16), 500, True)
    res["torch_add_us"] = per_call_us(lambda: x.add_(1.0), 2000, False)
    with torch.inference_mode():
        model, _, _ = build_preset("kimi-k2-tp8", dev, dt)
        moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts_gate"))
        xs = torch.randn(1, model.cfg.hidden_size, device=dev, dtype=dt)
        w, ids = moe.gate(xs)
        args_moe = (xs, w, ids, moe.experts_gate, moe.experts_up, moe.experts_down)
        res["moe_rows1_us"] = per_call_us(lambda: kernels.moe_experts(*args_moe, impl="triton"), 200, False)
        res["moe_rows1_sync_us"] = per_call_us(lambda: kernels.moe_experts(*args_moe, impl="triton"), 100, True)
        res["moe_layer_rows1_us"] = per_call_us(lambda m=moe: m(xs), 200, False)
        print(json.dumps(res, indent=1))
        profiled("moe-rows1", lambda: kernels.moe_experts(*args_moe, impl="triton"), out, 20)
        del model, moe
        torch.cuda.empty_cache()
        rig = load_rig(None, None, "kimi-k2-tp8", dev, dt)
        for mode in ("off", "ddtree"):
            rig.tree_budget = 32 if mode == "ddtree" else None
            engine = rig.engine(mode, args.context + 256)
            place_request(engine, rig, args.context, 200, "random", 0, progress=False)
            for _ in range(3):
                engine.step()
            t0 = time.perf_counter()
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
            res[f"preset_{mode}_step_ms"] = 1e3 * (time.perf_counter() - t0) / 5
            profiled(f"preset-{mode}-step", engine.step, out, 3)
            del engine
        del rig
        torch.cuda.empty_cache()
        rig = load_rig(None, None, None, dev, dt)
        engine = rig.engine("off", 2048)
        place_request(engine, rig, 1024, 200, "prefill", 0, progress=False)
        for _ in range(3):
            engine.step()
        t0 = time.perf_counter()
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
        res["embedded_off_step_ms"] = 1e3 * (time.perf_counter() - t0) / 10
        profiled("embedded-off-step", engine.step, out, 5)
    (out / "profile-launch.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
