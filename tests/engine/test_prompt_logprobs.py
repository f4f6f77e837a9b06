"""Prompt log-probs come from the prefill the engine runs anyway, and equal a transformers forward
pass over the same tokens (fp32, 1e-4), however the prefill is chunked and whatever the prefix cache holds."""
from __future__ import annotations

import pytest
import torch

from server import LLM, SamplingParams
from tests.conftest import PROMPTS

TOL = 1e-4
LONG = " ".join(PROMPTS[:4])  # ~30 tokens: several chunks of 16


@pytest.fixture(scope="module")
def hf_model(default_model_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_folder, dtype=torch.float32).eval()


def reference(hf_model, ids: list[int]) -> tuple[list[float], torch.Tensor]:
    with torch.no_grad():
        lps = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [lps[i - 1, t].item() for i, t in enumerate(ids) if i > 0], lps


def scored(out) -> list[float]:
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    return [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]


def test_matches_transformers_with_top_k_and_ranks(llm, hf_model):
    outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    for out in outs:
        ref, lps = reference(hf_model, out.prompt_token_ids)
        assert scored(out) == pytest.approx(ref, abs=TOL)
        for pos, entry in enumerate(out.prompt_logprobs[1:]):
            top_v, top_i = lps[pos].topk(3)
            for rank, (v, t) in enumerate(zip(top_v.tolist(), top_i.tolist()), start=1):
                assert entry[t].rank == rank and entry[t].logprob == pytest.approx(v, abs=TOL)
            tok = out.prompt_token_ids[pos + 1]
            assert entry[tok].rank == int((lps[pos] > lps[pos, tok]).sum()) + 1


@pytest.fixture(scope="module")
def chunked(default_model_folder):
    """Chunks of at most 16 tokens, prefix caching on."""
    engine = LLM(model=str(default_model_folder), device="cpu", max_num_batched_tokens=16,
                 kv_cache_memory="8MiB", max_model_len=128)
    yield engine
    engine.close()


def test_chunked_prefill_prefix_cache_and_n(chunked, hf_model):
    ids = chunked.tokenizer(LONG).input_ids
    assert len(ids) > 20
    ref, _ = reference(hf_model, ids)
    # Fill the prefix cache with this prompt first: a later request with prompt log-probs must not reuse it.
    chunked.generate([ids], SamplingParams(temperature=0, max_tokens=2))
    out = chunked.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert scored(out) == pytest.approx(ref, abs=TOL)
    assert out.num_cached_tokens == 0
    # Without prompt log-probs the cache is used, as before.
    assert chunked.generate([ids], SamplingParams(temperature=0, max_tokens=2))[0].num_cached_tokens > 0
    # n > 1: every choice shares one prompt scoring; each entry holds the token (and top-0).
    many = chunked.generate([ids], SamplingParams(temperature=1.0, n=3, max_tokens=2, prompt_logprobs=0, seed=3))[0]
    assert scored(many) == pytest.approx(ref, abs=TOL)
    assert all(len(e) == 1 for e in many.prompt_logprobs[1:])


def test_echo_logprobs_through_the_server_equal_transformers(hf_model):
    from testkit.http_server import main_server

    with main_server().client() as c:
        r = c.post("/v1/completions", json={"prompt": LONG, "max_tokens": 1, "echo": True, "logprobs": 1,
                                            "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = choice["prompt_token_ids"]
    ref, _ = reference(hf_model, ids)
    assert choice["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(ref, abs=TOL)
