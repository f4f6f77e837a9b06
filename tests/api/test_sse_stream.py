"""SSEStream under ServerSend: a stream's start and end pass through every wrapped send (the middleware that
watch for the response's start), its chunks go straight to the HTTP server's send; without ServerSend (an
in-process client) every message takes the wrapped path. Through the real FastAPI middleware stack, called as
uvicorn calls an ASGI 3 app; the real server's streams are covered by tests/http."""
from __future__ import annotations

import asyncio
import inspect

import uvicorn
from fastapi import FastAPI

from server.api.streaming import SERVER_SEND, ServerSend, sse_response

CHUNKS = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]


class Watch:
    """A middleware that records every message its wrapped send carries."""

    def __init__(self, app, seen: list):
        self.app, self.seen = app, seen

    async def __call__(self, scope, receive, send):
        async def watched(message):
            self.seen.append(message)
            await send(message)

        await self.app(scope, receive, watched)


def _app(seen: list) -> FastAPI:
    app = FastAPI()

    async def body():
        for c in CHUNKS:
            yield c

    @app.get("/s")
    async def stream():
        return sse_response(body())

    app.add_middleware(Watch, seen=seen)
    return app


def _serve(app) -> list:
    sent: list = []
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "GET", "path": "/s", "raw_path": b"/s", "query_string": b"", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "scheme": "http", "root_path": ""}

    async def receive():
        await asyncio.sleep(3600)  # the client stays

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def _bodies(messages: list) -> list[bytes]:
    return [m["body"] for m in messages if m["type"] == "http.response.body" and m["body"]]


def test_chunks_skip_the_wrapped_sends():
    seen: list = []
    sent = _serve(ServerSend(_app(seen)))
    assert [m["type"] for m in sent][0] == "http.response.start" and sent[0]["status"] == 200
    assert _bodies(sent) == CHUNKS and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    # The middleware saw the start and the end, none of the chunks.
    assert [m["type"] for m in seen] == ["http.response.start", "http.response.body"]
    assert _bodies(seen) == [] and seen[-1]["more_body"] is False


def test_without_server_send_every_message_is_wrapped():
    seen: list = []
    sent = _serve(_app(seen))
    assert _bodies(sent) == CHUNKS
    assert _bodies(seen) == CHUNKS and len(seen) == len(sent)


def test_server_send_is_an_asgi3_app_for_uvicorn():
    # uvicorn's "auto" interface takes an object whose __call__ is not a coroutine function for ASGI 2.
    assert inspect.iscoroutinefunction(ServerSend(None).__call__)
    assert SERVER_SEND.startswith("sleepserve.")
    config = uvicorn.Config(ServerSend(_app([])), log_config=None)
    config.load()
    assert config.interface == "asgi3"
