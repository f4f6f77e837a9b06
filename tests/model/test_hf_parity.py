"""Greedy decoding must match Hugging Face transformers' own generate, token for token, in fp32."""
from __future__ import annotations

import pytest
import torch

from server import SamplingParams
from testkit.moe_models import hf_greedy
from tests.conftest import PROMPTS

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_reference(default_model_folder):
    return hf_greedy(default_model_folder, PROMPTS, NEW_TOKENS)


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    # Hugging Face's min_new_tokens masks EOS until n tokens exist; our min_tokens does the same.
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def test_batched_matches_transformers(llm, hf_reference):
    outs = llm.generate(PROMPTS, greedy())
    for prompt, out, ref in zip(PROMPTS, outs, hf_reference):
        assert out.outputs[0].token_ids == ref, f"batched output diverged for {prompt!r}"
        assert out.outputs[0].finish_reason == "length"


def test_one_by_one_matches_transformers(llm, hf_reference):
    # Three of the prompts, each alone (the batched test covers all eight; CI's time budget).
    for prompt, ref in list(zip(PROMPTS, hf_reference))[::3]:
        out = llm.generate(prompt, greedy())[0]
        assert out.outputs[0].token_ids == ref, f"single-request output diverged for {prompt!r}"


def test_text_is_the_decoded_tokens(llm, hf_reference):
    out = llm.generate(PROMPTS[0], greedy())[0].outputs[0]
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
