"""Dev-mode routes (docs/sleep.md): mounted only with --dev-mode, behind the admin key.

Each route is one engine call; the engine's SleepController says what is allowed (its
InvalidRequestError, ConflictError and WeightLoadError become 400, 409 and 400 in errors.py). Every
transition answers its report (`changed: false` for a repeat that found the state as asked) and the
state after it.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from fastapi import APIRouter, Depends, Query, Request

from server.api import weight_transfer
from server.api.auth import require_admin_key
from server.api.body import parse_body, read_json
from server.api.collective_rpc import CollectiveRpcRequest
from server.api.collective_rpc import collective_rpc as run_collective_rpc
from server.api.disk_weights import load_from_disk
from server.api.schemas import UpdateWeightsRequest
from server.api.server_info import ConfigFormat
from server.api.server_info import server_info as describe_server
from server.wire.errors import InvalidRequestError
from server.wire.sleep_state import SleepReport

router = APIRouter(dependencies=[Depends(require_admin_key)], tags=["dev mode"])


def _answer(request: Request, report: SleepReport, **extra: Any) -> dict[str, Any]:
    return {**report.as_dict(), **extra, "state": request.app.state.engine.state.as_dict()}


@router.post("/sleep")
async def sleep(request: Request, level: int = 1, tags: list[str] | None = Query(None),
                mode: str = "abort") -> dict[str, Any]:
    """Tags may repeat (?tags=a&tags=b) or come comma-separated (?tags=a,b); none means all."""
    with _from_query("level", "tags", "mode"):
        report = await request.app.state.engine.sleep(level=level, tags=tags, mode=mode)
    return _answer(request, report)


@router.post("/wake_up")
async def wake_up(request: Request, tags: list[str] | None = Query(None)) -> dict[str, Any]:
    with _from_query("tags"):
        report = await request.app.state.engine.wake_up(tags)
    return _answer(request, report)


@contextmanager
def _from_query(*names: str) -> Iterator[None]:
    """The engine names the argument it refuses (`mode`); the client sent it as a query parameter, which
    vLLM's validation names `query.mode`, as FastAPI's own query errors here do (errors.py)."""
    try:
        yield
    except InvalidRequestError as e:
        if e.param not in names:
            raise
        raise InvalidRequestError(str(e), f"query.{e.param}", e.code) from None


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, Any]:
    return request.app.state.engine.state.as_dict()


@router.post("/pause")
async def pause(request: Request, mode: str = "abort", clear_cache: bool = True,
                wait_for_inflight_requests: bool | None = None) -> dict[str, Any]:
    """vLLM's pause: scheduling stops, all memory stays (sleep level 0); `mode` says what happens to the
    requests in flight; `clear_cache` (default true, as in vLLM) resets the prefix cache. vLLM's older
    `wait_for_inflight_requests=true` means mode=wait."""
    if wait_for_inflight_requests:
        mode = "wait"
    with _from_query("mode"):
        report = await request.app.state.engine.sleep(level=0, tags=None, mode=mode, clear_cache=clear_cache)
    return _answer(request, report, status="paused")


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    report = await request.app.state.engine.resume()
    return _answer(request, report, status="resumed")


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, Any]:
    return {"is_paused": request.app.state.engine.state.vllm_paused}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, Any]:
    await request.app.state.engine.reset_prefix_cache()
    return {"reset": True}


@router.get("/memory")
async def memory(request: Request) -> dict[str, Any]:
    snap = await request.app.state.engine.snapshot()
    return {**snap["pool"], "state": snap["state"], "ranks": snap["ranks"]}


@router.post("/update_weights")
async def update_weights(request: Request) -> dict[str, Any]:
    """Allowed while the weights are awake and no request is stepping: after /sleep + /wake_up?tags=weights,
    or while paused (a pause with mode=keep keeps the requests in flight; they recompute their KV on the
    new weights after /resume). {"path"}: load from disk; vLLM's {"update_info"}: receive from a trainer
    (weight_transfer.py)."""
    data = await read_json(request, allow_empty=True)
    if "update_info" in data:
        return await weight_transfer.update_weights_from_body(request, data)
    body = await parse_body(request, UpdateWeightsRequest, allow_empty=True)
    report = await load_from_disk(request, body.path, body.weight_version)
    return {**report, "state": request.app.state.engine.state.as_dict()}



@router.post("/collective_rpc")
async def collective_rpc(request: Request) -> dict[str, Any]:
    """vLLM's collective RPC for the methods that mean something here (collective_rpc.py): reload_weights."""
    body = await parse_body(request, CollectiveRpcRequest)
    return await run_collective_rpc(request, body)


@router.get("/server_info")
async def server_info(request: Request, config_format: ConfigFormat = "text") -> dict[str, Any]:
    """The resolved configuration (flags after defaults and the environment): ours, and vLLM's
    vllm_config / vllm_env / system_env (server_info.py)."""
    return describe_server(request, config_format)


@router.get("/get_world_size")
async def get_world_size(request: Request) -> dict[str, int]:
    """Ranks of tensor parallelism (no pipeline parallelism): vLLM's tensor x pipeline world size."""
    return {"world_size": request.app.state.engine.info.config.tensor_parallel_size}
