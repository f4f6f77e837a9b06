"""The OpenAI-compatible routes under /v1 (and vLLM's /tokenize, /detokenize), all behind --api-key."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from server.api import chat, completions, tokenize
from server.api.auth import require_api_key
from server.api.errors import APIError

router = APIRouter(dependencies=[Depends(require_api_key)])
router.include_router(completions.router)
router.include_router(chat.router)
router.include_router(tokenize.router)


def _model_card(request: Request) -> dict[str, Any]:
    state = request.app.state
    return {"id": state.served_model_name, "object": "model", "created": state.started_at, "owned_by": "sleepserve",
            # vLLM puts the model's path in `root`; here it is the served name: no filesystem path leaves the server.
            "root": state.served_model_name, "max_model_len": state.engine.info.max_model_len}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(request)]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict:
    card = _model_card(request)
    if model_id != card["id"]:
        raise APIError(404, f"the model {model_id!r} does not exist; this server serves {card['id']!r}",
                       "model", "model_not_found")
    return card
