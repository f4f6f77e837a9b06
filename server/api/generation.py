"""One request's trip through the engine, shared by the completions and chat routes.

The two things every generation route must get right live here: refusing at once while the engine
cannot serve (503 from the state snapshot, no round trip), and aborting the engine request — which
frees its KV blocks — whenever the client goes away, streaming or not.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Awaitable, TypeVar

from fastapi import Request

from server.api.errors import APIError
from server.engine.errors import EngineUnavailableError
from server.engine.outputs import RequestOutput
from server.engine.params import SamplingParams

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
    engine = request.app.state.engine
    reason = engine.unavailable_reason()
    if reason:
        raise EngineUnavailableError(reason)


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


async def generate(request: Request, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                   params: SamplingParams) -> AsyncIterator[RequestOutput]:
    """engine.generate plus metrics. Close it (aclose) when done early: that aborts the request."""
    engine = request.app.state.engine
    tracker = request.app.state.metrics.track(time.monotonic())
    last: RequestOutput | None = None
    async with contextlib.aclosing(engine.generate(request_id, prompt, prompt_token_ids, params)) as outputs:
        try:
            async for out in outputs:
                tracker.observe(out)
                last = out
                yield out
        finally:
            tracker.finish(last)


async def start(request: Request, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                params: SamplingParams) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
    """Submit and wait for the first output, so that errors the engine finds on admission (prompt
    over the context, the engine falling asleep meanwhile) still answer with their own status
    instead of a 200 stream that carries an error."""
    gen = generate(request, request_id, prompt, prompt_token_ids, params)
    try:
        first = await unless_disconnected(request, gen.__anext__())
    except BaseException:
        await gen.aclose()
        raise
    return first, gen


async def run_to_end(request: Request, first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    async def drain() -> RequestOutput:
        last = first
        async with contextlib.aclosing(gen):  # type: ignore[type-var]
            if not first.finished:
                async for out in gen:
                    last = out
        return last

    return await unless_disconnected(request, drain())
