"""vLLM's utility routes, with its request and response shapes: GET /version, POST /tokenize
(a prompt, or chat messages through the chat template) and POST /detokenize. "model" is
optional in each, as in vLLM; another model's name is a 404 like on the completion routes.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import Request

import treeflash
from treeflash.server import protocol as P
from treeflash.server.guard import check_text
from treeflash.server.protocol import ApiError


class TokenizeRequest(P._Strict):
    """vLLM's TokenizeCompletionRequest or TokenizeChatRequest (`prompt` or `messages`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default True, for a prompt (messages: as the chat route)
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False


class DetokenizeRequest(P._Strict):
    model: str | None = None
    tokens: list[int]


def add_utility_routes(app: FastAPI, state) -> None:
    serving = state.serving

    @app.get("/version")
    async def version():
        return {"version": treeflash.__version__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        from treeflash.server.serving import _parse

        req = _parse(TokenizeRequest, await serving._body(request))
        serving.check_model(req.model)
        tok = _tokenizer(serving)
        ids = await _tokenize(serving, tok, req)
        strs = [tok.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": serving.engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        from treeflash.server.serving import _parse

        req = _parse(DetokenizeRequest, await serving._body(request))
        serving.check_model(req.model)
        tok = _tokenizer(serving)
        bad = next((t for t in req.tokens if not 0 <= t < serving.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {serving.vocab_size})", param="tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}


def _tokenizer(serving):
    if serving.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer")
    return serving.tokenizer


async def _tokenize(serving, tok, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give either prompt or messages", param="prompt")
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        return tok.encode(check_text(req.prompt, "prompt"), special)
    if not req.messages:
        raise ApiError(400, "messages is empty", param="messages")
    if req.add_special_tokens:
        raise ApiError(400, "add_special_tokens is for a prompt: messages get the special tokens their chat "
                       "template writes", param="add_special_tokens")
    chat = P.ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
    return await serving._encode_chat(chat)  # what /v1/chat/completions sends
