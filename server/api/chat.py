"""POST /v1/chat/completions: the tokenizer's chat template renders the messages (on the API's
tokenizer thread, tokens.py), then it is a completion over those token ids."""
from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.api import generation
from server.api.body import parse_body
from server.api.formatting import (TokenNames, chat_choice, chat_logprobs, envelope, prompt_logprobs_json,
                                   routed_experts_json, usage)
from server.api.schemas import ChatCompletionRequest
from server.api.streaming import ENCODER, ChunkFrame, events, json_ids, json_str, sse, sse_response
from server.wire.outputs import RequestOutput

router = APIRouter()

KIND = "chat.completion"
CHUNK_KIND = "chat.completion.chunk"


class ChatChunks:
    """Each engine output → one stream chunk per choice that has news, framed as SSE."""

    def __init__(self, request_id: str, created: int, model: str, body: ChatCompletionRequest):
        self.head = (CHUNK_KIND, request_id, created, model)
        frame = ChunkFrame(CHUNK_KIND, request_id, created, model, body.include_usage)
        self.frame, self.prefix, self.suffix = frame.frame, frame.prefix, frame.suffix
        self.body = body
        self.n = body.n
        self.include_usage = body.include_usage
        self.top_k = (body.top_logprobs or 0) if body.logprobs else None
        self.plain = self.top_k is None  # a chunk with text (and token ids) only, as text: most chunks
        self.with_ids = body.return_token_ids
        self.names = TokenNames(body.return_tokens_as_token_ids)
        self.started = False
        self.finished: set[int] = set()
        self.last: RequestOutput | None = None

    def chunks(self, item: tuple[int, RequestOutput]) -> bytes:
        _, out = item
        self.last = out
        result = []
        if not self.started:  # OpenAI opens every choice with the role, before any content
            self.started = True
            extra: dict[str, Any] = {}
            if self.body.return_token_ids:  # vLLM sends the prompt's ids once, on the first chunk
                extra["prompt_token_ids"] = out.prompt_token_ids
            if self.body.prompt_logprobs is not None:
                extra["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, self.names)
            for i in range(self.n):
                head = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}
                if i == 0 and extra:  # extras sit beside the choices: a chunk of its own shape
                    result.append(sse(envelope(*self.head, [head], **extra,
                                               **({"usage": None} if self.include_usage else {}))))
                else:
                    result.append(self.frame(ENCODER.encode(head)))
        for o in out.outputs:
            if o.index in self.finished:
                continue
            if not o.delta_text and not o.delta_token_ids and o.finish_reason is None:
                continue
            if o.finish_reason is None and self.plain:  # the common chunk, built as one string
                delta = '{"content":' + json_str(o.delta_text) + "}" if o.delta_text else "{}"
                ids = ',"token_ids":' + json_ids(o.delta_token_ids) if self.with_ids else ""
                result.append(f'{self.prefix}{{"index":{o.index},"delta":{delta},"logprobs":null,'
                              f'"finish_reason":null,"stop_reason":null{ids}}}{self.suffix}'.encode())
                continue
            lp = None
            if self.top_k is not None:
                lp = chat_logprobs(o.delta_token_ids, o.delta_logprobs or [], self.top_k, self.names)
            if o.finish_reason is not None:
                self.finished.add(o.index)
            delta_obj = {"content": o.delta_text} if o.delta_text else {}
            choice = {"index": o.index, "delta": delta_obj, "logprobs": lp, "finish_reason": o.finish_reason,
                      "stop_reason": o.stop_reason}
            if self.with_ids:
                choice["token_ids"] = o.delta_token_ids
            if self.body.return_routed_experts and o.routed_experts is not None:
                choice["routed_experts"] = routed_experts_json(o.routed_experts)
            result.append(self.frame(ENCODER.encode(choice)))
        return b"".join(result)

    def tail(self) -> list[dict[str, Any]]:
        if not self.include_usage or self.last is None:
            return []
        return [envelope(*self.head, [], usage=usage([self.last]))]


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    model = generation.check_model(request, body.model)
    params = body.to_params()
    request.app.state.tokens.check_count(len(body.messages), "messages")  # every message costs tokens
    messages = body.template_messages()
    kwargs = body.template_kwargs()
    generation.check_available(request)
    params = await generation.compile_grammar(request, params, body.structured()[1])
    engine = request.app.state.engine
    tokens = request.app.state.tokens
    ids = await tokens.encode_chat(messages, **kwargs)  # off the engine thread, bounded in characters first
    tokens.check_ids(ids, "messages")
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    started = [await generation.start(request, request_id, None, ids, params)]

    if body.stream:
        fmt = ChatChunks(request_id, created, model, body)
        return sse_response(events(generation.merged(started), fmt.chunks, fmt.tail, lambda: engine.state))

    (final,) = await generation.run_to_end(request, started)
    names = TokenNames(body.return_tokens_as_token_ids)
    choices = []
    for o in final.outputs:
        lp = chat_logprobs(o.token_ids, o.logprobs or [], body.top_logprobs or 0, names) if body.logprobs else None
        extra_choice: dict[str, Any] = {"token_ids": o.token_ids} if body.return_token_ids else {}
        if body.return_routed_experts and o.routed_experts is not None:
            extra_choice["routed_experts"] = routed_experts_json(o.routed_experts)
        choices.append(chat_choice(o, lp, **extra_choice))
    extra: dict[str, Any] = {}
    if body.return_token_ids:
        extra["prompt_token_ids"] = final.prompt_token_ids
    if body.prompt_logprobs is not None:
        extra["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs, names)
    return JSONResponse(envelope(KIND, request_id, created, model, choices, usage=usage([final]), **extra))
