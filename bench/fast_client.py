"""A load generator's HTTP client that costs little CPU: HTTP/1.1 over asyncio streams, one kept-alive
connection per request in flight, opened before the run.

bench/serve.py measures the server, so its client must not be what limits a run. The official `openai`
client (httpx under it) spends ~72-85 us of CPU per streamed chunk even with its typed models bypassed
(openai_client_cost.py): at 256 streamed requests on the H200 host its 8 processes kept 6.6 cores busy
beside the server's own processes. This one reads the same bytes (the chunked body, each SSE event
JSON-parsed) with a few calls per chunk. It speaks only what the benchmarks need: POST a JSON body, read a
JSON answer or an event stream; any status but 200 raises with the body.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from typing import AsyncIterator
from urllib.parse import urlsplit


class HTTPStatusError(RuntimeError):
    pass


# uvicorn closes a kept-alive connection idle for 5 s (its timeout_keep_alive): one idle longer than this is
# not reused (a rate pass at 0.5 requests/s a client process leaves many idle that long).
IDLE_REUSE_S = 4.0


class FastClient:
    def __init__(self, base_url: str, api_key: str = "", timeout: float = 600.0):
        """base_url: the server's root (http://host:port); requests go to base_url + path."""
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self._auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        # (reader, writer, when it went idle): taken oldest first.
        self._idle: collections.deque = collections.deque()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    async def open(self, n: int) -> None:
        """Open connections until n are idle (the run then starts with every connection up)."""
        while len(self._idle) < n:
            self._idle.append((*await self._connect(), time.monotonic()))

    async def close(self) -> None:
        for _, writer, _ in self._idle:
            writer.close()
        self._idle.clear()

    def _reusable(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """An idle connection the server has not closed and will not have closed by now, or None."""
        now = time.monotonic()
        while self._idle:
            reader, writer, since = self._idle.popleft()
            if not reader.at_eof() and not writer.is_closing() and now - since < IDLE_REUSE_S:
                return reader, writer
            writer.close()
        return None

    async def post_json(self, path: str, body: dict) -> dict:
        """POST; the answer's JSON."""
        async with contextlib.aclosing(self._post(path, body)) as pieces:
            return json.loads(b"".join([piece async for piece in pieces]))

    async def post_events(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POST; each server-sent event's JSON up to [DONE] (an event carrying "error" raises). The body is
        read to its end, so the connection can carry the next request; a stream left early drops it at once."""
        pending = b""
        async with contextlib.aclosing(self._post(path, body)) as pieces:
            async for piece in pieces:
                pending += piece
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    data = json.loads(event[6:])
                    if data.get("error"):
                        raise RuntimeError(f"error in the stream: {data['error']}")
                    yield data

    async def _post(self, path: str, body: dict) -> AsyncIterator[bytes]:
        """The answer's body, a piece at a time (each HTTP chunk as it arrives); the connection goes back to
        the idle ones once the body ended, and is dropped if the read stops early. A reused connection that
        the server closed before answering (nothing read yet) is replaced by a new one, once. The whole
        exchange runs under one deadline (asyncio.timeout: no task per read, as wait_for would make); the
        callers do not await between pieces."""
        data = json.dumps(body).encode()
        request = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self._auth}"
                   f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data
        keep = False
        async with asyncio.timeout(self.timeout):
            conn = self._reusable()
            reused = conn is not None
            reader, writer = conn or await self._connect()
            try:
                try:
                    writer.write(request)
                    head = (await reader.readuntil(b"\r\n\r\n")).lower()
                except (asyncio.IncompleteReadError, ConnectionError) as e:
                    if not reused or getattr(e, "partial", b""):  # an answer had begun: not retried
                        raise
                    writer.close()  # closed by the server while idle: the request never reached it
                    reader, writer = await self._connect()
                    writer.write(request)
                    head = (await reader.readuntil(b"\r\n\r\n")).lower()
                status = int(head.split(b" ", 2)[1])
                if b"transfer-encoding: chunked" in head:
                    pieces = self._chunked(reader)
                elif b"content-length:" in head:
                    pieces = self._whole(reader, int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0]))
                else:  # neither: the body runs to the connection's end
                    pieces = self._whole(reader, -1)
                    head += b"connection: close\r\n"
                if status != 200:
                    text = b"".join([p async for p in pieces]).decode(errors="replace")
                    raise HTTPStatusError(f"HTTP {status}: {text[:500]}")
                async for piece in pieces:
                    yield piece
                keep = b"connection: close" not in head
            finally:
                if keep:
                    self._idle.append((reader, writer, time.monotonic()))
                else:
                    writer.close()

    @staticmethod
    async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        while True:
            size = int((await reader.readline()).split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # no trailers: the empty line that ends the body
                return
            piece = await reader.readexactly(size + 2)
            yield piece[:-2]

    @staticmethod
    async def _whole(reader: asyncio.StreamReader, length: int) -> AsyncIterator[bytes]:
        """length bytes, or (-1) everything until the server closes the connection."""
        yield await (reader.readexactly(length) if length >= 0 else reader.read())
