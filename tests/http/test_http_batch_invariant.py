"""--batch-invariant through the real server and the official `openai` client: a completion's tokens and
log-probs bit for bit alone and while other requests of other lengths run beside it (greedy and seeded),
echo + logprobs re-scoring equal to the sampled log-probs, and /server_info and /metrics saying the mode is on
(and off on a default server; /server_info is a --dev-mode route, as vLLM's)."""
from __future__ import annotations

import asyncio
import os

import httpx
import openai
import pytest

from testkit.batch_invariance import TARGET_PROMPTS, others
from testkit.http_server import main_server, shared_server

pytestmark = pytest.mark.timeout(600)
OTHERS = int(os.environ.get("SLEEPSERVE_BI_OTHERS", "16"))


@pytest.fixture(scope="module")
def server():
    return shared_server("batch-invariant", ["--batch-invariant", "--max-num-batched-tokens", "64",
                                             "--served-model-name", "smol", "--dev-mode"])


def target_bodies(tokenizer_ids: list[list[int]]) -> list[dict]:
    greedy = {"temperature": 0.0, "max_tokens": 6, "logprobs": 2, "ignore_eos": True}
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 77, "max_tokens": 6, "logprobs": 2, "ignore_eos": True}
    return [{"prompt": ids, **p} for ids in tokenizer_ids for p in (greedy, seeded)]


def essence(choice) -> tuple:
    """Tokens, their log-probs and top log-probs: JSON floats read back as the same doubles."""
    lp = choice.logprobs
    return lp.tokens, lp.token_logprobs, lp.top_logprobs


async def complete(client: openai.AsyncOpenAI, body: dict):
    body = dict(body)
    extra = {"ignore_eos": body.pop("ignore_eos")}
    return (await client.completions.create(model="smol", extra_body=extra, **body)).choices[0]


def test_the_server_says_the_mode_is_on(server):
    info = httpx.get(server.url + "/server_info", headers=server.headers(), timeout=30).json()
    assert info["batch_invariant"] is True and info["engine_config"]["batch_invariant"] is True
    assert server.metric("sleepserve_batch_invariant") == 1.0


def test_a_default_server_says_it_is_off():
    assert main_server().metric("sleepserve_batch_invariant") == 0.0


def test_alone_and_among_concurrent_others_bitwise(server):
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": p}, headers=server.headers()).json()["tokens"]
           for p in TARGET_PROMPTS]
    targets = target_bodies(ids)
    prompts, params = others(OTHERS, 49152, seed=5)
    other_bodies = [{"prompt": p, "temperature": sp.temperature, "seed": sp.seed, "max_tokens": sp.max_tokens,
                     "logprobs": sp.logprobs, "ignore_eos": True} for p, sp in zip(prompts, params)]

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                      timeout=600) as client:
            alone = [essence(await complete(client, b)) for b in targets]
            half = len(other_bodies) // 2
            bodies = other_bodies[:half] + targets + other_bodies[half:]
            outs = await asyncio.gather(*(complete(client, b) for b in bodies))
            return alone, [essence(c) for c in outs[half:half + len(targets)]]

    alone, among = asyncio.run(run())
    for i, (a, b) in enumerate(zip(alone, among)):
        assert a == b, f"target {i}: alone {a} vs among others {b}"
    assert alone[0][0] != alone[1][0], "the seeded target sampled its greedy tokens: the test shows nothing"


def test_echo_rescoring_equals_the_sampled_logprobs(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                      timeout=600) as client:
            sampled = await client.completions.create(
                model="smol", prompt=TARGET_PROMPTS[1], max_tokens=6, temperature=0.9, seed=3, logprobs=1,
                extra_body={"ignore_eos": True, "return_token_ids": True})
            c = sampled.choices[0]
            prompt_ids = c.model_extra["prompt_token_ids"]
            echo = await client.completions.create(
                model="smol", prompt=prompt_ids + c.model_extra["token_ids"], max_tokens=1, temperature=0,
                echo=True, logprobs=1)
            return c, len(prompt_ids), echo.choices[0]

    c, n_prompt, echo = asyncio.run(run())
    n = len(c.logprobs.token_logprobs)
    assert echo.logprobs.token_logprobs[n_prompt:n_prompt + n] == c.logprobs.token_logprobs
    assert echo.logprobs.top_logprobs[n_prompt:n_prompt + n] == c.logprobs.top_logprobs
