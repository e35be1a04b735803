"""The launches `compile_launches.py` compiles: each kernel module's launchers called on CPU tensors
at small shapes and at Kimi K2 TP8 shapes (8 heads x 576 latent dims, v_dim 512, page 64, fp8_e4m3
rows of 656 bytes, bf16), over the dtype / mode branches the engine takes (bf16 and fp8_e4m3
caches; float32 / bf16 / fp16 queries; trees and chains; N = 1 / 16 / 64 rows). The launches are
captured, never run: outputs are garbage, so the launchers are called directly, one case a call.
`fake_sm90` makes a launcher plan as on an H100 (132 SMs, capability 9.0, the Hopper kernels, the
MoE's one-program routing)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import torch

from treeflash.kvcache.format import fp8_row_bytes

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
K2 = dict(h=8, d=576, v=512, page=64)  # Kimi K2 at TP8: local heads, latent row, c_kv, page
SMALL = dict(h=2, d=160, v=128, page=16)
NODES = (1, 16, 64)


@contextlib.contextmanager
def fake_sm90(sms: int = 132):
    """Launchers see a CUDA sm_90 device of `sms` SMs: tensors say is_cuda, the device queries
    answer for an H100, and the verify dispatch takes the Hopper rows."""
    from treeflash.kernels import mla_verify, moe_gemm
    from treeflash.kernels.mla_verify import hopper

    saved = (torch.Tensor.is_cuda, torch.cuda.get_device_properties, torch.cuda.get_device_capability,
             mla_verify.gpu_kind, hopper.available, moe_gemm.route_plan)
    real_route_plan = moe_gemm.route_plan

    def route_plan(*args, **kwargs):  # the one-program routing: CUDA tensors (or the interpreter) only
        interpreting = moe_gemm._interpreting
        moe_gemm._interpreting = lambda: True
        try:
            return real_route_plan(*args, **kwargs)
        finally:
            moe_gemm._interpreting = interpreting

    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.get_device_properties = lambda *a, **k: SimpleNamespace(
        multi_processor_count=sms, major=9, minor=0, name="fake sm_90", total_memory=80 << 30)
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    mla_verify.gpu_kind = lambda device: "sm_90" if hopper.gluon is not None else "gpu"
    hopper.available = lambda device: hopper.gluon is not None
    moe_gemm.route_plan = route_plan
    try:
        yield
    finally:
        (torch.Tensor.is_cuda, torch.cuda.get_device_properties, torch.cuda.get_device_capability,
         mla_verify.gpu_kind, hopper.available, moe_gemm.route_plan) = saved


# ---- the paged MLA cache ------------------------------------------------------------------

def _cache(s: dict, fp8: bool, dtype=BF16, pages: int = 8, layers: int = 0) -> torch.Tensor:
    width = fp8_row_bytes(s["d"], s["v"]) if fp8 else s["d"]
    lead = (layers,) if layers else ()
    return torch.zeros(*lead, pages, s["page"], width, dtype=torch.uint8 if fp8 else dtype)


def _table(b: int, pages: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    pt = torch.arange(b * pages, dtype=torch.int32).reshape(b, pages) % pages
    return pt, torch.full((b,), 5, dtype=torch.int32)


def kv_write_cases() -> Iterator[tuple[str, Callable]]:
    from treeflash.kernels.kv_ops import kv_write_triton

    for s, fp8, n, dt in itertools.product((SMALL, K2), (False, True), NODES, (BF16, F32)):
        def run(s=s, fp8=fp8, n=n, dt=dt, b=2):
            pt, start = _table(b)
            lat = torch.randn(b, n, s["d"]).to(dt)
            cache = _cache(s, fp8, dt)
            kv_write_triton(cache, pt, start, lat, s["v"] if fp8 else None)
        yield f"kv_write d={s['d']} {'fp8' if fp8 else 'plain'} N={n} {dt}", run


def kv_commit_cases() -> Iterator[tuple[str, Callable]]:
    from treeflash.kernels.kv_ops import kv_commit_triton

    for s, fp8, m, it in itertools.product((SMALL, K2), (False, True), NODES, (torch.int32, torch.int64)):
        def run(s=s, fp8=fp8, m=m, it=it, b=2):
            pt, prefix = _table(b)
            acc = torch.arange(m, dtype=it).repeat(b, 1)
            kv_commit_triton(_cache(s, fp8, layers=3), pt, prefix, acc, torch.full((b,), m, dtype=it))
        yield f"kv_commit d={s['d']} {'fp8' if fp8 else 'bf16'} M={m} {it}", run


def mla_prep_cases() -> Iterator[tuple[str, Callable]]:
    from treeflash.kernels.mla_prep import mla_latent_prep_triton

    for s, fp8, n, inter, qa in itertools.product((SMALL, K2), (False, True), NODES, (False, True), (False, True)):
        def run(s=s, fp8=fp8, n=n, inter=inter, qa=qa, b=2, q_lora=1536):
            pt, start = _table(b)
            r = s["d"] - s["v"]
            cs = torch.randn(b, n, r // 2).to(BF16)
            q = torch.randn(b, n, q_lora).to(BF16) if qa else None
            mla_latent_prep_triton(torch.randn(b, n, s["d"]).to(BF16), _cache(s, fp8), pt, start,
                                   torch.ones(s["v"], dtype=BF16), 1e-6, cs, cs, inter, q,
                                   torch.ones(q_lora, dtype=BF16) if qa else None, 1e-6, None)
        yield f"mla_prep d={s['d']} {'fp8' if fp8 else 'bf16'} N={n} interleave={inter} qa={qa}", run


def _verify(s, fp8, n, qdt, tree, config=None, splits=None, b=2, pages=8, cache_dtype=None):
    from treeflash.kernels.mla_verify import mla_verify_attention_triton

    pt, prefix = _table(b, pages)
    q = torch.randn(b, n, s["h"], s["d"]).to(qdt)
    mask = torch.ones(b, n, n, dtype=torch.bool).tril() if tree else None
    cache = _cache(s, fp8, cache_dtype or (F32 if qdt == F32 else qdt), pages)
    mla_verify_attention_triton(q, cache, pt, prefix, mask, 0.1, s["v"], config=config, num_splits=splits)


def mla_verify_cases() -> Iterator[tuple[str, Callable]]:
    """The dispatch's own choice at sm_90, then every implementation forced, direct and split."""
    from treeflash.kernels.mla_verify import IMPLS, tile

    # every query dtype at the small shape; Kimi K2's own (bf16) at its shape (its compiles are
    # the dearest: 10-20 s each on a 2-core CPU); the engine's fp8 cache serves bf16 (fp32: tests)
    combos = [(s, fp8, n, qdt, tree) for s, fp8, n, qdt, tree in
              itertools.product((SMALL, K2), (False, True), NODES, (BF16, F16, F32), (False, True))
              if not (fp8 and qdt == F16) and (s is SMALL or qdt == BF16)]
    for s, fp8, n, qdt, tree in combos:
        label = f"d={s['d']} {'fp8' if fp8 else 'plain'} N={n} q={qdt} {'tree' if tree else 'chain'}"
        yield f"verify dispatch {label}", lambda a=(s, fp8, n, qdt, tree): _verify(*a)
        yield f"verify dispatch direct {label}", lambda a=(s, fp8, n, qdt, tree): _verify(*a, splits=1)
        for impl in IMPLS:
            def run(a=(s, fp8, n, qdt, tree), impl=impl):
                dt = F32 if a[3] == F32 else torch.uint8 if a[1] else a[3]  # `mla_verify_attention_triton`'s
                _verify(*a, config=tile(impl, a[2] * a[0]["h"], dt, "sm_90"), splits=3)
            yield f"verify {impl} {label}", run
    # pages that no portable tile divides (48; 1: scattered rows): the gathered mode's dispatch
    for page, fp8, n in itertools.product((48, 1), (False, True), NODES):
        s = dict(K2, page=page)
        yield (f"verify gathers page {page} {'fp8' if fp8 else 'bf16'} N={n}",
               lambda a=(s, fp8, n, BF16, True), pages=128 if page == 1 else 8: _verify(*a, pages=pages))


