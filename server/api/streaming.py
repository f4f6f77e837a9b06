"""Server-Sent Events: `data: {json}\\n\\n` per chunk, `data: [DONE]` at the end (OpenAI's framing)."""
from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi.responses import StreamingResponse

from server.api.errors import as_api_error, error_body
from server.engine.sleep_state import SleepState

log = logging.getLogger("sleepserve.api")

DONE = b"data: [DONE]\n\n"

T = TypeVar("T")


# One encoder for every chunk: json.dumps with non-default options builds a new JSONEncoder per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + _ENCODER.encode(data).encode("utf-8") + b"\n\n"


async def events(items: AsyncIterator[T], chunks: Callable[[T], list[dict[str, Any]]],
                 tail: Callable[[], list[dict[str, Any]]], state: Callable[[], SleepState]) -> AsyncIterator[bytes]:
    """The SSE body. Once the 200 is sent, an error can only travel as an event: it goes out as an
    OpenAI error object, then [DONE], so clients never wait on a stream that will not end.
    When the client disconnects, Starlette cancels this generator; closing `items` aborts the requests."""
    try:
        async for item in items:
            # An item's chunks (one per choice with news: n of them for n > 1) in one write, not one each.
            body = b"".join(sse(c) for c in chunks(item))
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


def sse_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    # No caching and no proxy buffering: tokens must reach the client as they are made.
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
