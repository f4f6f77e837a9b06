"""TRL's VLLMClient (the HTTP client of its GRPO/RLOO trainers, installed with --no-deps) against the real
server: generate, chat, get_sequence_logprobs and reset_prefix_cache, checked against the in-process LLM.

Two adaptations, both outside the code under test: the client's constructor refuses to run unless vLLM
is importable (its generation path uses no vLLM code), so that check is patched; and the client sends
no Authorization header, so its requests.Session adds the dev server's keys.
"""
from __future__ import annotations

import math

import pytest
import requests
from testkit.http_server import ADMIN_KEY, DEV_KEY, dev_server

from server import SamplingParams

pytestmark = pytest.mark.timeout(300)
vllm_client = pytest.importorskip("trl.generation.vllm_client")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
ADMIN_PATHS = ("/reset_prefix_cache", "/sleep", "/wake_up")


class KeyedSession(requests.Session):
    def request(self, method, url, *args, **kwargs):
        key = ADMIN_KEY if str(url).endswith(ADMIN_PATHS) else DEV_KEY
        kwargs["headers"] = {**(kwargs.get("headers") or {}), "Authorization": f"Bearer {key}"}
        return super().request(method, url, *args, **kwargs)


@pytest.fixture(scope="module")
def client():
    server = dev_server()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
        mp.setattr(vllm_client.requests, "Session", KeyedSession)
        yield vllm_client.VLLMClient(base_url=server.url)


def test_generate_several_prompts_n2_matches_the_in_process_llm(client, llm):
    out = client.generate(PROMPTS, n=2, temperature=0.0, max_tokens=8, logprobs=0)
    assert out["prompt_ids"] == [llm.tokenizer(p).input_ids for p in PROMPTS]
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    # Prompt-major: both greedy choices of prompt 0, then of prompt 1, ...
    assert out["completion_ids"] == [r.outputs[0].token_ids for r in ref for _ in range(2)]
    assert len(out["logprobs"]) == 6
    for ids, lps, lp_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        assert [row[0] for row in lp_ids] == ids  # logprobs=0: the sampled token only
        assert all(len(row) == 1 and row[0] <= 0 for row in lps)


def test_generate_from_token_ids_and_sampled_logprobs(client, llm):
    ids = [llm.tokenizer(p).input_ids for p in PROMPTS[:2]]
    out = client.generate(ids, n=3, temperature=1.0, max_tokens=5, logprobs=2,
                          generation_kwargs={"seed": 5})
    assert out["prompt_ids"] == ids and len(out["completion_ids"]) == 6
    for comp, lp_ids in zip(out["completion_ids"], out["logprob_token_ids"]):
        assert all(tok in row and 2 <= len(row) <= 3 for tok, row in zip(comp, lp_ids))


def test_chat_matches_the_in_process_llm(client, llm):
    convs = [[{"role": "user", "content": "Name a color."}], [{"role": "user", "content": "Say hi."}]]
    out = client.chat(convs, n=2, temperature=0.0, max_tokens=6, logprobs=1)
    assert out["prompt_ids"] == [llm.engine.encode_chat(c) for c in convs]
    ref = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=6))
    assert out["completion_ids"] == [r.outputs[0].token_ids for r in ref for _ in range(2)]
    assert all(len(row) in (1, 2) for lp in out["logprobs"] for row in lp)


def test_get_sequence_logprobs_scores_what_generate_sampled(client):
    gen = client.generate(PROMPTS[:2], n=1, temperature=1.0, max_tokens=6, logprobs=0,
                          generation_kwargs={"seed": 11})
    sequences = [p + c for p, c in zip(gen["prompt_ids"], gen["completion_ids"])]
    lengths = [len(p) for p in gen["prompt_ids"]]
    scored = client.get_sequence_logprobs(sequences, lengths, top_logprobs=5)
    for i, comp in enumerate(gen["completion_ids"]):
        actual = [row[0] for row in scored["actual_logprobs"][i]]
        assert [row[0] for row in scored["actual_token_ids"][i]] == comp
        assert len(scored["logprobs"][i]) == len(comp) and all(len(r) == 5 for r in scored["logprobs"][i])
        # The sampled tokens' log-probs from generation equal the same tokens scored as a prompt.
        sampled = [row[0] for row in gen["logprobs"][i]]
        assert not any(math.isinf(a) for a in actual)  # the scored token is always reported
        assert actual == pytest.approx(sampled, abs=1e-3)


def test_reset_prefix_cache(client):
    client.reset_prefix_cache()  # raises unless the server answers 200
