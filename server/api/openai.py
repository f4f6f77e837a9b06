"""The OpenAI-compatible routes under /v1 (and vLLM's /tokenize, /detokenize), all behind --api-key."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from server.api import chat, completions, tokenize
from server.api.auth import require_api_key

router = APIRouter(dependencies=[Depends(require_api_key)])
router.include_router(completions.router)
router.include_router(chat.router)
router.include_router(tokenize.router)


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = request.app.state
    return {"object": "list", "data": [{
        "id": state.served_model_name, "object": "model", "created": state.started_at, "owned_by": "sleepserve",
        "root": str(state.engine.core.model_path), "max_model_len": state.engine.core.max_model_len,
    }]}
