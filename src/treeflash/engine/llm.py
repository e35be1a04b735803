"""`LLM`: the offline front end (load, generate, score)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from treeflash.engine.engine import Engine
from treeflash.engine.executor import LocalExecutor
from treeflash.engine.request import Request, RequestOutput
from treeflash.engine.tokenizer import Tokenizer
from treeflash.kvcache import KVPool
from treeflash.kvcache.coarse import whole_tiles
from treeflash.kvcache.format import parse_kv_cache_dtype
from treeflash.kvcache.pool import scratch_tokens
from treeflash.models.layers import set_options
from treeflash.models.loader import load_target
from treeflash.runtime import RuntimeOptions
from treeflash.sampling import SamplingParams

EMBEDDED = Path(__file__).resolve().parent.parent / "assets"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA GPU is available")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return table[dtype]


def default_model_path() -> Path:
    path = EMBEDDED / "target"
    if not (path / "config.json").is_file():
        raise ValueError(f"no --model given and no embedded model is shipped at {path}")
    return path



def _check_sizes(page_size, prefill_chunk, max_running) -> None:
    """Refuse sizes no engine can run with, before anything loads."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    if not isinstance(max_running, int) or max_running < 1:  # 0 admitted nothing: generate hung
        raise ValueError(f"max_running must be an integer >= 1, got {max_running!r}")

