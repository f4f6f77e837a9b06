"""Dev-mode routes (docs/architecture.md, "Sleep semantics"): mounted only with --dev-mode, behind the admin key.

Each route is one engine call; the engine owns the state machine and says what is allowed (its
InvalidRequestError, ConflictError and WeightLoadError become 400, 409 and 400 in errors.py).
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from server.api.auth import require_admin_key
from server.api import weight_transfer
from server.api.body import parse_body, read_json
from server.api.disk_weights import load_from_disk
from server.api.schemas import UpdateWeightsRequest

router = APIRouter(dependencies=[Depends(require_admin_key)], tags=["dev mode"])


def _tags(tags: list[str] | None) -> list[str] | None:
    """Tags may repeat (?tags=a&tags=b) or come comma-separated (?tags=a,b); none means all."""
    out = [t.strip() for raw in tags or [] for t in raw.split(",") if t.strip()]
    return out or None


@router.post("/sleep")
async def sleep(request: Request, level: int = 1, tags: list[str] | None = Query(None),
                mode: str = "abort") -> dict[str, Any]:
    engine = request.app.state.engine
    report = await engine.sleep(level=level, tags=_tags(tags), mode=mode)
    return {**report, "state": engine.state}


@router.post("/wake_up")
async def wake_up(request: Request, tags: list[str] | None = Query(None)) -> dict[str, Any]:
    engine = request.app.state.engine
    report = await engine.wake_up(_tags(tags))
    return {**report, "state": engine.state}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, Any]:
    return dict(request.app.state.engine.state)


@router.post("/pause")
async def pause(request: Request, mode: str = "abort") -> dict[str, Any]:
    """Sleep level 0: scheduling stops, all memory stays; `mode` says what happens to in-flight requests."""
    engine = request.app.state.engine
    report = await engine.sleep(level=0, tags=None, mode=mode)
    return {**report, "state": engine.state}


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    engine = request.app.state.engine
    await engine.call(lambda core: core.resume())
    return {"state": engine.state}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, Any]:
    await request.app.state.engine.call(lambda core: core.reset_prefix_cache())
    return {"reset": True}


@router.get("/memory")
async def memory(request: Request) -> dict[str, Any]:
    snap = await request.app.state.engine.snapshot()
    return {**snap["pool"], "state": snap["state"]}


@router.post("/update_weights")
async def update_weights(request: Request) -> dict[str, Any]:
    """{"path"}: load from disk; vLLM's {"update_info"}: receive from a trainer (weight_transfer.py)."""
    data = await read_json(request, allow_empty=True)
    if "update_info" in data:
        return await weight_transfer.update_weights_from_body(request, data)
    body = await parse_body(request, UpdateWeightsRequest, allow_empty=True)
    report = await load_from_disk(request, body.path, body.weight_version)
    return {**report, "state": request.app.state.engine.state}
