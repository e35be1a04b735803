"""OpenAI request and response shapes for /v1/completions and /v1/chat/completions.

Requests are validated strictly: no "5" -> 5 coercion, no `true` as an integer, and fields
that would change what a request means but are not implemented (logprobs, echo, tools,
penalties, vLLM/SGLang's min_p, repetition_penalty, guided decoding, ...) are refused with a
400 instead of being silently ignored. Other unknown fields are ignored, as OpenAI clients
send a few (`user`, ...). Responses are plain dicts
built here so the JSON is exactly the OpenAI shape, `null`s included.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_BATCH_PROMPTS = 64  # prompts in one /v1/completions call (each times n)
MAX_MESSAGES = 1024  # messages in one chat request


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        408: "invalid_request_error",
        413: "invalid_request_error",
        414: "invalid_request_error",
        431: "invalid_request_error",
        500: "internal_server_error",
        503: "service_unavailable",
    }

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # extra response headers (Connection: close after a cut body)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    kind = ApiError.TYPES.get(
        status, "invalid_request_error" if status < 500 else "internal_server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


# ---- requests ------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat; None means "the default" (clients send nulls)."""

    model: str | None = None  # None: the only model served (as vLLM does)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM, SGLang): 0 or -1 = off
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool | None = False  # extension (vLLM, SGLang)
    return_token_ids: bool | None = False  # extension (vLLM): token ids next to the text
    # Accepted only at their neutral values: anything else would be silently wrong.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    # vLLM / SGLang sampling and structured-output extensions clients send through extra_body:
    # not implemented, so refused unless neutral (ignored extra fields would be silently wrong).
    min_p: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    stop_token_ids: Any = None
    include_stop_str_in_output: Any = None
    use_beam_search: Any = None
    prompt_logprobs: Any = None
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    _NEUTRAL: ClassVar[dict[str, tuple]] = {  # the values that mean "off"; None (not sent) is always neutral
        "presence_penalty": (0,), "frequency_penalty": (0,), "min_p": (0,), "repetition_penalty": (1,),
        "min_tokens": (0,), "stop_token_ids": ([],), "include_stop_str_in_output": (False,),
        "use_beam_search": (False,),
    }
    _EXTENSIONS: ClassVar[tuple[str, ...]] = (
        "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
        "use_beam_search", "prompt_logprobs", "regex", "json_schema", "ebnf", "guided_json",
        "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    )

    def unsupported(self) -> list[str]:
        """Names of set fields this server does not implement."""
        names = ("presence_penalty", "frequency_penalty", *self._EXTENSIONS)
        bad = [k for k in names if getattr(self, k) is not None and getattr(self, k) not in self._NEUTRAL.get(k, ())]
        if self.logit_bias:
            bad.append("logit_bias")
        return bad


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        bad += [k for k in ("echo", "suffix") if getattr(self, k)]
        if self.logprobs is not None:
            bad.append("logprobs")
        if self.best_of not in (None, 1) and self.best_of != self.n:
            bad.append("best_of")
        return bad

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (each text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if isinstance(p[0], int):
            return [p]  # one tokenized prompt
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    """An image content part (OpenAI's image_url, the Responses API's input_image): parsed so
    that the request is refused with its reason, not as a malformed body."""

    type: Literal["image_url", "input_image", "image"]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True  # extension (vLLM)

    def image_parts(self) -> list[str]:
        """Where the request holds images, e.g. "messages[0].content[1] (image_url)"."""
        return [f"messages[{i}].content[{j}] ({p.type})" for i, m in enumerate(self.messages)
                if isinstance(m.content, list) for j, p in enumerate(m.content) if isinstance(p, ImagePart)]

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.logprobs or self.top_logprobs:
            bad.append("logprobs")
        if self.tools:
            bad.append("tools")
        if self.tool_choice not in (None, "none", "auto"):
            bad.append("tool_choice")
        if self.response_format and self.response_format.get("type") != "text":
            bad.append("response_format")
        return bad


# ---- responses -----------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_choice(
    index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None
) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(
    index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None
) -> dict[str, Any]:
    choice = {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_delta_choice(
    index: int, delta: dict[str, Any], finish_reason: str | None, token_ids: list[int] | None = None
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def envelope(
    kind: str,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict],
    usage_: dict | None = None,
    *,
    chunk: bool = False,
    with_usage: bool = True,
) -> dict[str, Any]:
    """A whole response (chunk=False) or one stream chunk; kind is 'completion' or 'chat'.
    Stream chunks carry "usage" (null until the last) only when include_usage was asked."""
    obj = {
        ("completion", False): "text_completion",
        ("completion", True): "text_completion",
        ("chat", False): "chat.completion",
        ("chat", True): "chat.completion.chunk",
    }[kind, chunk]
    out = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if with_usage:
        out["usage"] = usage_
    return out
