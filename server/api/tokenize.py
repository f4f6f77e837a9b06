"""POST /tokenize and /detokenize (vLLM's extras): what the server's tokenizer makes of a text.

Run on the API's tokenizer thread (tokens.py), never the engine's; they work while the engine sleeps.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from server.api import generation
from server.api.body import parse_body
from server.api.schemas import ChatMessage, ChatTemplateFields, RequestBody
from server.wire.params import InvalidRequestError

router = APIRouter()


class TokenizeRequest(ChatTemplateFields):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: `prompt`, or `messages` with the
    chat route's template fields (so both render the same tokens)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None  # type: ignore[assignment]
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    body = await parse_body(request, TokenizeRequest)
    generation.check_model(request, body.model)
    engine = request.app.state.engine
    tokens = request.app.state.tokens
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("send exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        ids = await tokens.encode_chat(body.template_messages(), **body.template_kwargs())
    else:
        ids = await tokens.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    strs = await tokens.token_strs(ids) if body.return_token_strs else None
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.info.max_model_len, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    body = await parse_body(request, DetokenizeRequest)
    generation.check_model(request, body.model)
    engine = request.app.state.engine
    vocab = engine.info.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise InvalidRequestError(f"token ids must be in [0, {vocab})", "tokens")
    text = await request.app.state.tokens.decode(body.tokens, skip_special_tokens=False)
    return {"prompt": text}
