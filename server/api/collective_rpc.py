"""POST /collective_rpc (dev mode): vLLM's call of a method on every worker, for the methods that
mean something here.

vLLM documents `{"method": "reload_weights"}` as the way to load the weights again after a level-2
sleep (sleep level 2 -> wake_up?tags=weights -> collective_rpc reload_weights -> wake_up?tags=kv_cache),
answered `{"results": [...]}` with one entry per worker. Here it is the served checkpoint read again
from its folder, on every rank (the same load as POST /update_weights without a path). vLLM runs any
method a worker has; this server runs only the ones below and answers 400 naming any other.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from fastapi import Request
from pydantic import Field

from server.api.errors import APIError
from server.api.schemas import RequestBody
from server.wire.errors import InvalidRequestError


class CollectiveRpcRequest(RequestBody):
    """vLLM's body: args and kwargs are strings there (the method deserializes them); none of ours takes any."""
    method: str
    timeout: float | None = Field(default=None, gt=0)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


async def _reload_weights(request: Request) -> Any:
    return await request.app.state.engine.load_weights(None, None)


# method -> the call (its report goes beside the results); every method here returns None per worker, as vLLM's do.
METHODS: dict[str, Callable[[Request], Awaitable[Any]]] = {"reload_weights": _reload_weights}


async def collective_rpc(request: Request, body: CollectiveRpcRequest) -> dict[str, Any]:
    run = METHODS.get(body.method)
    if run is None:
        raise InvalidRequestError(f"method {body.method!r} is not available through /collective_rpc here; this "
                                  f"server runs {', '.join(sorted(METHODS))}", "method", "unknown_method")
    if body.args or body.kwargs:
        raise InvalidRequestError(f"{body.method} takes no arguments; send it without args and kwargs",
                                  "args" if body.args else "kwargs")
    call = asyncio.ensure_future(run(request))
    try:
        # Shielded: a load that outlives the timeout still completes (the weights are whole after it).
        report = await asyncio.wait_for(asyncio.shield(call), body.timeout)
    except asyncio.TimeoutError:
        raise APIError(504, f"{body.method} did not finish within {body.timeout:g} s; it goes on, and "
                            "GET /is_sleeping says when the weights are valid", "timeout", "timeout") from None
    ranks = request.app.state.engine.info.config.tensor_parallel_size
    return {"results": [None] * ranks, "report": report, "state": request.app.state.engine.state.as_dict()}
