"""Concurrency and disconnects through the real server: 32 streaming clients at once, and clients that
leave mid-request get their requests aborted and their KV blocks freed (seen in /metrics)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from testkit.http_server import main_server, wait_for

pytestmark = pytest.mark.timeout(300)

ANIMALS = ["cat", "dog", "fox", "owl", "bee", "elk", "yak", "ant"]
PROMPTS = [f"Story {i}: once upon a time, a {ANIMALS[i % 8]} named {chr(65 + i % 26)}{i} went to" for i in range(32)]
MAX_TOKENS = 12
LONG = {"prompt": "Tell me a long story about the sea. " * 20, "max_tokens": 700, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    return main_server()


def blocks_used(server) -> float:
    return server.metric("sleepserve_kv_cache_blocks_used")


def idle(server) -> bool:
    return (server.metric("sleepserve_requests_running") == 0 and server.metric("sleepserve_requests_waiting") == 0
            and blocks_used(server) == 0)


async def _stream(client: httpx.AsyncClient, prompt: str) -> dict:
    text, chunks, finish, usage = "", 0, None, None
    async with client.stream("POST", "/v1/completions", json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, await r.aread()
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0]["finish_reason"] or finish
                chunks += 1
            else:
                usage = chunk["usage"]
    return {"text": text, "chunks": chunks, "finish": finish, "usage": usage, "done": done}


async def _complete(client: httpx.AsyncClient, prompt: str) -> str:
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                   "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_32_concurrent_streams_match_non_streamed_greedy(server):
    async def run() -> tuple[list[str], list[dict]]:
        async with server.async_client() as client:
            reference = await asyncio.gather(*(_complete(client, p) for p in PROMPTS))
            streamed = await asyncio.gather(*(_stream(client, p) for p in PROMPTS))
            return list(reference), list(streamed)

    reference, streamed = asyncio.run(run())
    assert len(set(reference)) > 16, "the prompts should give different continuations"
    for i, (ref, got) in enumerate(zip(reference, streamed)):
        assert got["done"] and got["finish"] == "length", (i, got)
        assert got["text"] == ref, (i, got["text"], ref)
        assert got["usage"]["completion_tokens"] == MAX_TOKENS
        assert got["chunks"] >= MAX_TOKENS // 2, got  # streamed piece by piece, not in one lump
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    wait_for(lambda: idle(server), what="the engine to go idle after the streams")


def test_stream_disconnect_aborts_and_frees_blocks(server):
    wait_for(lambda: idle(server), what="an idle engine before the test")
    aborted_before = server.metric("sleepserve_requests_finished_total", '{finish_reason="disconnected"}') \
        if "disconnected" in httpx.get(server.url + "/metrics").text else 0.0
    with server.client() as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            seen, held = 0, 0.0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    held = blocks_used(server)  # the request holds KV blocks while it streams
                    break  # leaving iter_lines closes the connection (httpx): the client is gone
    assert held > 0
    # The client is gone: the server notices, aborts the request and frees its blocks.
    wait_for(lambda: idle(server), timeout=10, what="KV blocks to be freed after the client left")
    assert server.metric("sleepserve_requests_finished_total", '{finish_reason="disconnected"}') == aborted_before + 1


def test_non_streamed_disconnect_aborts_and_frees_blocks(server):
    wait_for(lambda: idle(server), what="an idle engine before the test")
    with server.client(timeout=httpx.Timeout(60, read=1.0)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=LONG)  # ~700 tokens: far longer than the 1 s we wait
    wait_for(lambda: idle(server), timeout=10, what="KV blocks to be freed after the client timed out")
    assert '" 499 ' in server.log_text()  # the access log says the client closed the request


def test_server_healthy_after_load(server):
    start = time.monotonic()
    with server.client() as client:
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and time.monotonic() - start < 30
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
