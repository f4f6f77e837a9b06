"""vLLM's profiling routes, mounted only where VLLM_TORCH_PROFILER_DIR is set (server/engine/step_profiler.py),
behind the admin key: POST /start_profile traces the engine's steps, POST /stop_profile writes the trace into
that folder and answers where it is, how long it ran and the device's busy share of it."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from server.api.auth import require_admin_key

router = APIRouter(dependencies=[Depends(require_admin_key)], tags=["profiling"])


@router.post("/start_profile")
async def start_profile(request: Request) -> dict[str, Any]:
    await request.app.state.engine.start_profile()
    return {"profiling": True}


@router.post("/stop_profile")
async def stop_profile(request: Request) -> dict[str, Any]:
    return {"profiling": False, **await request.app.state.engine.stop_profile()}
