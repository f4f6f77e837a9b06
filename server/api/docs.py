"""GET /openapi.json, /docs and /redoc: behind a key when one is set (either key opens them), since
the document lists every route, dev routes included; `--no-docs` leaves them out altogether."""
from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from server.api.errors import APIError

router = APIRouter(include_in_schema=False)


def _require_any_key(request: Request) -> None:
    settings = request.app.state.settings
    keys = [k for k in (settings.api_key, settings.admin_api_key) if k]
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip().encode()
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, k.encode()) for k in keys):
        raise APIError(401, "the API documents need the key given to --api-key (or --admin-api-key); send the "
                            "header Authorization: Bearer <key>", None, "invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


@router.get("/openapi.json")
async def openapi_json(request: Request) -> JSONResponse:
    _require_any_key(request)
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def swagger(request: Request) -> HTMLResponse:
    _require_any_key(request)
    return get_swagger_ui_html(openapi_url="/openapi.json", title="sleepserve - Swagger UI")


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    _require_any_key(request)
    return get_redoc_html(openapi_url="/openapi.json", title="sleepserve - ReDoc")