class LLM:
    """Load a DeepSeek-V3 / Kimi-K2 checkpoint (and optionally a DFlash drafter) and run it."""

    def __init__(
        self,
        model: str | Path | None = None,
        drafter: str | Path | None = None,
        *,
        spec: str | None = None,
        tree_budget: int | None = None,
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        page_size: int = 64,
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_tokens: int | None = None,
        kv_cache_dtype: str = "auto",
        max_running: int = 64,
        prefill_chunk: int = 512,
        attention_impl: str | None = None,
        scattered_kv: bool = False,
        tp: int = 1,
        ep: int = 1,
        dcp: int = 1,
        cuda_graphs: bool | None = None,
        tokenizer: str | Path | None = None,
        chat_template: str | Path | None = None,
        kv_memory_fraction: float | None = None,
        runtime_options: RuntimeOptions | None = None,
    ):
        """tp > 1 (or a torchrun launch) runs the target over a tensor-parallel group, see
        `treeflash.parallel`: this process is rank 0 and starts tp-1 followers itself (call it
        under `if __name__ == "__main__":`); ep splits the routed experts over ep groups
        of ranks; dcp deals each request's latent cache across groups of dcp ranks (decode
        context parallelism, `treeflash.models.dcp`: dcp divides tp; the KV pool holds dcp x
        the tokens in the same memory a rank). The drafter runs on rank 0 only. cuda_graphs replays the decode/verify
        forward and the batch-1 draft step (proposal + tree build) from CUDA graphs; None (the
        default) turns them on for one CUDA device (tp 1) and off elsewhere. On the H200 they
        made plain decode of the shipped pair 11x faster (61 -> 681 tok/s,
        benchmarks/results/h200-20261202-first-contact); False is vLLM's --enforce-eager. tokenizer: a
        directory or tokenizer.json / tiktoken.model file to use instead of the model
        directory's; chat_template: a Jinja file (or text) instead of the tokenizer's (vLLM's
        --tokenizer and --chat-template). kv_cache_dtype: "auto" (the model's dtype) or
        "fp8_e4m3" (also vLLM's fp8 / fp8_ds_mla): the target's latent cache as FlashMLA's
        656-byte fp8 rows (`kvcache.format`), 0.57 of the bf16 bytes a token; the drafter's own
        cache stays in the model dtype. kv_memory_fraction (instead of kv_cache_tokens) sizes the KV
        pool so that weights + KV + workspace use that fraction of the device's memory
        (`memory.kv_tokens_for_fraction`, in the cache's row bytes). runtime_options: which
        implementation each fused step of the target and drafter runs (`runtime.RuntimeOptions`;
        default: the measured fastest)."""
        self._tokenizer_source = (tokenizer, chat_template)
        self.runtime_options = runtime_options or RuntimeOptions()
        self.last_warmup: dict | None = None  # the last warm-up's seconds, capture seconds and rounds
        if model is None and drafter is None and spec != "off" and (EMBEDDED / "drafter" / "config.json").is_file():
            drafter = EMBEDDED / "drafter"  # LLM() is the shipped pair, speculation on
        path = Path(model) if model is not None else default_model_path()
        if not path.exists():
            raise ValueError(f"model path {path} does not exist")
        _check_sizes(page_size, prefill_chunk, max_running)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype, self.dtype)  # refused before loading
        if cuda_graphs is None:
            from treeflash.parallel.launch import launched_by_torchrun

            cuda_graphs = (self.device.type == "cuda" and tp == 1 and ep == 1 and dcp == 1
                           and not launched_by_torchrun())
        elif cuda_graphs and (tp != 1 or ep != 1):
            raise ValueError("cuda_graphs needs tp=1 (graphs are not supported under tensor parallelism yet)")
        self.cuda_graphs = bool(cuda_graphs)
        torch.manual_seed(seed)
        self._dist = self._start_group(path, tp, ep, attention_impl, dcp)
        try:
            self._build(path, drafter, spec, tree_budget, max_model_len, kv_cache_tokens, page_size,
                        scattered_kv, max_running, prefill_chunk, attention_impl, seed, kv_memory_fraction)
        except BaseException:
            if self._dist is not None:
                self._dist.abort()
            raise

    def _start_group(self, path, tp, ep, attention_impl, dcp=1):
        ctx = start_tensor_parallel(path, tp, ep, self.device, self.dtype, attention_impl, self.runtime_options,
                                    dcp)
        if ctx is not None:
            self.device = ctx.device
        return ctx

    def _build(self, path, drafter, spec, tree_budget, max_model_len, kv_cache_tokens, page_size,
               scattered_kv, max_running, prefill_chunk, attention_impl, seed, kv_memory_fraction=None):
        self.model = load_target(path, self.device, self.dtype, self._dist and self._dist.parallel,
                                 self.runtime_options)
        cfg = self.model.cfg
        self.config = cfg
        if max_model_len is None:
            max_model_len = cfg.max_position_embeddings
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be an integer >= 1, got {max_model_len!r}")
        if max_model_len > cfg.max_position_embeddings:  # (and the KV pool is sized from it)
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                             f"{cfg.max_position_embeddings} (config.json)")
        self.max_model_len = max_model_len
        eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
        self.tokenizer = Tokenizer.from_model_dir(path, eos, *self._tokenizer_source)
        spec_decoder = self._make_spec(path, drafter, spec, tree_budget)
        width = spec_decoder.verify_width if spec_decoder else 1
        dcp = self._dist.parallel.dcp_size if self._dist is not None else 1
        if kv_memory_fraction is not None and kv_cache_tokens is None:  # a rank's memory: 1/dcp of the tokens
            kv_cache_tokens = dcp * self._kv_tokens_for(kv_memory_fraction, spec_decoder, max_model_len, width,
                                                        prefill_chunk)
        # (under DCP a request also reserves room for a forward's rows on every rank: KVPool.scratch_tokens)
        tokens = kv_cache_tokens or (max(max_model_len + width, min(4 * max_model_len, 1 << 16))
                                     + scratch_tokens(max(width, prefill_chunk), page_size, dcp))
        if self.cuda_graphs:  # graphs reserve scratch pages for padding rows (whole coarse pages,
            # kvcache.coarse, where pages are smaller than a tile)
            tokens += whole_tiles(width, page_size) + page_size
        self.pool = KVPool(
            cfg.num_hidden_layers, -(-tokens // (page_size * dcp)), page_size, cfg.latent_dim,
            self.dtype, self.device, scattered=scattered_kv, kv_cache_dtype=self.kv_cache_dtype,
            v_dim=cfg.kv_lora_rank, dcp=dcp,
        )
        executor = None
        if self._dist is not None:
            from treeflash.parallel.executor import DistributedExecutor

            executor = DistributedExecutor(LocalExecutor(self.model, self.pool, attention_impl), self._dist)
        self.engine = Engine(
            self.model, self.pool, self.tokenizer, max_model_len=max_model_len,
            max_running=max_running, prefill_chunk=prefill_chunk,
            attention_impl=attention_impl, seed=seed, spec=spec_decoder, executor=executor,
            cuda_graphs=self.cuda_graphs,
        )

    def kv_summary(self) -> str:
        """The KV pool in one line (serve logs it at startup): tokens it holds on each GPU (the
        latent cache is whole on every tensor-parallel rank), its row format and memory."""
        pool = self.pool
        layers = pool.kv.shape[0]
        return (f"{pool.capacity_tokens:,} tokens per GPU in {pool.num_pages:,} pages of {pool.page_size} "
                f"({pool.format.label} rows, {pool.format.row_bytes} B a token a layer x {layers} layers = "
                f"{pool.bytes_per_token * pool.capacity_tokens / 1e9:.2f} GB)")

    def _kv_tokens_for(self, fraction: float, spec_decoder, max_model_len: int, width: int, rows: int) -> int:
        from treeflash.memory import kv_bytes_per_token, kv_tokens_for_fraction

        drafter = spec_decoder.drafter if spec_decoder is not None else None
        tensors = {id(t): t for m in (self.model, drafter) if m is not None for t in (*m.parameters(), *m.buffers())}
        weights = sum(t.numel() * t.element_size() for t in tensors.values())
        per_token = kv_bytes_per_token(self.config, self.dtype, getattr(drafter, "cfg", None),
                                       self.kv_cache_dtype)
        tokens, how = kv_tokens_for_fraction(fraction, weights, per_token, max(rows, width), self.config,
                                             self.device, max_model_len)
        if tokens < max_model_len + width:
            raise ValueError(f"a memory fraction of {fraction:g} leaves room for {tokens} KV tokens ({how}), fewer "
                             f"than one request of max_model_len={max_model_len} needs: raise the fraction or "
                             "lower --max-model-len")
        return tokens

    def warmup(self, max_tokens: int = 48, max_batch: int = 1) -> float:
        """Run throw-away requests through every plan this engine may use, for every batch size
        up to max_batch (engine/warmup.py): kernels compile, every CUDA graph a step may replay
        is captured now and not inside a served request, and (tree_budget="auto") the cost model
        prices each bucket's step; the sizing's calibration learns nothing. Under auto the plans
        are each bucket, built as itself and wide (a scoring step), and plain steps; a pinned
        budget's is its own. On the H200 (2026-12-02) the shipped pair's first auto request paid
        2.7 s, one step 1.02 s, without it. Two prompt lengths, a short one at every batch
        bucket and one of ~1k tokens at batch 1: Triton specialises on the context's shape (one
        page or many, one split or several), and with the short prompt alone each budget's first
        real step still compiled, 1.0-1.7 s (2026-12-03). A graph of a page-table bucket no
        warm-up prompt reached is still captured when a request first needs it (and that
        step's capture is not priced as its cost). Returns the seconds spent."""
        from treeflash.engine.warmup import warm, warm_buckets

        spec = self.engine.spec
        vocab = self.config.vocab_size
        eos = set(self.config.eos_token_ids or ())
        tokens = [t for t in range(vocab // 2, vocab) if t not in eos] + [t for t in range(vocab // 2) if t not in eos]
        room = self.engine.max_model_len - max_tokens - (spec.verify_width if spec is not None else 1) - 1
        short, long = min(24, room), min(1024, room)
        t0 = time.perf_counter()
        rounds = [(short, warm_buckets(min(max_batch, self.engine.max_running)))] + ([(long, (1,))] if long > short
                                                                                    else [])
        for n, batches in rounds:
            if n > 0:
                prompt = [tokens[i % len(tokens)] for i in range(n)]
                self.last_warmup = warm(self.engine, [prompt], max_tokens, batches)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the tensor-parallel followers (a no-op for tp=1); the LLM is unusable after."""
        shutdown = getattr(self.engine.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def _make_spec(self, path, drafter, spec, tree_budget):
        if spec not in (None, "off", "ddtree", "dflash"):
            raise ValueError(f"spec must be 'off', 'ddtree' or 'dflash', got {spec!r}")
        if drafter is None or spec == "off":
            if spec in ("ddtree", "dflash"):
                raise ValueError(f"spec={spec!r} needs a drafter")
            return None
        from treeflash.speculative.decoder import make_spec_decoder

        decoder = make_spec_decoder(self.model, drafter, spec or "ddtree", tree_budget, self.device, self.dtype,
                                    self.runtime_options)
        if isinstance(decoder.drafter, nn.Module):  # (test drafters are not)
            set_options(decoder.drafter, self.runtime_options)
        return decoder

    # ---- public API --------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (tokenizer.json or tiktoken.model): "
                                 "pass prompts as lists of token ids")
            try:  # lone surrogates: what Python makes of non-UTF-8 bytes in argv or a file
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"the prompt is not valid UTF-8 text "
                                 f"(character {e.start}: {prompt[e.start]!r})") from None
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        return list(prompt)

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | None = None,
        on_step=None,
    ) -> list[RequestOutput]:
        """on_step(requests), if given, is called after every engine step (progress bars)."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts given")
        encoded = [self.encode(p) for p in prompts]
        for ids in encoded:  # refuse bad requests before running any
            self.engine.validate(ids, params)
        reqs = [self.engine.add_request(ids, params) for ids in encoded]
        try:
            while any(not r.finished for r in reqs):
                self.engine.step()
                if on_step is not None:
                    on_step(reqs)
        except BaseException:  # Ctrl-C or a failed step: else they keep their KV pages and run on
            for r in reqs:  # inside every later generate, whose caller never sees them
                if not r.finished:
                    self.engine.abort(r.request_id)
            raise
        return [self._output(r) for r in reqs]

    def chat(self, messages: Sequence[dict[str, str]], params: SamplingParams | None = None,
             add_generation_prompt: bool = True, on_step=None) -> RequestOutput:
        """One conversation ([{"role": ..., "content": ...}, ...]) through the chat template
        (the tokenizer's, or the plain one: `engine/chat.py`), completed as `generate` does."""
        from treeflash.engine.chat import ChatTemplate

        cfg = self.config
        template = ChatTemplate.for_tokenizer(self.tokenizer, cfg.bos_token_id, (cfg.eos_token_ids or (None,))[0])
        ids = template.encode([dict(m) for m in messages], add_generation_prompt)
        return self.generate(ids, params, on_step=on_step)[0]

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(
            req.request_id, req.prompt_ids, list(req.output_ids), req.text, req.finish_reason,
            dict(req.metrics),
        )

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int], chunk_size: int | None = None) -> torch.Tensor:
        """Next-token logits at every position, [len, vocab] float32 (CPU), via the paged cache."""
        ids = self.encode(token_ids)
        if not ids:
            raise ValueError("the prompt is empty")
        self.engine.validate(ids, SamplingParams(max_tokens=1))
        req = Request("score", ids, SamplingParams(max_tokens=1))
        chunk = chunk_size or self.engine.prefill_chunk
        self.pool.grow(req.pages, len(ids) + self.pool.scratch_tokens(chunk))
        saved = self.engine.prefill_chunk
        self.engine.prefill_chunk = chunk_size or saved
        try:
            rows = [lg.cpu() for lg, _ in self.engine.prefill_rows(req, ids, all_logits=True)]
        finally:
            self.engine.prefill_chunk = saved
            self.pool.release(req.pages)
        return torch.cat(rows)


