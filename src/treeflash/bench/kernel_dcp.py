"""`bench kernel --dcp N`: one decode-context-parallel rank's attention a layer, timed as the GPU
runs a step: a CUDA graph of one call per layer over `--layers` layer caches (`kernel_timing`).

A DCP N rank's layer is the model's own code (`models/mla.py _attend_dcp`) as group rank 0 of a
modelled group (`models/dcp.py`): the queries of the group's N x H heads (one copy: the rank's own
repeated, where the all-gather would land; a real plain decode's lands as a view), the verify
kernel over the rank's share (page 64 in order: the local rows of a dealt request, `local_lens
(context)` of them, then the step's rows; the tree mask on rank 0), the send buffer's pack, the
LSE merge of the N parts (`kernels/dcp_merge.py`, one launch); a plain decode's row needs no
settle (it is at its owner's row already) and a verify's rows wait for the commit. The two
collectives are not run (one GPU): their time is declared where the step is composed
(`benchmarks/dcp_model_table.py`). Beside it, DCP 1: the verify
kernel alone over the whole context with H heads. Each figure is set against its floor
(`floor_s`: the share's bytes, 2 x rows x N*H x share x (576 + 512) flops) and the issue's bar
(floor + 5 us). At long contexts fewer distinct caches than layers are built (`--dcp-cache-gb`),
the graph cycling over them: each holds far more than the L2, so none is read from it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from treeflash.bench.kernel_timing import D_LATENT, V_DIM, floor_s

PAGE = 64
SLACK_US = 5.0  # issue 47: a rank's attention within floor + 5 us a layer
SCALE = 192 ** -0.5  # (the softmax scale does not change the time)


@dataclass(frozen=True)
class RankShape:
    """What one rank's layer reads: `share` prefix rows (its dealt part of `context`) + `rows` new
    rows, with `size` x `heads` query heads (size 1: no DCP)."""

    context: int
    size: int
    heads: int
    rows: int
    share: int

    @classmethod
    def of(cls, context: int, size: int, heads: int, rows: int) -> RankShape:
        from treeflash.models.dcp import local_lens

        share = int(local_lens(torch.tensor([context]), 0, size, PAGE)[0]) if size > 1 else context
        return cls(context, size, heads, rows, share)

    @property
    def query_heads(self) -> int:
        return self.size * self.heads


def distinct_caches(shape: RankShape, layers: int, cache_gb: float) -> int:
    """How many layer caches to build: all `layers` if they fit in cache_gb, else as many as fit
    (at least 2, so no call reads the cache the one before it left in L2)."""
    per_layer = (shape.share + shape.rows + PAGE) * D_LATENT * 2
    return max(2, min(layers, int(cache_gb * 1e9 // per_layer)))


def rank_layer(shape: RankShape, caches: int, device, dtype=torch.bfloat16, impl: str | None = None,
               seed: int = 0) -> tuple[Callable[[int], torch.Tensor], dict]:
    """The layer call of one rank (fn(layer) -> merged out [1, rows, heads, 512]) over `caches`
    layer caches (layer % caches), and its inputs (for the tests: q, kv, table, prefix, mask, and
    under DCP the batch as the model sees it, shared and local)."""
    from treeflash import kernels
    from treeflash.kernels.testing import random_tree_masks
    from treeflash.models import dcp

    g = torch.Generator().manual_seed(seed)
    pages = -(-(shape.share + shape.rows) // PAGE)
    kv = torch.empty(caches, pages + 1, PAGE, D_LATENT, device=device, dtype=dtype)
    kv.normal_(generator=torch.Generator(device=kv.device).manual_seed(seed))  # (made where it lives: GBs)
    table = torch.arange(pages, dtype=torch.int32, device=device)[None]
    prefix = torch.tensor([shape.share], dtype=torch.int32, device=device)
    q = torch.randn(1, shape.rows, shape.heads, D_LATENT, generator=g).to(device, dtype)
    mask = random_tree_masks(1, shape.rows, g, bushy=True).to(device) if shape.rows > 1 else None
    inputs = {"q": q, "kv": kv, "table": table, "prefix": prefix, "mask": mask}
    if shape.size == 1:
        def call(layer: int) -> torch.Tensor:
            return kernels.mla_verify_attention(q, kv[layer % caches], table, prefix, mask, SCALE, V_DIM, impl)[0]
        return call, inputs
    from types import SimpleNamespace

    from treeflash.models.mla import MLA, AttnBatch, dcp_local
    from treeflash.sharding import Parallel

    # the model's own layer code (`MLA._attend_dcp`) as group rank 0 of a modelled group
    layer = SimpleNamespace(parallel=Parallel(dcp_size=shape.size),
                            cfg=SimpleNamespace(softmax_scale=SCALE, kv_lora_rank=V_DIM))
    shared = AttnBatch(table, torch.tensor([shape.context], dtype=torch.int32, device=device), mask, impl,
                       deal_unit=PAGE, commit_later=shape.rows > 1)  # a verify's rows wait for the commit
    local = dcp_local(shared, layer.parallel)
    inputs |= {"shared": shared, "local": local}

    def call(i: int) -> torch.Tensor:
        return MLA._attend_dcp(layer, q, kv[i % caches], local, shared)

    q_group = dcp.gather_heads(q, shape.size, None)

    def verify_only(i: int) -> torch.Tensor:  # the kernel alone: the rest of `call` is DCP's
        return kernels.mla_verify_attention(q_group, kv[i % caches], table, prefix, mask, SCALE, V_DIM, impl)[0]

    inputs["verify_only"] = verify_only
    return call, inputs


def graph_timer(fn, layers: int, replays: int) -> list[float]:
    """ms a replay of a CUDA graph of fn(0) .. fn(layers - 1) (`kernel_timing._time_graph`)."""
    from treeflash.bench.kernel_timing import _time_graph

    return _time_graph(fn, layers, replays)


def wall_timer(fn, layers: int, replays: int) -> list[float]:
    """ms a pass of fn over the layers, by the wall clock (CPU tests of the harness: no figure)."""
    out = []
    for _ in range(replays):
        t = time.perf_counter()
        for layer in range(layers):
            fn(layer)
        out.append(1e3 * (time.perf_counter() - t))
    return out


def time_rank(shape: RankShape, args, device, timer=graph_timer, impl: str | None = None) -> dict:
    """One rank's layer timed: us a layer (graph of args.layers calls); under DCP also its verify
    kernel alone and the rest (the queries' concat, the pack, the merge: `dcp_glue`);
    the floor and the issue's verdict."""
    k = distinct_caches(shape, args.layers, args.dcp_cache_gb)
    call, inputs = rank_layer(shape, k, device, impl=impl)
    fl, nbytes, flops = floor_s(shape.share, shape.rows, shape.query_heads, args)
    row = asdict(shape) | {"query_heads": shape.query_heads, "distinct_caches": k, "layers": args.layers,
                           "bytes": nbytes, "flops": flops, "floor_us": fl * 1e6}
    row["us_per_layer"] = 1e3 * statistics.median(timer(call, args.layers, args.graph_replays)) / args.layers
    if shape.size > 1:
        verify = inputs["verify_only"]
        row["verify_us_per_layer"] = 1e3 * statistics.median(timer(verify, args.layers,
                                                                   args.graph_replays)) / args.layers
        row["dcp_glue_us_per_layer"] = row["us_per_layer"] - row["verify_us_per_layer"]
    row["within_floor_plus_5us"] = row["us_per_layer"] <= row["floor_us"] + SLACK_US
    row["x_floor"] = row["us_per_layer"] / row["floor_us"]
    del call, inputs
    return row


def dcp_section(args, device="cuda", timer=graph_timer, impl: str | None = None) -> list[dict]:
    """Per context and rows (1: plain decode; more: a DDTree verify): DCP 1 and one DCP N rank."""
    from treeflash.flags import parse_sizes

    out, t0 = [], time.time()
    for ctx in parse_sizes(args.contexts):
        if out and args.budget_s and time.time() - t0 > args.budget_s:  # (the JSON keeps what was timed)
            print(f"budget: skipped dcp {ctx}", flush=True)
            continue
        for rows in [int(t) for t in args.dcp_rows.split(",") if t.strip()]:
            rec = {"context": ctx, "rows": rows, "mode": "off" if rows == 1 else "ddtree", "heads": args.dcp_heads}
            for key, size in (("dcp1", 1), ("dcpN", args.dcp)):
                try:
                    rec[key] = time_rank(RankShape.of(ctx, size, args.dcp_heads, rows), args, device, timer, impl)
                except Exception as e:  # noqa: BLE001 - a shape that fails is a result
                    rec[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                if device == "cuda":
                    torch.cuda.empty_cache()
            out.append(rec)
            print(line(rec, args.dcp), flush=True)
    return out


def line(rec: dict, n: int) -> str:
    def cell(r: dict) -> str:
        if "error" in r:
            return f"ERROR {r['error']}"
        glue = f", verify {r['verify_us_per_layer']:.1f} + dcp {r['dcp_glue_us_per_layer']:.1f}" \
            if "verify_us_per_layer" in r else ""
        return (f"{r['us_per_layer']:7.1f} us (floor {r['floor_us']:6.1f}{glue}) "
                f"{'<=' if r['within_floor_plus_5us'] else '>'} floor+5")
    return (f"dcp L={rec['context'] // 1024:5d}k rows={rec['rows']:3d} H={rec['heads']}: "
            f"DCP1 {cell(rec['dcp1'])} | DCP{n} rank {cell(rec['dcpN'])}")
