"""POST /v1/completions: one or several prompts; choices are prompt-major (index = prompt × n + i)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api import generation
from server.api.body import parse_body
from server.api.formatting import (CompletionLogprobs, TokenNames, completion_choice, encode_json, encoded_envelope,
                                   envelope, prompt_logprobs_json, routed_experts_json, usage)
from server.api.schemas import CompletionRequest, Prompt
from server.api.streaming import ENCODER, ChunkFrame, events, json_ids, json_str, sse_response
from server.wire.outputs import CompletionOutput, RequestOutput
from server.wire.params import InvalidRequestError, SamplingParams
from server.wire.prompt_check import check_prompt_ids

router = APIRouter()

KIND = "text_completion"


@dataclass
class CheckedPrompt:
    text: str | None
    token_ids: list[int]
    echo: str           # what `echo` puts before the output ("" without echo)
    first_piece: str    # the first prompt token's text (echo + logprobs lists it without a log-prob)


async def _check_prompts(request: Request, prompts: list[Prompt], params: SamplingParams,
                         echo: bool) -> list[CheckedPrompt]:
    """Every prompt checked (ids in range, fits the context) before any runs, so one bad prompt
    rejects the whole request, naming it. The engine's own checks, run here on the static facts:
    no round trip to the engine process."""
    info = request.app.state.engine.info
    tokens = request.app.state.tokens
    out = []
    for i, (text, ids) in enumerate(prompts):
        try:
            if ids is None:  # an empty text: the engine's message for it, after the params' own checks
                params.validate(info.vocab_size)
                raise InvalidRequestError("the prompt is empty; send at least one token of text", param="prompt")
            ids, _ = check_prompt_ids(ids, params, info.vocab_size, info.max_model_len)
        except InvalidRequestError as e:
            if len(prompts) > 1:
                raise InvalidRequestError(f"prompt[{i}]: {e}", e.param, e.code) from None
            raise
        shown = first = ""
        if echo:
            shown = text if text is not None else await tokens.decode(ids, skip_special_tokens=False)
            first = await tokens.decode(ids[:1], skip_special_tokens=False)
        out.append(CheckedPrompt(text, ids, shown, first))
    return out


class CompletionFormat:
    """Engine outputs → choices, for whole responses and stream chunks alike."""

    whole = True  # a whole response's choices always carry prompt_logprobs (null unless asked), as vLLM's do

    def __init__(self, body: CompletionRequest, prompts: list[CheckedPrompt]):
        self.body = body
        self.prompts = prompts
        self.names = TokenNames(body.return_tokens_as_token_ids)
        self.echo_logprobs = body.echo and body.logprobs is not None
        self.builders: dict[int, CompletionLogprobs] = {}

    def index(self, prompt: int, o: CompletionOutput) -> int:
        return prompt * self.body.n + o.index

    def choice(self, prompt: int, out: RequestOutput, o: CompletionOutput, text: str, token_ids: list[int],
               entries: list | None, first: bool) -> dict[str, Any]:
        """One choice: `first` (its first chunk, or a whole response) adds the echo and prompt parts."""
        body, p, key = self.body, self.prompts[prompt], self.index(prompt, o)
        extra: dict[str, Any] = {}
        lp = None
        if body.logprobs is not None:
            builder = self.builders.get(key)
            if builder is None:
                start = 0 if self.echo_logprobs else len(p.echo)
                builder = self.builders[key] = CompletionLogprobs(body.logprobs, start, self.names, p.first_piece)
            ids, lps = token_ids, entries if entries is not None else []
            if first and self.echo_logprobs and out.prompt_logprobs is not None:
                ids, lps = out.prompt_token_ids + ids, list(out.prompt_logprobs) + list(lps)
            lp = builder.build(ids, lps)
        if first:
            text = p.echo + text
            if body.return_token_ids:
                extra["prompt_token_ids"] = out.prompt_token_ids
            if body.prompt_logprobs is not None:
                extra["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, self.names)
            elif self.whole:
                extra["prompt_logprobs"] = None
        if body.return_token_ids:
            extra["token_ids"] = token_ids
        if body.return_routed_experts and o.routed_experts is not None:  # with the choice's end
            extra["routed_experts"] = routed_experts_json(o.routed_experts)
        return completion_choice(key, o, text, lp, **extra)


class CompletionChunks(CompletionFormat):
    """Each (prompt index, engine output) → one stream chunk per choice that has news, framed as SSE."""

    whole = False

    def __init__(self, request_id: str, created: int, model: str, body: CompletionRequest,
                 prompts: list[CheckedPrompt]):
        super().__init__(body, prompts)
        self.head = (KIND, request_id, created, model)
        frame = ChunkFrame(KIND, request_id, created, model, body.include_usage)
        self.frame, self.prefix, self.suffix = frame.frame, frame.prefix, frame.suffix
        # A chunk with text (and token ids) only, as text: most chunks of most streams.
        self.plain = body.logprobs is None
        self.with_ids = body.return_token_ids
        self.n = body.n
        self.started: set[int] = set()
        self.finished: set[int] = set()
        self.last: dict[int, RequestOutput] = {}

    def chunks(self, item: tuple[int, RequestOutput]) -> bytes:
        prompt, out = item
        self.last[prompt] = out
        result = []
        for o in out.outputs:
            key = prompt * self.n + o.index
            if key in self.finished:
                continue
            first = key not in self.started
            if o.finish_reason is None:
                if not first:
                    if not o.delta_text and not o.delta_token_ids:
                        continue
                    if self.plain:  # what frame(choice() + the encoder) would write, built as one string
                        ids = ',"token_ids":' + json_ids(o.delta_token_ids) if self.with_ids else ""
                        result.append(f'{self.prefix}{{"index":{key},"text":{json_str(o.delta_text)},"logprobs":null,'
                                      f'"finish_reason":null,"stop_reason":null{ids}}}{self.suffix}'.encode())
                        continue
            else:
                self.finished.add(key)
            self.started.add(key)
            choice = self.choice(prompt, out, o, o.delta_text, o.delta_token_ids, o.delta_logprobs, first)
            result.append(self.frame(ENCODER.encode(choice)))
        return b"".join(result)

    def tail(self) -> list[dict[str, Any]]:
        if not self.body.include_usage:
            return []
        return [envelope(*self.head, [], usage=usage([self.last[i] for i in sorted(self.last)]))]


async def _tokenize(request: Request, prompts: list[Prompt]) -> list[Prompt]:
    """Text prompts tokenized here, off the engine thread, each after a length check in characters;
    token ids bounded by the context before they travel to the engine. One bad prompt names itself."""
    tokens = request.app.state.tokens
    out: list[Prompt] = []
    for i, (text, ids) in enumerate(prompts):
        try:
            if text:  # an empty text keeps no ids: the engine refuses it as an empty prompt
                ids = await tokens.encode(text)
            if ids is not None:
                tokens.check_ids(ids)
        except InvalidRequestError as e:
            if len(prompts) > 1:
                raise InvalidRequestError(f"prompt[{i}]: {e}", e.param, e.code) from None
            raise
        out.append((text, ids))
    return out


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    model = generation.check_model(request, body.model)
    params = body.to_params()
    tokens = request.app.state.tokens
    if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], int):
        tokens.check_ids(body.prompt)  # bound a token-id prompt before walking it
    prompts = body.prompts()
    generation.check_available(request)
    params = await generation.compile_grammar(request, params, body.structured()[1])
    prompts = await _tokenize(request, prompts)
    engine = request.app.state.engine
    checked = await _check_prompts(request, prompts, params, body.echo)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    prompt_pairs = [(p.text, p.token_ids) for p in checked]

    if body.stream:
        started = await generation.start_many(request, request_id, prompt_pairs, params)
        fmt = CompletionChunks(request_id, created, model, body, checked)
        return sse_response(events(generation.merged(started), fmt.chunks, fmt.tail, lambda: engine.state))

    whole = CompletionFormat(body, checked)
    encoded: list[bytes] = [b""] * len(checked)

    def encode_choices(i: int, out: RequestOutput) -> None:
        # As each prompt's final output arrives, while the others still generate or wait to start: a
        # rollout's 2,048 choices (1M tokens with log-probs) took over a second to format and encode when all
        # waited for the last, and 3-4 s on the event loop when they waited for the last wave to start.
        choices = [whole.choice(i, out, o, o.text, o.token_ids, o.logprobs, True) for o in out.outputs]
        encoded[i] = encode_json(choices)[1:-1]  # the list's items, without its brackets

    finals = await generation.finish_many(request, request_id, prompt_pairs, params, encode_choices)
    return Response(encoded_envelope(KIND, request_id, created, model, encoded, usage=usage(finals)),
                    media_type="application/json")