def start_tensor_parallel(path, tp: int, ep: int, device: torch.device, dtype: torch.dtype,
                          attention_impl: str | None = None, options: RuntimeOptions | None = None,
                          dcp: int = 1):
    """Start (or, under torchrun, join) the tensor-parallel group for the checkpoint at
    `path`: this process is rank 0 and returns its `DistContext` (its `device` is this
    rank's); the followers load their shards and serve rank 0's steps. None for tp=1
    outside torchrun. Checks tp/ep against the checkpoint before starting any process."""
    from treeflash.parallel.launch import launched_by_torchrun, make_spec, start_group

    for name, value in (("tp", tp), ("ep", ep), ("dcp", dcp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if tp % ep:
        raise ValueError(f"ep={ep} must divide tp={tp}")
    if tp % dcp:
        raise ValueError(f"dcp={dcp} must divide tp={tp} (decode context parallelism splits the cache "
                         "across groups of tensor-parallel ranks)")
    if tp == 1 and not launched_by_torchrun():
        return None
    from treeflash.config import ModelConfig
    from treeflash.sharding import Parallel

    Parallel(tp, 0, ep).validate(ModelConfig.from_hf(path))  # before starting any process
    if device.type == "cuda" and not launched_by_torchrun():  # rank r runs on cuda:<base + r>
        base, count = device.index or 0, torch.cuda.device_count()
        if base + tp > count:
            raise ValueError(f"tp={tp} from {device} needs cuda:{base}..cuda:{base + tp - 1}, "
                             f"but {count} CUDA device(s) are visible")
    return start_group(make_spec(path, tp, ep, device, dtype, attention_impl, options or RuntimeOptions(), dcp))
