"""/v1/completions and /v1/chat/completions: validate, tokenize, submit, stream or collect.

Every check that can refuse a request runs before it reaches the engine (schema, model,
unsupported fields, n, sampling parameters, context length, vocabulary, KV feasibility), so
a refused request costs nothing and the engine only ever sees requests that can run. Each
choice (n, and each prompt of a batch) is one engine request; choice i of a seeded request
uses seed + i so the n samples differ and the whole response is reproducible.

Chat prompts use the tokenizer's chat template (Jinja, sandboxed) when it has one, else the
documented plain template `PLAIN_CHAT_TEMPLATE`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from treeflash.engine.chat import PLAIN_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError  # noqa: F401
from treeflash.sampling import SamplingParams
from treeflash.server import protocol as P
from treeflash.server.async_engine import AsyncEngine, Event, Submission, Unavailable
from treeflash.server.guard import check_text, read_json
from treeflash.server.protocol import ApiError

log = logging.getLogger("treeflash.server")

_PARAM_NAMES = {"max_tokens", "temperature", "top_p", "top_k", "seed"}
MAX_SEED = 2**62  # seeds are |seed| < 2**62 so seed + i stays inside int64


@dataclass
class Choice:
    """Streaming state of one choice: token ids so far and the text already sent."""

    holdback: int  # chars kept back while a stop string could still be completing
    token_ids: list[int]
    sent: str = ""
    finish_reason: str | None = None
    # Incremental detokenisation (vLLM's scheme): `decoded` is the text of token_ids[:read];
    # new tokens are decoded together with token_ids[prefix:read] for context, so each event
    # costs O(new tokens), not a decode of the whole output.
    decoded: str = ""
    prefix: int = 0
    read: int = 0

    def _decode_new(self, decode) -> None:
        ids = self.token_ids
        before = decode(ids[self.prefix : self.read])
        after = decode(ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):  # not mid-character
            self.decoded += after[len(before) :]
            self.prefix, self.read = self.read, len(ids)

    def advance(self, event: Event, decode) -> str:
        """Append the event's tokens; return the text that is now safe to send."""
        self.token_ids.extend(event.token_ids)
        if event.finished:
            self.finish_reason = event.finish_reason
            text = event.text if event.text is not None else decode(self.token_ids)
        else:
            self._decode_new(decode)
            text = self.decoded[: max(len(self.decoded) - self.holdback, 0)]
        # Normally `text` extends what was sent; if a merge rewrote sent text, send only the tail.
        delta = text[len(self.sent) :]
        self.sent += delta
        return delta


@dataclass
class Plan:
    """A validated request, ready to submit."""

    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    choices: list[tuple[int, list[int], SamplingParams]]
    prompt_tokens: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    holdback: int


