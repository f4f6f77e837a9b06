"""Bearer-key checks: --api-key guards /v1/*, --admin-api-key (default: --api-key) the dev routes."""
from __future__ import annotations

import hmac

from fastapi import Request

from server.api.errors import APIError


def _check(request: Request, expected: str | None, flag: str) -> None:
    if not expected:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare_digest on bytes: constant time, and no TypeError on non-ASCII input.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        said = "no Authorization header" if not scheme else "a wrong key"
        raise APIError(401, f"this route needs the key given to {flag}, and the request sent {said}; "
                            "send the header Authorization: Bearer <key>", None, "invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


async def require_api_key(request: Request) -> None:
    _check(request, request.app.state.settings.api_key, "--api-key")


async def require_admin_key(request: Request) -> None:
    settings = request.app.state.settings
    _check(request, settings.effective_admin_key, "--admin-api-key" if settings.admin_api_key else "--api-key")
