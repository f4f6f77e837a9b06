"""Server-Sent Events: `data: {json}\\n\\n` per chunk, `data: [DONE]` at the end (OpenAI's framing)."""
from __future__ import annotations

import json
import logging
from json.encoder import encode_basestring  # what json.dumps(ensure_ascii=False) uses for a str
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi.responses import StreamingResponse

from server.api.errors import as_api_error, error_body
from server.wire.sleep_state import SleepState

log = logging.getLogger("sleepserve.api")

DONE = b"data: [DONE]\n\n"

T = TypeVar("T")


# One encoder for every chunk: json.dumps with non-default options builds a new JSONEncoder per call.
ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + ENCODER.encode(data).encode("utf-8") + b"\n\n"


def json_str(text: str) -> str:
    """A JSON string literal, exactly as sse() writes it."""
    return encode_basestring(text)


def json_ids(ids: list[int]) -> str:
    """A JSON list of ints, exactly as sse() writes it."""
    return "[" + ",".join(map(str, ids)) + "]"


class ChunkFrame:
    """One stream's envelope (id, object, created, model, choices, [usage: null]) as fixed text around
    one choice's JSON: a stream writes a chunk per request per engine step, and its envelope never
    changes. Byte for byte what sse(envelope(..., [choice], usage=None)) writes (tests check it),
    at a fraction of the cost: the routes build the common chunk (text and token ids, nothing else)
    as one string from `prefix` to `suffix` (no choice string to frame), and only the rare ones (the
    first, the last, log-probs) as dicts through frame()."""

    def __init__(self, kind: str, request_id: str, created: int, model: str, include_usage: bool):
        self.prefix = (f'data: {{"id":{json_str(request_id)},"object":{json_str(kind)},"created":{int(created)},'
                       f'"model":{json_str(model)},"choices":[')
        self.suffix = ("]" + (',"usage":null' if include_usage else "") + "}\n\n")

    def frame(self, choice_json: str) -> bytes:
        return (self.prefix + choice_json + self.suffix).encode("utf-8")


async def events(items: AsyncIterator[T], chunks: Callable[[T], bytes],
                 tail: Callable[[], list[dict[str, Any]]], state: Callable[[], SleepState]) -> AsyncIterator[bytes]:
    """The SSE body. Once the 200 is sent, an error can only travel as an event: it goes out as an
    OpenAI error object, then [DONE], so clients never wait on a stream that will not end.
    When the client disconnects, Starlette cancels this generator; closing `items` aborts the requests."""
    try:
        async for item in items:
            # An item's chunks (one per choice with news: n of them for n > 1), framed, in one write.
            body = chunks(item)
            if body:
                yield body
        for c in tail():
            yield sse(c)
    except Exception as e:
        err = as_api_error(e, state())
        if err is None:
            log.exception("stream failed")
            yield sse(error_body(500, f"internal error ({type(e).__name__}: {e}); see the server log",
                                 code="internal_error"))
        else:
            yield sse(error_body(err.status, err.message, err.param, err.code))
    finally:
        await items.aclose()  # type: ignore[attr-defined]
    yield DONE


# Where ServerSend puts the HTTP server's own send in a request's scope.
SERVER_SEND = "sleepserve.server_send"


class ServerSend:
    """The outermost ASGI layer, around Starlette's: puts the HTTP server's own `send` into the scope. Every
    layer between (Starlette's error and exception middleware, the route's, ours) wraps `send` to watch for
    the response's start, and a stream would pass each of its chunks through all of them, a coroutine each:
    SSEStream sends the start through them and its chunks straight to the server."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:  # a coroutine: uvicorn's ASGI 3 test
        scope[SERVER_SEND] = send
        await self.app(scope, receive, send)


class SSEStream(StreamingResponse):
    """Starlette's StreamingResponse (its disconnect watch, its errors) whose body chunks skip the wrapped
    sends (ServerSend): the start and the end go through them, so every layer sees the response begin and
    finish. Without ServerSend around the app (an in-process test client), every chunk goes the usual way."""

    media_type = "text/event-stream"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        self.chunk_send = scope.get(SERVER_SEND, send)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        chunk_send = self.chunk_send
        async for chunk in self.body_iterator:
            await chunk_send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def sse_response(body: AsyncIterator[bytes]) -> SSEStream:
    # No caching and no proxy buffering: tokens must reach the client as they are made.
    return SSEStream(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
