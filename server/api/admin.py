"""Dev-mode routes (docs/sleep.md): mounted only with --dev-mode, behind the admin key.

Each route is one engine call; the engine's SleepController says what is allowed (its
InvalidRequestError, ConflictError and WeightLoadError become 400, 409 and 400 in errors.py). Every
transition answers its report (`changed: false` for a repeat that found the state as asked) and the
state after it.
"""
from __future__ import annotations

import os
from dataclasses import asdict, is_dataclass
from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from server import __version__
from server.api import weight_transfer
from server.api.auth import require_admin_key
from server.api.body import parse_body, read_json
from server.api.disk_weights import load_from_disk
from server.api.schemas import UpdateWeightsRequest
from server.wire.sleep_state import SleepReport

router = APIRouter(dependencies=[Depends(require_admin_key)], tags=["dev mode"])


def _answer(request: Request, report: SleepReport, **extra: Any) -> dict[str, Any]:
    return {**report.as_dict(), **extra, "state": request.app.state.engine.state.as_dict()}


@router.post("/sleep")
async def sleep(request: Request, level: int = 1, tags: list[str] | None = Query(None),
                mode: str = "abort") -> dict[str, Any]:
    """Tags may repeat (?tags=a&tags=b) or come comma-separated (?tags=a,b); none means all."""
    report = await request.app.state.engine.sleep(level=level, tags=tags, mode=mode)
    return _answer(request, report)


@router.post("/wake_up")
async def wake_up(request: Request, tags: list[str] | None = Query(None)) -> dict[str, Any]:
    report = await request.app.state.engine.wake_up(tags)
    return _answer(request, report)


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
    report = await request.app.state.engine.sleep(level=0, tags=None, mode=mode, clear_cache=clear_cache)
    return _answer(request, report, status="paused")


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    report = await request.app.state.engine.resume()
    return _answer(request, report, status="resumed")


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, Any]:
    return {"is_paused": request.app.state.engine.state.paused}


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



@router.get("/server_info")
async def server_info(request: Request) -> dict[str, Any]:
    """The resolved configuration (flags after defaults and the environment), as vLLM's dev route."""
    engine = request.app.state.engine
    info = engine.info
    settings = request.app.state.settings
    return {
        "version": __version__,
        "model": {"served_model_name": info.served_model_name, "path": info.model_path,
                  "model_type": info.model_type, "dtype": info.dtype,
                  "max_model_len": info.max_model_len, "vocab_size": info.vocab_size},
        "device": info.device,
        "engine_config": asdict(info.config),
        "batch_invariant": bool(info.config.batch_invariant),
        "kv_cache": {"num_blocks": info.kv_plan.num_blocks - 1, "block_size": info.kv_plan.block_size,
                     "bytes": info.kv_plan.bytes, "capacity_tokens": info.kv_plan.capacity_tokens},
        "processes": {"api_pid": os.getpid(), "engine_pid": info.pid,
                      "api_server_count": settings.api_server_count},
        "server": {"host": settings.host, "port": settings.port, "dev_mode": settings.dev_mode,
                   "api_key_set": settings.api_key is not None,
                   "admin_api_key_set": settings.effective_admin_key is not None,
                   "log_level": settings.log_level},
        "world_size": info.config.tensor_parallel_size,
        "tensor_parallel": {"size": info.config.tensor_parallel_size, "ranks": info.ranks},
        "weight_transfer_config": _transfer_config(request),
        "weight_version": engine.state.weight_version,
    }


def _transfer_config(request: Request) -> dict[str, Any] | None:
    """--weight-transfer-config as resolved; null when the server was started without one."""
    config = getattr(request.app.state, "weight_transfer", None)
    if config is None:
        return None
    return asdict(config) if is_dataclass(config) else dict(vars(config))


@router.get("/get_world_size")
async def get_world_size(request: Request) -> dict[str, int]:
    """Ranks of tensor parallelism (no pipeline parallelism): vLLM's tensor x pipeline world size."""
    return {"world_size": request.app.state.engine.info.config.tensor_parallel_size}
