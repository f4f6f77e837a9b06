"""POST /v1/completions."""
from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.api import generation
from server.api.body import parse_body
from server.api.formatting import CompletionLogprobs, completion_choice, envelope, usage
from server.api.schemas import CompletionRequest
from server.api.streaming import events, sse_response
from server.engine.outputs import RequestOutput

router = APIRouter()

KIND = "text_completion"


class CompletionChunks:
    """Turns each engine output into stream chunks: one per choice that has news."""

    def __init__(self, request_id: str, created: int, model: str, body: CompletionRequest, echo: str):
        self.head = (KIND, request_id, created, model)
        self.echo = echo
        self.include_usage = body.include_usage
        k = body.logprobs
        self.logprobs = {i: CompletionLogprobs(k, len(echo)) for i in range(body.n)} if k is not None else None
        self.started: set[int] = set()
        self.finished: set[int] = set()

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        result = []
        for o in out.outputs:
            if o.index in self.finished:
                continue
            text = o.delta_text
            if o.index not in self.started:
                self.started.add(o.index)
                text = self.echo + text
            if not text and not o.delta_token_ids and o.finish_reason is None:
                continue
            lp = None
            if self.logprobs is not None:
                lp = self.logprobs[o.index].build(o.delta_token_ids, o.delta_logprobs or [])
            if o.finish_reason is not None:
                self.finished.add(o.index)
            extra = {"usage": None} if self.include_usage else {}
            result.append(envelope(*self.head, [completion_choice(o, text, lp)], **extra))
        return result

    def tail(self, last: RequestOutput) -> list[dict[str, Any]]:
        return [envelope(*self.head, [], usage=usage(last))] if self.include_usage else []


async def _echo_text(request: Request, prompt: str | None, ids: list[int] | None) -> str:
    if prompt is not None:
        return prompt
    engine = request.app.state.engine
    return await engine.call(lambda core: core.tokenizer.decode(ids, skip_special_tokens=False))


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    model = generation.check_model(request, body.model)
    params = body.to_params()
    prompt, ids = body.prompt_input()
    generation.check_available(request)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    first, gen = await generation.start(request, request_id, prompt, ids, params)
    try:  # after admission, so the engine has already checked the token ids
        echo = await _echo_text(request, prompt, ids) if body.echo else ""
    except BaseException:
        await gen.aclose()  # type: ignore[attr-defined]
        raise
    engine = request.app.state.engine

    if body.stream:
        fmt = CompletionChunks(request_id, created, model, body, echo)
        return sse_response(events(first, gen, fmt.chunks, fmt.tail, lambda: engine.state))

    final = await generation.run_to_end(request, first, gen)
    choices = []
    for o in final.outputs:
        lp = None
        if body.logprobs is not None:
            lp = CompletionLogprobs(body.logprobs, len(echo)).build(o.token_ids, o.logprobs or [])
        choices.append(completion_choice(o, echo + o.text, lp))
    return JSONResponse(envelope(KIND, request_id, created, model, choices, usage=usage(final)))