def dcp_merge_cases() -> Iterator[tuple[str, Callable]]:
    from treeflash.kernels.dcp_merge import merge_packed_triton

    for splits, rows, dt, (h, v) in itertools.product((2, 4, 8), (1, 16, 64), (BF16, F16, F32),
                                                      ((8, 512), (2, 128))):
        def run(splits=splits, rows=rows, dt=dt, h=h, v=v):
            k = 4 // torch.tensor([], dtype=dt).element_size()
            merge_packed_triton(torch.zeros(splits, rows, h, v + k, dtype=dt), v)
        yield f"dcp_merge S={splits} rows={rows} {dt} H={h} v={v}", run


# Kimi K2 at TP8 for the MoE: hidden 7168, 384 routed experts top 8, expert inter 2048 / 8, the
# shared expert's 2048 / 8 (16 local experts stand in for the 384: the strides are the same)
MOE = dict(hid=7168, experts=16, top_k=8, inter=256, group=32)


def _moe_inputs(rows: int, dt=BF16, int4: bool = True, m: dict = MOE):
    from treeflash.kernels.int4 import Int4Weight

    e, hid, inter, g = m["experts"], m["hid"], m["inter"], m["group"]

    def w(n, k):
        if int4:
            return Int4Weight(torch.zeros(e, n, k // 8, dtype=torch.int32), torch.ones(e, n, k // g, dtype=dt), g)
        return torch.zeros(e, n, k, dtype=dt)

    ids = torch.rand(rows, e).topk(m["top_k"], dim=-1).indices
    shared = (torch.zeros(inter, hid, dtype=dt), torch.zeros(inter, hid, dtype=dt), torch.zeros(hid, inter, dtype=dt))
    return (torch.randn(rows, hid).to(dt), torch.rand(rows, m["top_k"]), ids, w(inter, hid), w(inter, hid),
            w(hid, inter)), shared


def moe_cases() -> Iterator[tuple[str, Callable]]:
    """The W4A16 experts (the MMA and portable kernels; the dispatch's own choice) and the 16-bit
    experts (`moe_gemm`), with and without the shared expert, at 1 .. 1024 rows."""
    from treeflash.kernels.moe_gemm import moe_experts_triton
    from treeflash.kernels.moe_w4a16 import moe_experts_w4a16

    for rows, impl, sh, dt in itertools.product((1, 16, 64, 1024), (None, "mma", "portable"), (False, True),
                                                (BF16, F16)):
        def run(rows=rows, impl=impl, sh=sh, dt=dt):
            args, shared = _moe_inputs(rows, dt)
            moe_experts_w4a16(*args, shared=shared if sh else None, impl=impl)
        yield f"moe_w4a16 rows={rows} impl={impl} shared={sh} {dt}", run
    for rows, split in itertools.product((1, 16, 64), (2, 4)):  # the portable kernel's split K (CUDA only)
        def split_run(rows=rows, split=split):
            args, shared = _moe_inputs(rows)
            moe_experts_w4a16(*args, shared=shared, impl="portable", split_k=split)
        yield f"moe_w4a16 portable rows={rows} split_k={split} bf16", split_run
    for rows, sh, dt in itertools.product((1, 2, 4, 8, 16, 64, 512, 1024), (False, True), (BF16, F16)):
        yield f"moe_w4a16 mma rows={rows} shared={sh} {dt}", lambda a=(rows, sh, dt): _mma(*a)
    for rows, sh in itertools.product((1, 16), (False, True)):  # no split: H itself stands for the partials
        yield f"moe_w4a16 mma rows={rows} shared={sh} split=1 bf16", lambda a=(rows, sh, BF16, 1): _mma(*a)
    for rows, sh in itertools.product((1, 16, 64, 1024), (False, True)):
        def run16(rows=rows, sh=sh):
            args, shared = _moe_inputs(rows, BF16, int4=False)
            moe_experts_triton(*args, shared=shared if sh else None)
        yield f"moe_gemm rows={rows} shared={sh} bf16", run16


def _mma(rows: int, sh: bool, dt: torch.dtype, split: int | None = None) -> None:
    """The MMA kernels as the dispatch runs them on a GPU (`mma.supported` refuses CPU tensors):
    `mma.plan` for a CUDA device (its tiles and split for `rows`, or `split`), then the call."""
    from treeflash.kernels.moe_w4a16 import mma
    from treeflash.kernels.moe_w4a16.dispatch import mma_split, mma_tiles

    (x, wts, ids, wg, wu, wd), shared = _moe_inputs(rows, dt)
    e, inter, hid = wg.shape
    s_ch = shared[0].shape[0] // inter if sh else 0
    plan = mma.plan(rows, ids.shape[1], e, inter, hid, s_ch, torch.device("cuda"),
                    mma_tiles(rows, ids.shape[1], e), split or mma_split(rows))
    mma.moe_experts_mma(x, wts, ids, wg, wu, wd, 0, None, shared if sh else None, None, s_ch, plan)


def router_cases() -> Iterator[tuple[str, Callable]]:
    """Kimi K2's router (384 experts, top 8, sigmoid, noaux_tc, one group), logits given and fused."""
    from treeflash import kernels

    for rows, dt in itertools.product((1, 4, 16, 64), (BF16, F32)):
        def run(rows=rows, dt=dt, e=384, hid=7168):
            bias = torch.zeros(e)
            cfg = ("sigmoid", "noaux_tc", 1, 1, 8, True, 2.827)
            kernels.moe_gate(torch.randn(rows, e), bias, *cfg, impl="triton")
            kernels.moe_gate_fused(torch.randn(rows, hid).to(dt), torch.zeros(e, hid, dtype=dt), bias, *cfg,
                                   impl="triton")
            last = torch.zeros(e, dtype=torch.int64)
            kernels.expert_counts(torch.randint(0, e, (rows, 8)), last, last.clone(), impl="triton")
        yield f"router rows={rows} {dt}", run


MODULES: dict[str, Callable[[], Iterator[tuple[str, Callable]]]] = {
    "kv_ops.write": kv_write_cases,
    "kv_ops.commit": kv_commit_cases,
    "dcp_merge": dcp_merge_cases,
    "mla_prep": mla_prep_cases,
    "mla_verify": mla_verify_cases,
    "moe": moe_cases,
    "router": router_cases,
}


def run_tests(paths: list[str], captured) -> int:
    """Run the pytest files / folders `paths` in this process (the kernels already imported as
    compiled kernels: captured, not interpreted), each test's launches labelled with its node id
    in `captured.case`. The tests fail on their garbage outputs; what they launched before is the
    harvest. Returns pytest's exit code."""
    import pytest

    class _Label:
        @pytest.fixture(autouse=True)
        def _label(self, request):
            captured.case = f"tests: {request.node.nodeid}"
            yield

    return pytest.main([*paths, "-q", "--tb=no", "--no-header", "-p", "no:cacheprovider", "-o",
                        "addopts=--import-mode=importlib", "--timeout=120"], plugins=[_Label()])


def cases() -> Iterator[tuple[str, str, Callable]]:
    """(module, case name, a call that launches) for every case of every module in `MODULES`."""
    for module, make in MODULES.items():
        for name, fn in make():
            yield module, name, fn