class OpenAIServing:
    def __init__(self, llm, async_engine: AsyncEngine, cfg):
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.vocab_size = llm.config.vocab_size
        self.async_engine = async_engine
        self.cfg = cfg
        cfg_model = llm.engine.cfg
        self.chat_template = ChatTemplate.for_tokenizer(
            self.tokenizer, cfg_model.bos_token_id, (cfg_model.eos_token_ids or (None,))[0], on_error=log.warning)
        self.template_source = self.chat_template.source

    # ---- entry points --------------------------------------------------------------
    async def completions(self, request: Request):
        req = _parse(P.CompletionRequest, await self._body(request))
        self._check_common(req)
        prompts = req.prompts()
        if not prompts:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(prompts) > P.MAX_BATCH_PROMPTS:
            raise ApiError(
                400,
                f"at most {P.MAX_BATCH_PROMPTS} prompts per request, got {len(prompts)}",
                param="prompt",
            )
        encoded = [await self._encode(p) for p in prompts]
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        plan = self._plan("completion", P.new_id("cmpl"), req, encoded, lambda ids: max_tokens)
        return await self._run(request, plan)

    async def chat(self, request: Request):
        req = _parse(P.ChatCompletionRequest, await self._body(request))
        self._check_common(req)
        if not req.messages:
            raise ApiError(400, "messages is empty", param="messages")
        ids = await self._encode_chat(req)
        limit = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        # No max_tokens: generate up to the context length (what vLLM does for chat), or what
        # the KV pool can ever hold when that is less.
        budget = (lambda ids: limit) if limit is not None else self._room
        plan = self._plan("chat", P.new_id("chatcmpl"), req, [ids], budget)
        return await self._run(request, plan)

    async def _body(self, request: Request) -> dict[str, Any]:
        return await read_json(request, self.cfg.max_body_bytes, self.cfg.request_read_timeout)

    # ---- validation ----------------------------------------------------------------
    def check_model(self, name: str | None) -> str:
        """The served model's name for a request's "model" (absent: the only model, as vLLM); 404
        for another."""
        if name is not None and name != self.cfg.model_name:
            raise ApiError(
                404,
                f"The model `{name[:200]}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return self.cfg.model_name

    def _check_common(self, req) -> None:
        req.model = self.check_model(req.model)
        bad = req.unsupported()
        if bad:
            raise ApiError(400, f"unsupported parameter(s): {', '.join(bad)}", param=bad[0])
        n = 1 if req.n is None else req.n
        if not 1 <= n <= self.cfg.max_n:
            raise ApiError(
                400, f"n must be between 1 and {self.cfg.max_n} (--max-n), got {n}", param="n"
            )
        best_of = getattr(req, "best_of", None)  # completions only
        if best_of is not None and best_of < n:  # OpenAI's rule: best_of >= n
            raise ApiError(400, f"best_of must be at least n ({n}), got {best_of}", param="best_of")
        if req.stream_options is not None and not req.stream:  # OpenAI refuses it too
            raise ApiError(
                400, "stream_options is only allowed when stream is true", param="stream_options"
            )
        if req.seed is not None and not -MAX_SEED < req.seed < MAX_SEED:
            raise ApiError(
                400, f"seed must be an integer with |seed| < 2**62, got {req.seed}", param="seed"
            )
        for s in [req.stop] if isinstance(req.stop, str) else req.stop or []:
            check_text(s, "stop")

    async def _encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        check_text(prompt, "prompt")
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if self.tokenizer is None:
            raise ApiError(
                400, "this model has no tokenizer: send prompts as token ids", param="prompt"
            )
        if len(prompt) < 4096:
            return self.tokenizer.encode(prompt, add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens)  # keep the loop free

    def _params(self, req, max_tokens: int, index: int) -> SamplingParams:
        top_k = req.top_k if req.top_k not in (None, -1) else 0
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=top_k,
                seed=None if req.seed is None else req.seed + index,
                stop=req.stop,
                ignore_eos=bool(req.ignore_eos),
            )
        except ValueError as e:
            word = str(e).split(" ", 1)[0]
            raise ApiError(400, str(e), param=word if word in _PARAM_NAMES else "stop") from None

    def _check_context(self, ids: list[int], params: SamplingParams) -> None:
        n, m, limit = len(ids), params.max_tokens, self.engine.max_model_len
        if n >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt has {n} tokens, which leaves no room for a completion.",
                param="prompt",
                code="context_length_exceeded",
            )
        if n + m > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {n + m} tokens ({n} in the prompt, {m} for the completion). "
                "Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        try:
            self.engine.validate(ids, params)  # vocabulary, KV pages the pool can ever hold
        except ValueError as e:
            param = "prompt" if "token id" in str(e) or "empty" in str(e) else "max_tokens"
            raise ApiError(400, str(e), param=param) from None

    def _plan(self, kind: str, request_id: str, req, encoded: list[list[int]], budget) -> Plan:
        n = 1 if req.n is None else req.n
        choices = []
        for p, ids in enumerate(encoded):
            for i in range(n):
                params = self._params(req, budget(ids), i)
                if i == 0:
                    self._check_context(ids, params)
                choices.append((p * n + i, ids, params))
        stops = choices[0][2].stop
        opts = req.stream_options
        return Plan(
            kind,
            request_id,
            req.model,
            choices,
            sum(len(ids) for ids in encoded),
            bool(req.stream),
            bool(req.stream and opts and opts.include_usage),
            bool(req.return_token_ids),
            max((len(s) for s in stops), default=1) - 1,
        )

    def _room(self, ids: list[int]) -> int:
        pool = self.engine.pool
        capacity = self.engine.request_pages * pool.page_size - self.engine.verify_width
        return max(min(self.engine.max_model_len, capacity) - len(ids), 1)

    # ---- chat template -------------------------------------------------------------
    async def _encode_chat(self, req: P.ChatCompletionRequest) -> list[int]:
        """The conversation through the chat template (engine/chat.py: special tokens only where
        the template writes them)."""
        images = req.image_parts()
        if images:
            raise ApiError(400, f"{images[0]}: image inputs are not supported: treeflash runs the "
                           "language model only (a checkpoint's vision tower is not loaded)", param="messages")
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send prompts as token ids", param="messages")
        messages = [
            {"role": m.role, "content": check_text(m.text(), "messages")} for m in req.messages
        ]
        agp = req.add_generation_prompt is not False
        try:
            if sum(len(m["content"]) for m in messages) < 4096:
                return self.chat_template.encode(messages, agp)
            return await asyncio.to_thread(self.chat_template.encode, messages, agp)  # keep the loop free
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None

    # ---- running -------------------------------------------------------------------
    async def _run(self, request: Request, plan: Plan):
        limit = self.async_engine.max_queued
        if len(plan.choices) > limit:  # would be told "queue full" for ever: not a 503
            raise ApiError(
                400,
                f"this request has {len(plan.choices)} choices (prompts x n), more than the "
                f"{limit} the server ever queues (--max-queued-requests)",
                param="n",
            )
        try:
            sub = self.async_engine.submit(plan.choices, request_id=plan.request_id)
        except Unavailable as e:
            self.async_engine.metrics.on_reject("unavailable")
            raise ApiError(503, str(e)) from None
        if plan.stream:
            # The status line goes out with the first byte of the stream: wait until the engine
            # has taken every choice, so that a refusal (shutting down, a config change) is
            # answered with its own status, not 200 and an error frame.
            try:
                early = await self._until_accepted(request, plan, sub)
            except BaseException:
                sub.abort()
                raise
            return _AbortingStream(
                self._stream(plan, sub, early),
                on_close=sub.abort,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            return JSONResponse(await self._collect(request, plan, sub))
        finally:
            sub.abort()

    async def _until_accepted(self, request: Request, plan: Plan, sub: Submission) -> list[Event]:
        """Wait for every choice's `accepted` event; returns the other events that came
        meanwhile (a choice may start before the next is taken). Raises the refusal's ApiError."""
        pending, early = len(plan.choices), []
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while pending:
                event = await _next_event(sub, gone)
                self._check_refused(event)
                if event.accepted:
                    pending -= 1
                else:
                    early.append(event)
        finally:
            gone.cancel()
        return early

    def _check_refused(self, event: Event) -> None:
        """A choice the engine never took: the whole HTTP request is refused (counted once)."""
        if event.refused:
            self.async_engine.metrics.on_reject("unavailable" if event.status == 503 else "invalid")
            raise ApiError(event.status, event.error or "the engine refused the request")

    def _new_choices(self, plan: Plan) -> list[Choice]:
        return [Choice(plan.holdback, []) for _ in plan.choices]

    def _decode(self, ids: list[int]) -> str:
        return self.engine.decode(ids)

    async def _collect(self, request: Request, plan: Plan, sub: Submission) -> dict[str, Any]:
        choices, metrics = self._new_choices(plan), None
        gone = asyncio.ensure_future(_wait_disconnect(request))
        remaining = len(choices)
        try:
            while remaining:
                event = await _next_event(sub, gone)
                self._check_refused(event)
                if event.accepted:
                    continue
                choices[event.index].advance(event, self._decode)
                if event.finished:
                    remaining -= 1
                    metrics = event.metrics
                if event.error:
                    raise ApiError(event.status, event.error)
        finally:
            gone.cancel()
        make = P.completion_choice if plan.kind == "completion" else P.chat_choice
        body = P.envelope(
            plan.kind,
            plan.request_id,
            P.now(),
            plan.model,
            [
                make(i, c.sent, c.finish_reason, c.token_ids if plan.return_token_ids else None)
                for i, c in enumerate(choices)
            ],
            self._usage(plan, choices),
        )
        self._attach_spec_metrics(body, plan, metrics)
        return body

    async def _stream(self, plan: Plan, sub: Submission, early: list[Event]):
        created, choices, metrics = P.now(), self._new_choices(plan), None

        def frame(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        def chunk(entries: list[dict], usage_=None) -> str:
            return frame(
                P.envelope(
                    plan.kind,
                    plan.request_id,
                    created,
                    plan.model,
                    entries,
                    usage_,
                    chunk=True,
                    with_usage=plan.include_usage,
                )
            )

        if plan.kind == "chat":
            for i in range(len(choices)):
                yield chunk([P.chat_delta_choice(i, {"role": "assistant", "content": ""}, None)])
        remaining = len(choices)
        while remaining:
            event = early.pop(0) if early else await sub.queue.get()
            if event.accepted:
                continue
            delta = choices[event.index].advance(event, self._decode)
            if event.finished:
                remaining -= 1
                metrics = event.metrics
            if event.error:
                yield frame(P.error_body(event.status, event.error))
            if delta or event.finished or (plan.return_token_ids and event.token_ids):
                yield chunk([self._chunk_choice(plan, event, delta)])
        if plan.include_usage:
            last = P.envelope(
                plan.kind,
                plan.request_id,
                created,
                plan.model,
                [],
                self._usage(plan, choices),
                chunk=True,
            )
            self._attach_spec_metrics(last, plan, metrics)
            yield frame(last)
        yield "data: [DONE]\n\n"

    def _chunk_choice(self, plan: Plan, event: Event, delta: str) -> dict:
        ids = event.token_ids if plan.return_token_ids else None
        reason = event.finish_reason if event.finished else None
        if plan.kind == "completion":
            return P.completion_choice(event.index, delta, reason, ids)
        return P.chat_delta_choice(event.index, {"content": delta} if delta else {}, reason, ids)

    @staticmethod
    def _usage(plan: Plan, choices: list[Choice]) -> dict[str, int]:
        return P.usage(plan.prompt_tokens, sum(len(c.token_ids) for c in choices))

    def _attach_spec_metrics(self, body: dict, plan: Plan, metrics: dict | None) -> None:
        """vLLM's per-request `metrics.speculative_decoding` (opt-in; null when n > 1)."""
        mode = self.cfg.per_request_spec_decode_metrics
        if mode == "none":
            return
        spec = (metrics or {}).get("speculative_decoding") if len(plan.choices) == 1 else None
        if spec is not None and mode == "summary":
            spec = {k: v for k, v in spec.items() if not k.startswith("per_step_")}
        body["metrics"] = {"speculative_decoding": spec}


class _AbortingStream(StreamingResponse):
    """Aborts the engine requests however the response ends (done, disconnect, cancel) -
    even when the body generator never started, so its own `finally` would not run."""

    def __init__(self, content, *, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next_event(sub: Submission, gone: asyncio.Future) -> Event:
    get = asyncio.ensure_future(sub.queue.get())
    try:
        await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not get.done():
            get.cancel()  # also when this handler itself is cancelled
    if not get.done():  # cancel() only asks: the task is not cancelled before it runs again
        raise ApiError(400, "the client disconnected")
    return get.result()


def _parse(model: type[BaseModel], data: dict) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        field = ".".join(x for x in loc if not any(c in x for c in "[]'")) or None
        more = f" (and {e.error_count() - 1} more errors)" if e.error_count() > 1 else ""
        raise ApiError(
            400, f"{field or 'body'}: {err['msg']}{more}", param=loc[0] if loc else None
        ) from None
