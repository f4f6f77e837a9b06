"""bench/fast_client.py against a socket server that answers as uvicorn does (chunked event streams, JSON
with a length) and in the ways a reader gets wrong: events split across HTTP chunks and several in one, an
error event after the 200, a 4xx, a server that closes the connection. Its answers are compared with what
was sent, and its connections with what the server saw."""
from __future__ import annotations

import asyncio
import json

import pytest

from bench.fast_client import FastClient, HTTPStatusError


def _event(data: dict | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


def _chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def _serve(answers: dict[str, bytes], connections: list, bodies: list,
                 idle_close_s: float | None = None, once: bool = False) -> asyncio.AbstractServer:
    """idle_close_s: close a kept-alive connection idle that long, as uvicorn does after its timeout_keep_alive.
    once: read a connection's second request, then close it unanswered (a close racing the client's reuse)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), idle_close_s)
                except asyncio.TimeoutError:
                    break
                path = head.split(b" ")[1].decode()
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                bodies.append((path, json.loads(await reader.readexactly(length)), head))
                if once and sum(1 for c, _ in _served if c is writer):
                    break
                _served.append((writer, path))
                writer.write(answers[path])
                await writer.drain()
                if b"connection: close" in answers[path].split(b"\r\n\r\n")[0].lower():
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


_served: list = []  # (connection, path) of every answer sent


def _run(answers: dict[str, bytes], script, idle_close_s: float | None = None,
         once: bool = False) -> tuple[object, list, list]:
    async def main():
        connections: list = []
        bodies: list = []
        _served.clear()
        server = await _serve(answers, connections, bodies, idle_close_s, once)
        port = server.sockets[0].getsockname()[1]
        client = FastClient(f"http://127.0.0.1:{port}/v1", api_key="sk-test", timeout=30)  # as bench/serve.py
        try:
            return await script(client), connections, bodies
        finally:
            await client.close()
            server.close()
    return asyncio.run(main())


EVENTS = [{"choices": [{"text": "a", "token_ids": [1]}]}, {"choices": [{"text": "b", "token_ids": [2]}]},
          {"choices": [], "usage": {"completion_tokens": 2}}]
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def test_events_are_read_whole_however_the_chunks_cut_them_and_the_connection_is_kept():
    whole = b"".join(_event(e) for e in EVENTS) + _event("[DONE]")
    # A chunk per event (uvicorn's way), then the same bytes cut at arbitrary places.
    per_event = STREAM_HEAD + _chunked([_event(e) for e in EVENTS] + [_event("[DONE]")])
    cut = STREAM_HEAD + _chunked([whole[:7], whole[7:60], whole[60:61], whole[61:]])
    plain = json.dumps({"usage": {"completion_tokens": 5}}).encode()
    answers = {"/v1/a": per_event, "/v1/b": cut,
               "/v1/c": b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(plain), plain)}

    async def script(client):
        got = []
        for path in ("/a", "/b"):
            got.append([e async for e in client.post_events(path, {"stream": True, "prompt": [1, 2]})])
        got.append(await client.post_json("/c", {"prompt": "x"}))
        return got

    (first, second, answer), connections, bodies = _run(answers, script)
    assert first == EVENTS and second == EVENTS and answer == {"usage": {"completion_tokens": 5}}
    assert len(connections) == 1  # every request after the first reused the kept-alive connection
    assert [b[1] for b in bodies] == [{"stream": True, "prompt": [1, 2]}] * 2 + [{"prompt": "x"}]
    assert all(b"authorization: bearer sk-test" in b[2].lower() for b in bodies)


def test_an_error_event_after_the_200_raises_and_a_4xx_raises_with_its_body():
    stream = STREAM_HEAD + _chunked([_event(EVENTS[0]), _event({"error": {"message": "engine died"}}),
                                     _event("[DONE]")])
    refusal = json.dumps({"error": {"message": "max_tokens must be at least 1"}}).encode()
    answers = {"/v1/s": stream,
               "/v1/bad": b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(refusal), refusal)}

    async def script(client):
        seen = []
        with pytest.raises(RuntimeError, match="engine died"):
            async for e in client.post_events("/s", {}):
                seen.append(e)
        with pytest.raises(HTTPStatusError, match="400.*max_tokens must be at least 1"):
            await client.post_json("/bad", {"max_tokens": 0})
        return seen

    seen, connections, _ = _run(answers, script)
    assert seen == [EVENTS[0]]
    assert len(connections) == 2  # the stream broken off mid-body is not reused


def test_a_connection_the_server_closes_is_not_reused():
    plain = b"{}"
    answers = {"/v1/x": b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n" + plain}

    async def script(client):
        await client.open(1)
        return [await client.post_json("/x", {}), await client.post_json("/x", {})]

    got, connections, _ = _run(answers, script)
    assert got == [{}, {}] and len(connections) == 2



@pytest.mark.parametrize("reuse_s", [0.1, 60.0])
def test_a_connection_the_server_closed_while_idle_is_not_a_failed_request(reuse_s, monkeypatch):
    """The server closes connections idle 0.2 s (uvicorn: 5 s); the client waits 0.4 s between requests. Dropped
    before reuse when idle past IDLE_REUSE_S (0.1 s here), else found closed on reuse and sent again on a new
    connection: every request answered either way, over two connections."""
    import bench.fast_client as fast_client

    monkeypatch.setattr(fast_client, "IDLE_REUSE_S", reuse_s)
    plain = b'{"ok": 1}'
    answers = {"/v1/x": b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(plain), plain)}

    async def script(client):
        first = await client.post_json("/x", {})
        await asyncio.sleep(0.4)
        return [first, await client.post_json("/x", {})]

    got, connections, bodies = _run(answers, script, idle_close_s=0.2)
    assert got == [{"ok": 1}] * 2 and len(connections) == 2 and len(bodies) == 2


def test_a_body_without_length_or_chunks_runs_to_the_connection_end():
    answers = {"/v1/x": b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{\"whole\": true}"}

    async def script(client):
        return await client.post_json("/x", {})

    got, _, _ = _run(answers, script)
    assert got == {"whole": True}


def test_a_reused_connection_closed_before_its_answer_sends_the_request_again():
    """The server reads the second request on a kept-alive connection and closes it unanswered (its close raced
    the client's reuse: the connection looked open): the request goes again on a new connection, answered."""
    plain = b'{"ok": 1}'
    answers = {"/v1/x": b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(plain), plain)}

    async def script(client):
        return [await client.post_json("/x", {"n": 1}), await client.post_json("/x", {"n": 2})]

    got, connections, bodies = _run(answers, script, once=True)
    assert got == [{"ok": 1}] * 2 and len(connections) == 2
    assert [b[1] for b in bodies] == [{"n": 1}, {"n": 2}, {"n": 2}]  # the second sent twice, answered once
