"""How `bench kernel` times one shape of the MLA verify kernel: `layers` layer caches of one
request (page 64 in order, or page 1 shuffled over the pool: the incident's layout), the call
over them, its median single call (CUDA events, rotating over the layers so nothing sits in L2)
and the per-layer average of a CUDA graph of one call per layer (one model step), the torch
reference's time where it fits, each beside the floor (`floor_s`)."""

from __future__ import annotations

import statistics

import torch

D_LATENT, V_DIM = 576, 512


def floor_s(ctx: int, n: int, h: int, args, kv_dtype: str = "bf16") -> tuple[float, float, float]:
    from treeflash.bench.kernel_fp8 import row_bytes

    nbytes = ctx * float(row_bytes(kv_dtype))
    flops = 2.0 * n * h * ctx * (D_LATENT + V_DIM)
    return max(nbytes / args.bw, flops / args.peak), nbytes, flops


# ---------------------------------------------------------------- timing helpers
def _time_single(fn, layers: int, reps: int) -> list[float]:
    fn(0)
    fn(1 % layers)
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(reps):
        start.record()
        fn((r + 2) % layers)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if r == 0 and times[0] > 50:  # long calls: two are enough for a median
            reps = min(reps, 2)
        if r + 1 >= reps:
            break
    return times


def layers_graph(fn, layers: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph holding one call per layer over `layers` layer caches (fn(layer)), warmed on
    a side stream first and replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            fn(layer)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _time_graph(fn, layers: int, replays: int) -> list[float]:
    """Per-replay ms of `layers_graph(fn, layers)`."""
    graph = layers_graph(fn, layers)
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return times


# ---------------------------------------------------------------- layer caches
class LayerCaches:
    """`layers` layer caches of one request of `tokens` rows: page 64 in order, or page 1
    shuffled over the pool (the incident's layout). One page table serves every layer.
    kv_dtype "fp8": fp8_e4m3 rows of the same unit-normal latents (`kernel_fp8.fill_fp8`)."""

    def __init__(self, layers: int, tokens: int, mode: str, seed: int = 0, kv_dtype: str = "bf16"):
        from treeflash.bench.kernel_fp8 import fill_fp8, row_bytes

        self.page_size = 64 if mode == "contiguous" else 1
        self.kv_dtype = kv_dtype
        num_pages = -(-tokens // self.page_size) + 8
        g = torch.Generator(device="cuda").manual_seed(seed)
        if kv_dtype == "fp8":
            self.kv = torch.empty(layers, num_pages, self.page_size, row_bytes("fp8"), device="cuda",
                                  dtype=torch.uint8)
            fill_fp8(self.kv, g)
        else:
            self.kv = torch.empty(layers, num_pages, self.page_size, D_LATENT, device="cuda",
                                  dtype=torch.bfloat16)
            self.kv.normal_(generator=g)
        if mode == "contiguous":
            order = torch.arange(num_pages, device="cuda")
        else:
            order = torch.randperm(num_pages, device="cuda", generator=g)
        self.table = order[: -(-tokens // self.page_size)].to(torch.int32)[None]

    def page_table(self, rows: int) -> torch.Tensor:
        return self.table[:, : -(-rows // self.page_size)]


def _make_call(caches: LayerCaches, ctx: int, n: int, h: int, tree: str, seed: int, **kw):
    from treeflash.kernels.mla_verify import mla_verify_attention_triton
    from treeflash.kernels.testing import random_tree_masks

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, h, D_LATENT, generator=g).to("cuda", torch.bfloat16)
    mask = None if tree == "chain" else random_tree_masks(1, n, g, bushy=True).cuda()
    prefix = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    table = caches.page_table(ctx + n)
    scale = 192 ** -0.5

    def call(layer: int):
        return mla_verify_attention_triton(q, caches.kv[layer], table, prefix, mask, scale,
                                           V_DIM, **kw)

    return call, (q, table, prefix, mask, scale)


def _torch_ms(caches, inputs, ctx, n, h, args) -> float | None:
    from treeflash.kernels import reference

    q, table, prefix, mask, scale = inputs
    need = n * h * (ctx + n) * 4 * 3 + (ctx + n) * D_LATENT * 4 * 2
    if need > args.torch_max_gb * 1e9 or ctx > max(args.torch_max_context):
        return None
    times = _time_single(
        lambda layer: reference.mla_verify_attention(q, caches.kv[layer], table, prefix, mask,
                                                     scale, V_DIM), caches.kv.shape[0], 2)
    return statistics.median(times)


def bench_shape(caches, ctx, n, h, tree, args, graph: bool = True, torch_ref: bool = True,
                seed: int = 0, **kw) -> dict:
    from treeflash.bench.kernel_fp8 import cache_dtype
    from treeflash.kernels.mla_verify import dispatch, gpu_kind, split_plan

    fl, nbytes, flops = floor_s(ctx, n, h, args, caches.kv_dtype)
    row = {"context": ctx, "n": n, "h": h, "tree": tree, "page_size": caches.page_size,
           "kv_dtype": caches.kv_dtype, "bytes": nbytes, "flops": flops, "floor_ms": fl * 1e3}
    cfg = kw.get("config") or dispatch(n * h, cache_dtype(caches.kv_dtype), gpu_kind(torch.device("cuda")),
                                       caches.page_size, n)
    cap = caches.page_table(ctx + n).shape[1] * caches.page_size
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits, chunk = split_plan(cfg, 1, n * h, cap, sms, kw.get("num_splits"))
    row["impl"] = cfg.impl
    row["wave_plan"] = cfg.wave_plan and kw.get("num_splits") is None
    row.update(config=[cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages],
               splits=splits, chunk=chunk)
    call, inputs = _make_call(caches, ctx, n, h, tree, seed, **kw)
    layers = caches.kv.shape[0]
    single = _time_single(call, layers, args.reps)
    row["single_ms"] = statistics.median(single)
    row["single_all_ms"] = single
    if graph and row["single_ms"] <= args.graph_max_ms:
        reps = _time_graph(call, layers, args.graph_replays)
        row["graph_replay_ms"] = reps
        row["graph_per_layer_ms"] = statistics.median(reps) / layers
    else:
        row["graph_per_layer_ms"] = None
        row["graph_note"] = "skipped (single call above --graph-max-ms)" if graph else "not run"
    best = row["graph_per_layer_ms"] or row["single_ms"]
    row["step_ms"] = best
    row["gbps"] = nbytes / (best * 1e-3) / 1e9
    row["tflops"] = flops / (best * 1e-3) / 1e12
    row["frac_floor"] = row["floor_ms"] / best
    row["frac_floor_single"] = row["floor_ms"] / row["single_ms"]
    if torch_ref:
        try:
            row["torch_ms"] = _torch_ms(caches, inputs, ctx, n, h, args)
        except torch.cuda.OutOfMemoryError:
            row["torch_ms"] = None
        if row["torch_ms"] is None:
            row["torch_note"] = "skipped: does not fit --torch-max-gb / --torch-max-context"
        torch.cuda.empty_cache()
    return row
