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
import json
from typing import AsyncIterator
from urllib.parse import urlsplit


class HTTPStatusError(RuntimeError):
    pass


class FastClient:
    def __init__(self, base_url: str, api_key: str = "", timeout: float = 600.0):
        """base_url: the server's root (http://host:port); requests go to base_url + path."""
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self._auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def open(self, n: int) -> None:
        """Open connections until n are idle (the run then starts with every connection up)."""
        while len(self._idle) < n:
            self._idle.append(await asyncio.open_connection(self.host, self.port, limit=1 << 20))

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle = []

    async def post_json(self, path: str, body: dict) -> dict:
        """POST; the answer's JSON."""
        parts = [piece async for piece in self._post(path, body)]
        return json.loads(b"".join(parts))

    async def post_events(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POST; each server-sent event's JSON up to [DONE] (an event carrying "error" raises). The body is
        read to its end, so the connection can carry the next request."""
        pending = b""
        async for piece in self._post(path, body):
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
        the idle ones once the body ended, and is dropped if the read stops early. The whole exchange runs
        under one deadline (asyncio.timeout: no task per read, as wait_for would make)."""
        reader, writer = self._idle.pop() if self._idle else await asyncio.open_connection(
            self.host, self.port, limit=1 << 20)
        data = json.dumps(body).encode()
        keep = False
        try:
            async with asyncio.timeout(self.timeout):
                writer.write((f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self._auth}"
                              f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
                             + data)
                head = (await reader.readuntil(b"\r\n\r\n")).lower()
                status = int(head.split(b" ", 2)[1])
                if b"transfer-encoding: chunked" in head:
                    pieces = self._chunked(reader)
                else:
                    pieces = self._whole(reader, int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0]))
                if status != 200:
                    text = b"".join([p async for p in pieces]).decode(errors="replace")
                    raise HTTPStatusError(f"HTTP {status}: {text[:500]}")
                async for piece in pieces:
                    yield piece
                keep = b"connection: close" not in head
        finally:
            if keep:
                self._idle.append((reader, writer))
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
        yield await reader.readexactly(length)
