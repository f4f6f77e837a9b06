"""POST /v1/chat/completions: the tokenizer's chat template renders the messages (on the engine
thread, which owns the tokenizer), then it is a completion over those token ids."""
from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.api import generation
from server.api.body import parse_body
from server.api.formatting import chat_choice, chat_logprobs, envelope, usage
from server.api.schemas import ChatCompletionRequest
from server.api.streaming import events, sse_response
from server.engine.outputs import RequestOutput
from server.engine.params import InvalidRequestError

router = APIRouter()

KIND = "chat.completion"
CHUNK_KIND = "chat.completion.chunk"
# Arguments the server passes to the template itself; a client may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                                      "return_dict", "return_tensors", "chat_template"})


class ChatChunks:
    def __init__(self, request_id: str, created: int, model: str, body: ChatCompletionRequest):
        self.head = (CHUNK_KIND, request_id, created, model)
        self.n = body.n
        self.include_usage = body.include_usage
        self.top_k = (body.top_logprobs or 0) if body.logprobs else None
        self.started = False
        self.finished: set[int] = set()

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return envelope(*self.head, [choice], **({"usage": None} if self.include_usage else {}))

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        result = []
        if not self.started:  # OpenAI opens every choice with the role, before any content
            self.started = True
            result += [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}) for i in range(self.n)]
        for o in out.outputs:
            if o.index in self.finished:
                continue
            if not o.delta_text and not o.delta_token_ids and o.finish_reason is None:
                continue
            lp = None
            if self.top_k is not None:
                lp = chat_logprobs(o.delta_token_ids, o.delta_logprobs or [], self.top_k)
            if o.finish_reason is not None:
                self.finished.add(o.index)
            delta = {"content": o.delta_text} if o.delta_text else {}
            result.append(self._chunk({"index": o.index, "delta": delta, "logprobs": lp,
                                       "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}))
        return result

    def tail(self, last: RequestOutput) -> list[dict[str, Any]]:
        return [envelope(*self.head, [], usage=usage(last))] if self.include_usage else []


def _template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if clash:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs")
    return kwargs


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    model = generation.check_model(request, body.model)
    params = body.to_params()
    messages = body.template_messages()
    kwargs = _template_kwargs(body)
    generation.check_available(request)
    engine = request.app.state.engine
    ids = await engine.call(lambda core: core.encode_chat(
        messages, add_generation_prompt=body.add_generation_prompt, **kwargs))
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    first, gen = await generation.start(request, request_id, None, ids, params)

    if body.stream:
        fmt = ChatChunks(request_id, created, model, body)
        return sse_response(events(first, gen, fmt.chunks, fmt.tail, lambda: engine.state))

    final = await generation.run_to_end(request, first, gen)
    choices = []
    for o in final.outputs:
        lp = chat_logprobs(o.token_ids, o.logprobs or [], body.top_logprobs or 0) if body.logprobs else None
        choices.append(chat_choice(o, lp))
    return JSONResponse(envelope(KIND, request_id, created, model, choices, usage=usage(final)))
