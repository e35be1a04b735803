"""The engine loop: admit requests, compute their positions, turn logits into tokens.

`Engine.step()` is one scheduling round: admit what fits (reserving its KV), compute at most
`prefill_chunk` prompt tokens of the requests still in prefill (whole chunks, oldest first),
then advance every request past its prefill by one decode or speculative step as a batch. A
step is thus bounded by one chunk plus one decode, whatever the prompts' lengths: an abort, a
shutdown or a newly arrived request waits at most that long. `LLM.generate` and the server
both drive this loop.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence

import torch

from treeflash.config import ModelConfig
from treeflash.engine.executor import LocalExecutor
from treeflash.engine.request import Request, Status, StepOutput
from treeflash.kvcache import KVPool
from treeflash.kvcache.defrag import defragment_request, is_laid_out
from treeflash.models.target import TargetModel
from treeflash.sampling import SamplingParams, choose_tokens, choose_tokens_batch
from treeflash.speculative.target import StepBatch


class Engine:
    def __init__(
        self,
        model: TargetModel,
        pool: KVPool,
        tokenizer=None,
        *,
        max_model_len: int,
        max_running: int = 64,
        prefill_chunk: int = 512,
        attention_impl: str | None = None,
        seed: int = 0,
        spec=None,
        executor=None,
        cuda_graphs: bool | str = False,
    ):
        """cuda_graphs: True replays CUDA graphs of the decode/verify forward on CUDA (and
        runs the same static-buffer path eagerly on the CPU); "eager" forces the latter."""
        self.model, self.pool, self.tokenizer = model, pool, tokenizer
        self.cfg: ModelConfig = model.cfg
        self.device = pool.kv.device
        self.max_model_len = max_model_len
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.attention_impl = attention_impl
        self.seed = seed
        self.spec = spec  # a treeflash.speculative.decoder.SpecDecoder, or None for plain decoding
        self.executor = executor or LocalExecutor(model, pool, attention_impl)
        if cuda_graphs:
            mode = "cuda" if cuda_graphs is True and self.device.type == "cuda" else "eager"
            self.executor.enable_graphs(mode, max_rows=self.verify_width, max_batch=max_running)
            if spec is not None and hasattr(spec, "enable_graphs"):
                spec.enable_graphs(mode)
        # Called as listener(request, num_drafted, num_accepted, budget) after every step of a
        # speculative request: a verify of a tree of `budget` nodes, or (budget 0, nothing
        # drafted) a plain step (the server's Prometheus counters subscribe here).
        self.spec_listeners: list = []
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests admitted in pieces (no free run was long enough) or, with pages smaller than
        # a tile, in a run off the coarse grid: moved into one aligned run by _defragment once
        # the pool's layout has changed (pool.version) since the last try.
        self.fragmented: list[Request] = []
        self._defrag_version = -1
        self._ids = itertools.count()
        self._seeds = itertools.count(1)
        self.eos_ids = set(self.cfg.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(tokenizer.eos_token_id)

    # ---- admission ---------------------------------------------------------------
    @property
    def verify_width(self) -> int:
        return 1 if self.spec is None else self.spec.verify_width

    def kv_tokens_needed(self, prompt_len: int, max_tokens: int) -> int:
        """Under DCP, plus room on every rank for one forward's rows (`KVPool.scratch_tokens`)."""
        rows = max(self.verify_width, self.prefill_chunk)
        return prompt_len + max_tokens + self.verify_width + self.pool.scratch_tokens(rows)

    @property
    def request_pages(self) -> int:
        """Pages that requests can ever hold: the pool less the pages the engine keeps for
        good (the graphs' scratch pages for padding rows). A request needing more would wait
        in the queue forever."""
        graphs = getattr(self.executor, "graphs", None)
        return self.pool.num_pages - (len(graphs.scratch_pages) if graphs is not None else 0)

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run; it loses nothing by being refused."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = self.cfg.vocab_size
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if n > self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, more than max_model_len={self.max_model_len}")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                f"exceeds max_model_len={self.max_model_len}"
            )
        pages = self.pool.pages_for(self.kv_tokens_needed(n, params.max_tokens))
        if pages > self.request_pages:
            raise ValueError(
                f"the request needs {pages} KV pages but the pool has only {self.request_pages} "
                f"for requests (of {self.pool.num_pages})"
            )

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        prompt_ids = [int(t) if isinstance(t, int) else t for t in prompt_ids]
        self.validate(prompt_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        # Unseeded requests draw distinct seeds from the engine's seed: a rerun reproduces them.
        seed = params.seed if params.seed is not None else self.seed * 1_000_003 + next(self._seeds)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        req = Request(rid, list(prompt_ids), params, generator=gen, arrival_time=time.monotonic())
        self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> bool:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                self._finish(req, "abort")
                return True
        for req in self.running:
            if req.request_id == request_id:
                self._finish(req, "abort")
                self.running.remove(req)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Request]:
        """Move waiting requests into the running batch while slots and KV pages last (their
        pages reserved now); `step` calls it first. Returns the requests admitted."""
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            need = self.pool.pages_for(self.kv_tokens_needed(len(req.prompt_ids), req.params.max_tokens))
            if need > self.pool.num_free_pages:
                break  # stays queued until pages come back
            self.waiting.popleft()
            self.pool.grow(req.pages, need * self.pool.tokens_per_page)
            if not self.pool.allocator.scattered and not is_laid_out(self.pool, req.pages):
                self.fragmented.append(req)
            req.status = Status.RUNNING
            self.running.append(req)
            admitted.append(req)
        return admitted

    # ---- the loop ----------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        self.admit()
        fresh = self._prefill_step()  # requests whose prompt was completed in this step
        # Tokens are emitted only after the executor says the step's results hold: with
        # tensor parallelism on NCCL a collective aborted mid-step returns without an error,
        # and the tokens read back after it would be garbage.
        self.executor.check()
        outputs.extend(self._emit(req, first) for req, first in fresh)
        done = {id(req) for req, _ in fresh}
        # Past prefill (a first token) and not just out of it: one decode or verify row each.
        active = [r for r in self.running if not r.finished and r.output_ids and id(r) not in done]
        if active:
            if self.spec is None:
                new = self._decode(active)
            else:
                new = self.spec.step(self, StepBatch(active, solo=len(self.running) == 1))
            self.executor.check()
            outputs.extend(self._emit(r, toks) for r, toks in zip(active, new))
        self.running = [r for r in self.running if not r.finished]
        self._defragment()
        return outputs

    def _defragment(self) -> None:
        """Move each fragmented running request into a free run, if one is long enough now
        (aligned for the coarse view where pages are small: `kvcache.defrag.is_laid_out`).

        Between steps: the copies are enqueued after this step's kernels and before the
        next step's, whose page tables are rebuilt (defragment_request bumps pool.version).
        A distributed executor moves its followers' pages too (`pool.on_move`); any other
        executor than these two is left alone. The scattered mode (a benchmark of the
        incident's layout) is never set fragmented."""
        if not self.fragmented or self.pool.version == self._defrag_version:
            return
        if type(self.executor) is not LocalExecutor and not getattr(self.executor, "moves_pages", False):
            self.fragmented.clear()
            return
        self.fragmented = [r for r in self.fragmented
                           if not r.finished and not defragment_request(self.pool, r.pages)]
        self._defrag_version = self.pool.version

    def _emit(self, req: Request, tokens: list[int]) -> StepOutput:
        kept = self._append(req, tokens)
        return StepOutput(req.request_id, kept, req.finished, req.finish_reason)

    # ---- model calls -------------------------------------------------------------
    def forward(
        self,
        reqs: list[Request],
        input_ids: torch.Tensor,  # [B, N]
        positions: torch.Tensor,  # [B, N]
        prefix_lens: torch.Tensor | Sequence[int],  # [B] committed tokens before the rows
        tree_mask: torch.Tensor | None = None,
        taps: Sequence[int] = (),
        graphable: bool = False,
        commit_later: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write the rows' latents after each request's prefix and return (hidden, taps).

        graphable: a decode or verify step (shapes that repeat), which the executor may
        serve from a CUDA graph when graphs are enabled (hidden is then valid until the
        next graphable forward). commit_later: a verify, whose rows the executor's commit
        keeps or drops (under DCP they stay scratch until then)."""
        extra = {"graphable": True} if graphable and getattr(self.executor, "graphs", None) else {}
        if commit_later and self.pool.dcp > 1:  # (without DCP the rows are in place already)
            extra["commit_later"] = True
        if isinstance(prefix_lens, torch.Tensor) and type(self.executor).forward is not LocalExecutor.forward:
            # An executor that ships the step to other ranks packs host ints; reading a device
            # tensor back would be one sync per request. Rows always start at num_cached.
            prefix_lens = [r.num_cached for r in reqs]
        return self.executor.forward([r.pages for r in reqs], input_ids, positions, prefix_lens,
                                     tree_mask, taps, **extra)

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """float32=False: in the model's dtype (see TargetModel.logits)."""
        return self.executor.logits(hidden, float32)

    def commit(self, reqs: list[Request], prefix_lens: torch.Tensor, accept_idx: torch.Tensor,
               num_rows: torch.Tensor) -> None:
        """Keep each request's accepted verify rows (accept_idx [B, M], root first; num_rows [B])
        in sequential slots after its prefix (a verify forward with commit_later)."""
        self.executor.commit([r.pages for r in reqs], prefix_lens, accept_idx, num_rows)

    @property
    def verify_graphs(self):
        """The executor's verify graphs (engine/graphs.py VerifyGraphs), None without them."""
        return getattr(self.executor, "graphs", None)

    def moe_expert_counts(self) -> list[torch.Tensor]:
        """Per MoE layer, the experts its router picked in the last forward (on the device)."""
        return self.model.moe_expert_counts()

    def step_costs(self, drafter):
        """The auto tree budget's `costs.StepCostModel` for this target, its KV rows and `drafter`:
        `costs.default_ceilings` on CUDA; elsewhere a quick probe (only the model's shape
        matters, the fit to measured steps scales it)."""
        from treeflash import costs

        dtype = self.pool.dtype  # the values' dtype (an fp8 cache stores uint8 rows)
        if self.device.type == "cuda":
            ceilings = costs.default_ceilings(self.device, dtype)
        else:
            ceilings = costs.measure_ceilings(self.device, dtype, seconds=0.02)
        model = costs.ModelCosts.of(self.model, drafter, self.pool.format.row_bytes)
        return costs.StepCostModel(model, ceilings)

    def prefill_rows(
        self, req: Request, ids: Sequence[int], *, all_logits: bool = False, taps: Sequence[int] = ()
    ):
        """Run `ids` after the request's committed KV in chunks; yields (logits, taps) per chunk."""
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = list(ids[start : start + self.prefill_chunk])
            pos0 = req.num_cached
            input_ids = torch.tensor([chunk], dtype=torch.long)
            positions = torch.arange(pos0, pos0 + len(chunk)).unsqueeze(0)
            hidden, tapped = self.forward([req], input_ids, positions, [pos0], taps=taps)
            req.num_cached += len(chunk)
            rows = hidden[0] if all_logits else hidden[0, -1:]
            yield self.logits(rows), (tapped[0] if tapped is not None else None)

    def _prefill_step(self) -> list[tuple[Request, list[int]]]:
        """This step's prefill: whole chunks (on the prefill_rows grid, so the numbers are
        those of an uninterrupted prefill) of the oldest requests still in prefill, up to
        prefill_chunk tokens in all (the first chunk always runs). Returns (request, [first
        token]) for each request whose prompt is now complete."""
        budget, done = self.prefill_chunk, []
        for req in [r for r in self.running if not r.finished and not r.output_ids]:
            size = min(self.prefill_chunk, len(req.prompt_ids) - req.num_cached)
            if size > budget:
                break
            budget -= size
            first = self._prefill(req)
            if first is not None:
                done.append((req, first))
        return done

    def _prefill(self, req: Request) -> list[int] | None:
        """Compute the request's next prompt chunk; at the prompt's end return [first token]
        (and hand the tapped features of the whole prompt to the drafter), else None."""
        taps = self.spec.tap_layers if self.spec is not None else ()
        start = req.num_cached
        chunk = req.prompt_ids[start : start + self.prefill_chunk]
        (logits, tapped), = self.prefill_rows(req, chunk, taps=taps)
        if tapped is not None:
            req.prefill_features.append(tapped)
        if req.num_cached < len(req.prompt_ids):
            return None
        first = int(choose_tokens(logits[-1:], req.params, req.generator)[0])
        if self.spec is not None:
            self.spec.on_prefill(self, req, torch.cat(req.prefill_features), first)
        req.prefill_features = []
        return [first]

    def _decode(self, reqs: list[Request]) -> list[list[int]]:
        # One host-to-device copy in (ids, positions), one device-to-host copy out (tokens).
        host = torch.tensor([[r.output_ids[-1], r.num_cached] for r in reqs], dtype=torch.long)
        ids, positions = host.to(self.device, non_blocking=True).split(1, dim=1)  # [B, 1] each
        hidden, _ = self.forward(reqs, ids, positions, positions[:, 0], graphable=True)
        # [B, V] in the model's dtype: choose_tokens_batch computes in float32 itself
        logits = self.logits(hidden[:, 0], float32=False)
        tokens = choose_tokens_batch(logits, [r.params for r in reqs], [r.generator for r in reqs])
        for req in reqs:
            req.num_cached += 1
        return [[t] for t in tokens.tolist()]

    # ---- tokens and finishing ----------------------------------------------------
    def _append(self, req: Request, tokens: list[int]) -> list[int]:
        """Append tokens until a stop condition; returns those kept."""
        kept = []
        if req.first_token_time is None and tokens:
            req.first_token_time = time.monotonic()
        for tok in tokens:
            if req.finished:
                break
            req.output_ids.append(tok)
            kept.append(tok)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
        return kept

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if tok in self.eos_ids and not p.ignore_eos:
            return "stop"
        if p.stop and self.tokenizer is not None and self._stop_in_tail(req):
            text = self.decode(req.output_ids)
            hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
            if hits:
                req.text = text[: min(hits)]
                req.text_final = True
                return "stop"
        if len(req.output_ids) >= p.max_tokens:
            return "length"
        return None

    def _stop_in_tail(self, req: Request) -> bool:
        """Whether a stop string ends in the last tokens: a token is >= 1 byte and a character
        <= 4 bytes, so a stop string of L characters lies within the last 4L tokens (+ a margin
        for a split character at the window's start). O(1) per token; the full text is decoded
        only on a hit."""
        window = 4 * max(len(s) for s in req.params.stop) + 8
        tail = self.decode(req.output_ids[-window:])
        return any(s in tail for s in req.params.stop)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        now = time.monotonic()
        first = req.first_token_time
        req.metrics["timing"] = {  # decode = after the first token (which prefill produced)
            "ttft_s": None if first is None else first - req.arrival_time,
            "decode_s": None if first is None else now - first,
            "decode_tokens": max(0, len(req.output_ids) - 1),
        }
        if not req.text_final:
            req.text = self.decode(req.output_ids)
        if self.spec is not None:
            self.spec.on_finish(req)
        if req.pages:
            self.pool.release(req.pages)
