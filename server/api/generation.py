"""One request's trip through the engine, shared by the completions and chat routes.

The two things every generation route must get right live here: refusing at once while the engine
cannot serve when told to (--while-asleep reject: 503 from the published state, no round trip), and
aborting the engine request (which frees its KV blocks, or drops a held request before it reaches the
engine) whenever the client goes away, streaming or not.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request

from server.api.errors import APIError
from server.wire.outputs import RequestOutput
from server.wire.params import SamplingParams

T = TypeVar("T")


class ClientDisconnected(APIError):
    def __init__(self) -> None:
        # 499 (nginx's "client closed request"): nobody reads it, but the access log says what happened.
        super().__init__(499, "the client closed the connection; the request was aborted")


def check_model(request: Request, model: str | None) -> str:
    """The served name; 404 for any other model name. Omitting `model` means the served one."""
    served: str = request.app.state.served_model_name
    if model is not None and model != served:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served!r} "
                            "(see GET /v1/models)", "model", "model_not_found")
    return served


def check_available(request: Request) -> None:
    """With --while-asleep reject: 503 at once while the engine cannot serve. Otherwise a request
    that arrives while paused or asleep is held by the engine (bounded) and served after wake."""
    request.app.state.engine.refuse_now()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, but cancel it (its cleanup aborts the engine request) if the client leaves.
    Starlette watches for disconnects only while a StreamingResponse streams; this covers the rest."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()


def generate(request: Request, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
             params: SamplingParams) -> AsyncIterator[RequestOutput]:
    """engine.generate with the request's metrics (the engine's generator calls the tracker: no generator
    around it for a streamed output to pass through). Close it (aclose) when done early: that aborts the request."""
    tracker = request.app.state.metrics.track(time.monotonic(), params)
    return request.app.state.engine.generate(request_id, prompt, prompt_token_ids, params, tracker)


async def compile_grammar(request: Request, params: SamplingParams, param: str) -> SamplingParams:
    """Compile the request's grammar in the engine process, on a command thread (cached by spec), so a
    slow compile never holds up the engine thread or the event loop; 400 naming `param` if it cannot be
    compiled. The add that follows finds it in the engine's cache."""
    if params.structured_outputs is not None:
        await request.app.state.engine.compile_grammar(params.structured_outputs, param)
    return params


Started = tuple[RequestOutput, AsyncIterator[RequestOutput]]


async def _first(request: Request, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                 params: SamplingParams) -> Started:
    gen = generate(request, request_id, prompt, prompt_token_ids, params)
    try:
        first = await gen.__anext__()
    except BaseException:
        await gen.aclose()
        raise
    return first, gen


async def start(request: Request, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                params: SamplingParams) -> Started:
    """Submit and wait for the first output, so that errors the engine finds on admission (prompt
    over the context, the engine falling asleep meanwhile) still answer with their own status
    instead of a 200 stream that carries an error."""
    return (await start_many(request, request_id, [(prompt, prompt_token_ids)], params))[0]


def _engine_ids(request_id: str, prompts: int) -> list[str]:
    """The engine request id of each prompt of one API request: the request's own for one, `<id>-<i>` for several."""
    return [request_id] if prompts == 1 else [f"{request_id}-{i}" for i in range(prompts)]


async def start_many(request: Request, request_id: str, prompts: list[tuple[str | None, list[int] | None]],
                     params: SamplingParams) -> list[Started]:
    """start() for every prompt at once (engine request ids: _engine_ids). If any fails, the others are
    aborted and the error is raised."""
    tasks = [asyncio.ensure_future(_first(request, rid, text, tokens, params))
             for rid, (text, tokens) in zip(_engine_ids(request_id, len(prompts)), prompts)]

    async def all_started() -> list[Started]:
        return list(await asyncio.gather(*tasks))

    try:
        return await unless_disconnected(request, all_started())
    except BaseException:
        for t in tasks:
            t.cancel()
        for r in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(r, tuple):
                await r[1].aclose()  # type: ignore[attr-defined]
        raise


async def _interleaved(streams: list[Callable[[], AsyncIterator[RequestOutput]]]
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every stream's outputs as they come, tagged with the stream's index, each stream opened and read by a
    task of its own; a stream's error is raised. Closing it cancels the tasks (the callers close the streams)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, open_stream: Callable[[], AsyncIterator[RequestOutput]]) -> None:
        try:
            async for out in open_stream():
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except Exception as e:
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, open_stream)) for i, open_stream in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                left -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _from_first(first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    if not first.finished:
        async for out in gen:
            yield out


async def merged(started: list[Started]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every prompt's outputs as they come, tagged with the prompt's index. Closing it aborts them all."""
    try:
        if len(started) == 1:  # one prompt (chat, most completions): its outputs as they are, no task or queue
            first, gen = started[0]  # read here, not through _from_first: one generator fewer per chunk
            yield 0, first
            if not first.finished:
                async for out in gen:
                    yield 0, out
            return
        async with contextlib.aclosing(_interleaved([functools.partial(_from_first, first, gen)
                                                     for first, gen in started])) as outs:
            async for item in outs:
                yield item
    finally:
        for _, gen in started:
            await gen.aclose()  # type: ignore[attr-defined]


async def finish_many(request: Request, request_id: str, prompts: list[tuple[str | None, list[int] | None]],
                      params: SamplingParams, on_final: Callable[[int, RequestOutput], None]) -> list[RequestOutput]:
    """A non-streamed request's prompts: submit them all and return the final output of each, calling
    on_final(i, output) as each prompt finishes, whether or not the others have started. (start_many first
    would wait for every prompt's first token: with more prompts than the engine runs at once, RL's 256
    prompts x n=8 at 256 sequences, the first waves' outputs then waited for the last wave to start and were
    all formatted at once, blocking the event loop 3-4 s, so the engine's sends to it stalled (H200,
    2026-12-02).) Engine request ids: _engine_ids; any prompt's error aborts the others and is raised; a
    client that leaves aborts them all."""
    gens: list[AsyncIterator[RequestOutput]] = []

    def opener(rid: str, text: str | None, tokens: list[int] | None) -> Callable[[], AsyncIterator[RequestOutput]]:
        def open_stream() -> AsyncIterator[RequestOutput]:
            gens.append(generate(request, rid, text, tokens, params))
            return gens[-1]
        return open_stream

    async def drain() -> list[RequestOutput]:
        last: dict[int, RequestOutput] = {}
        streams = [opener(rid, text, tokens) for rid, (text, tokens) in zip(_engine_ids(request_id, len(prompts)),
                                                                              prompts)]
        async with contextlib.aclosing(_interleaved(streams)) as outs:
            async for i, out in outs:
                last[i] = out
                if out.finished:
                    on_final(i, out)
                    await asyncio.sleep(0)  # a step's many finished prompts: the loop reads the engine between them
        return [last[i] for i in range(len(prompts))]

    try:
        return await unless_disconnected(request, drain())
    finally:
        for gen in gens:
            await gen.aclose()  # type: ignore[attr-defined]


async def run_to_end(request: Request, started: list[Started],
                     on_final: Callable[[int, RequestOutput], None] | None = None) -> list[RequestOutput]:
    """The final output of every prompt (aborting them all if the client leaves). on_final(i, output) is
    called as each prompt's final output arrives, while the others still generate."""
    async def drain() -> list[RequestOutput]:
        last: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(merged(started)) as outs:
            async for i, out in outs:
                last[i] = out
                if on_final is not None and out.finished:
                    on_final(i, out)
        return [last[i] for i in range(len(started))]

    return await unless_disconnected(request, drain())
