"""What `bench sweep` and `doctor` stand on: one request brought to a context (a real chunked
prefill, or random latents written straight into its KV pages for a preset), and the synced
timers that split a step into its parts (drafter, tree build, verify attention, projections,
MoE / MLP, the rest of the target, the LM head, walk / commit, drafter extend), and the device
seconds of one call (`device_seconds`, doctor's timer of the verify attention)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict

import torch

import treeflash.kernels as kernels
from treeflash.bench.presets import Rig
from treeflash.engine.request import Request, Status
from treeflash.sampling import SamplingParams


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- bringing a request to a context -----------------------------------------------------
# Without it the prefill's autograd graph hung off the KV pool (23 GB at 32k on a CPU). Inference
# mode, as the engine's steps: the MoE's expert counts, made inside a step (an inference tensor),
# are zeroed in place by the prefill's forward, which no_grad refused (auto on the CPU).
@torch.inference_mode()
def place_request(engine, rig: Rig, context: int, max_tokens: int, fill: str, seed: int,
                  progress: bool = True) -> Request:
    """A running request with `context` tokens of committed KV and its first output token."""
    g = torch.Generator().manual_seed(seed)
    vocab = rig.cfg.vocab_size
    prompt = torch.randint(2, max(3, vocab - 2), (context,), generator=g).tolist()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = Request(f"bench-{context}", prompt, params, generator=torch.Generator(device=engine.device))
    engine.pool.grow(req.pages, engine.pool.pages_for(engine.kv_tokens_needed(context, max_tokens))
                     * engine.pool.tokens_per_page)
    if fill == "random":
        first = _fill_random(engine, req, context, seed)
    elif fill == "prefill":
        first = _prefill(engine, req, progress)
    else:
        raise ValueError(f"fill must be 'random' or 'prefill', got {fill!r}")
    req.output_ids.append(first)
    req.status = Status.RUNNING
    engine.running.append(req)
    return req


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(n, start + size)


def _fill_random(engine, req: Request, context: int, seed: int) -> int:
    """Unit-scale random latents in the request's pages; random features in the drafter."""
    pool, dev = engine.pool, engine.device
    g = torch.Generator(device=dev).manual_seed(seed)
    kv = pool.kv  # [layers, pages, page_size, D]
    pages = torch.tensor(req.pages[: pool.pages_for(context)], device=dev)
    step = max(1, (1 << 22) // (kv.shape[0] * kv.shape[2] * kv.shape[3]))
    fmt = pool.format
    for a, b in _chunks(len(pages), step):
        shape = (kv.shape[0], b - a, kv.shape[2], fmt.dim)
        kv[:, pages[a:b]] = fmt.encode(torch.randn(shape, generator=g, device=dev, dtype=torch.float32))
    req.num_cached = context
    first = int(torch.randint(2, max(3, engine.cfg.vocab_size - 2), (1,), generator=g, device=dev))
    if engine.spec is not None:
        drafter = engine.spec.drafter
        inner = getattr(drafter, "inner", drafter)
        cache = engine.spec.new_cache(req.prompt_ids, req.params.max_tokens)
        width = len(drafter.target_layer_ids) * engine.cfg.hidden_size
        dtype = getattr(getattr(inner, "fc", None), "weight", kv).dtype
        for a, b in _chunks(context, 4096):
            feats = torch.randn(b - a, width, generator=g, device=dev, dtype=torch.float32).to(dtype)
            drafter.extend(cache, feats, torch.arange(a, b, device=dev))
        req.spec_state = engine.spec.new_state(cache, first)
    return first


def _prefill(engine, req: Request, progress: bool) -> int:
    """The real thing: chunked target prefill, drafter extended chunk by chunk, with a bar."""
    from tqdm import tqdm

    spec = engine.spec
    taps = spec.tap_layers if spec is not None else ()
    cache = spec.new_cache(req.prompt_ids, req.params.max_tokens) if spec is not None else None
    bar = tqdm(total=len(req.prompt_ids), unit="tok", desc=f"prefill {len(req.prompt_ids)}",
               disable=not progress, leave=False)
    last, done = None, 0
    for chunk_logits, tapped in engine.prefill_rows(req, req.prompt_ids, taps=taps):
        last = chunk_logits
        if cache is not None:
            n = tapped.shape[0]
            spec.drafter.extend(cache, tapped, torch.arange(req.num_cached - n, req.num_cached,
                                                            device=tapped.device))
        bar.update(req.num_cached - done)
        done = req.num_cached
    bar.close()
    first = int(last[-1].argmax())
    if spec is not None:
        req.spec_state = spec.new_state(cache, first)
    return first


# ---- instruments -----------------------------------------------------------------------------
class _Clock:
    """Interval timer: CUDA events on the GPU (no sync inside the step), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.open: dict[object, object] = {}
        self.pairs: dict[str, list] = defaultdict(list)

    def start(self, key) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.open[key] = ev
        else:
            self.open[key] = time.perf_counter()

    def stop(self, key, name: str) -> None:
        t0 = self.open.pop(key, None)
        if t0 is None:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.pairs[name].append((t0, ev))
        else:
            self.pairs[name].append((t0, time.perf_counter()))

    def collect(self) -> dict[str, list[float]]:
        """Seconds per interval, by name (call after a device sync); clears."""
        out = {}
        for name, pairs in self.pairs.items():
            if self.cuda:
                out[name] = [a.elapsed_time(b) / 1e3 for a, b in pairs]
            else:
                out[name] = [b - a for a, b in pairs]
        self.pairs = defaultdict(list)
        return out


@contextlib.contextmanager
def instrument(model, device: torch.device):
    """Time the target's parts in situ: per layer MLA block / MLP, the attention kernel
    call (wrapped for the duration), the whole forward and the LM head."""
    clock = _Clock(device)
    handles = []

    def hook(mod, name):
        handles.append(mod.register_forward_pre_hook(lambda m, a: clock.start(m)))
        handles.append(mod.register_forward_hook(lambda m, a, o: clock.stop(m, name)))

    hook(model, "target_forward")
    hook(model.lm_head, "lm_head")
    for layer in model.model.layers:
        hook(layer.self_attn, "mla_block")
        hook(layer.mlp, "moe" if hasattr(layer.mlp, "routed_weights") else "dense_mlp")
    original = kernels.mla_verify_attention

    def timed_attention(*args, **kw):
        key = object()
        clock.start(key)
        out = original(*args, **kw)
        clock.stop(key, "attention_kernel")
        return out

    kernels.mla_verify_attention = timed_attention
    # Tensor parallel: rank 0's all-reduces (two a layer), waiting for the slowest rank
    # included: that wait is what a rank's imbalance costs the step.
    par = getattr(model, "parallel", None)
    reduce = par.all_reduce if par is not None and getattr(par, "group", None) is not None else None
    if reduce is not None:
        def timed_reduce(x):
            key = object()
            clock.start(key)
            out = reduce(x)
            clock.stop(key, "all_reduce")
            return out

        object.__setattr__(par, "all_reduce", timed_reduce)
    try:
        yield clock
    finally:
        kernels.mla_verify_attention = original
        if reduce is not None:
            object.__delattr__(par, "all_reduce")
        for h in handles:
            h.remove()


def device_seconds(call, device: torch.device, reps: int = 8) -> tuple[float, str]:
    """Seconds one `call` keeps the device busy, and how it was timed. On CUDA: a CUDA graph of
    `reps` calls replayed 5 times between events (an eager call also pays its Python dispatch
    and launches, ~0.25 ms on the H200 against a ~0.05 ms kernel at 32k: the 2026-12-03 doctor
    reported the verify kernel at 11.9x its floor where the graph figure was ~2x); if the call
    cannot be captured, back-to-back eager calls between events. Elsewhere: the median wall
    time of 5 synced calls."""
    if device.type != "cuda":
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), "wall"
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph, how = torch.cuda.CUDAGraph(), "CUDA graph"
    try:
        with torch.cuda.graph(graph):
            for _ in range(reps):
                call()
        run = graph.replay
    except Exception:  # noqa: BLE001 - not capturable here: time the device queue instead
        graph, how = None, "eager, back to back"

        def run():
            for _ in range(reps):
                call()
    run()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    del graph
    return statistics.median(times), how
