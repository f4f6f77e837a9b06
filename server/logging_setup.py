"""Logging in uvicorn's style: `INFO:     message`, and one access line per request with its latency
(uvicorn's own access log has no latency, so it is turned off and this middleware writes the line)."""
from __future__ import annotations

import http
import logging
import logging.config
import time
from typing import Any, Awaitable

LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

access_log = logging.getLogger("sleepserve.access")


def configure_logging(level: str = "info") -> None:
    level = level.lower()
    if level == "trace":
        logging.addLevelName(5, "TRACE")
    numeric: int | str = 5 if level == "trace" else level.upper()
    handler = {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {"()": "uvicorn.logging.DefaultFormatter", "fmt": "%(levelprefix)s %(message)s",
                                   "use_colors": None}},
        "handlers": {"default": handler},
        "loggers": {
            "sleepserve": {"handlers": ["default"], "level": numeric, "propagate": False},
            "allocator": {"handlers": ["default"], "level": numeric, "propagate": False},
            "uvicorn": {"handlers": ["default"], "level": numeric, "propagate": False},
            "uvicorn.error": {"level": numeric},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    })


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Client Closed Request" if status == 499 else ""


class AccessLogMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware) so streaming and disconnect detection pass through untouched.
    The line is written when the response ends, so a stream's latency is its whole duration."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]  # what the client sees when the app raises before answering

        def send_wrapper(message: dict) -> Awaitable[None]:
            # Not a coroutine of its own: the caller awaits send's (a stream calls this once per chunk).
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            return send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            client = scope.get("client")
            addr = f"{client[0]}:{client[1]}" if client else "-"
            path = scope.get("path", "")
            if scope.get("query_string"):
                path += "?" + scope["query_string"].decode("latin-1")
            access_log.info('%s - "%s %s HTTP/%s" %d %s %.1fms', addr, scope.get("method"), path,
                            scope.get("http_version", "1.1"), status[0], _phrase(status[0]),
                            (time.perf_counter() - start) * 1000)
