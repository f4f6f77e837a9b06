"""Async scheduling through the real server (`--async-scheduling`, engine process): every answer equals the
synchronous server's (the shared main server), streamed and not, with mixed ends, n > 1, log-probs and a
structured-output request in the batch; an abort mid-stream and a sleep (mode keep) with streams in flight
change nothing for the other requests. Requests go together (asyncio, the official client) so they share
steps, as they must for a step to be launched ahead."""
from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest

from testkit.http_server import MAIN_KEY, main_server, shared_server

MODEL = "smol"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three primary colors:", "The quick brown fox", "1, 2, 3, 4, 5,"]


def async_server():
    return shared_server("async", ["--async-scheduling", "--dev-mode", "--served-model-name", MODEL])


def bodies() -> list[dict]:
    """Requests that end at different steps and by every kind of end, plus the fallbacks."""
    out = [{"prompt": p, "max_tokens": 3 + 3 * i, "temperature": 0} for i, p in enumerate(PROMPTS)]
    out += [
        {"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0, "stop": ["."]},
        {"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0, "stop": ["\n\n", "return"]},
        {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "logprobs": 2},
        {"prompt": PROMPTS[3], "max_tokens": 10, "temperature": 1.0, "seed": 5, "n": 2},
        {"prompt": PROMPTS[4], "max_tokens": 8, "temperature": 0,
         "extra_body": {"structured_outputs": {"regex": "(red|green|blue)( and (red|green|blue))*"}}},
    ]
    return out


def summary(choice, stream_text: str | None = None) -> tuple:
    return (choice.index, stream_text if stream_text is not None else choice.text, choice.finish_reason)


async def ask(url: str, key: str | None, body: dict, stream: bool) -> list[tuple]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key or "EMPTY", max_retries=0, timeout=300)
    try:
        body = dict(body)
        extra = body.pop("extra_body", None)
        if not stream:
            r = await client.completions.create(model=MODEL, extra_body=extra, **body)
            out = []
            for c in sorted(r.choices, key=lambda c: c.index):
                lp = None
                if c.logprobs is not None:
                    lp = (c.logprobs.tokens, c.logprobs.token_logprobs)
                out.append((*summary(c), lp))
            return out
        texts: dict[int, str] = {}
        ends: dict[int, str | None] = {}
        chunks = await client.completions.create(model=MODEL, extra_body=extra, stream=True, **body)
        async for chunk in chunks:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                if c.finish_reason is not None:
                    ends[c.index] = c.finish_reason
        return [(i, texts[i], ends.get(i), None) for i in sorted(texts)]
    finally:
        await client.close()


async def ask_all(url: str, key: str | None, stream: bool) -> list[list[tuple]]:
    return list(await asyncio.gather(*(ask(url, key, b, stream) for b in bodies())))


def assert_same(got: list[list[tuple]], want: list[list[tuple]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert [x[:3] for x in g] == [x[:3] for x in w]
        for (*_, lg), (*_, lw) in zip(g, w):
            if lw is not None:
                assert lg[0] == lw[0]
                assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(lg[1], lw[1]))


@pytest.fixture(scope="module")
def servers():
    sync, asy = main_server(), async_server()
    info = httpx.get(asy.url + "/server_info", timeout=30)
    assert info.status_code == 200, info.text
    assert info.json()["engine_config"]["async_scheduling"] is True
    return sync, asy


@pytest.mark.parametrize("stream", [False, True])
def test_answers_equal_the_synchronous_server(servers, stream):
    sync, asy = servers
    want = asyncio.run(ask_all(sync.url, MAIN_KEY, stream))
    got = asyncio.run(ask_all(asy.url, None, stream))
    assert_same(got, want)


def test_abort_mid_stream_and_sleep_keep_with_streams_in_flight(servers):
    """One stream is dropped after a few chunks (its sequence aborted with a step in flight), then a level-1
    sleep with mode=keep lands while the others stream; after the wake they go on and end exactly as on the
    synchronous server."""
    sync, asy = servers
    long = [{"prompt": p, "max_tokens": 30, "temperature": 0} for p in PROMPTS[:3]]
    want = asyncio.run(_gather(sync.url, MAIN_KEY, long))

    async def scenario() -> list:
        tasks = [asyncio.create_task(ask(asy.url, None, b, True)) for b in long]
        client = openai.AsyncOpenAI(base_url=asy.url + "/v1", api_key="EMPTY", max_retries=0, timeout=300)
        try:
            dropped = await client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=200, temperature=0,
                                                      stream=True)
            seen = 0
            async for _ in dropped:
                seen += 1
                if seen == 3:
                    break
            await dropped.close()  # the disconnect aborts it
            async with httpx.AsyncClient(base_url=asy.url, timeout=120) as http:
                r = await http.post("/sleep", params={"level": 1, "mode": "keep"})
                assert r.status_code == 200, r.text
                r = await http.post("/wake_up")
                assert r.status_code == 200, r.text
        finally:
            await client.close()
        return list(await asyncio.gather(*tasks))

    got = asyncio.run(scenario())
    assert_same(got, want)
    # Still serving, and identically.
    assert_same(asyncio.run(_gather(asy.url, None, long[:1])), want[:1])
    assert httpx.get(asy.url + "/health", timeout=30).json()["status"] == "ok"


async def _gather(url: str, key: str | None, bs: list[dict]) -> list[list[tuple]]:
    return list(await asyncio.gather(*(ask(url, key, b, True) for b in bs)))
