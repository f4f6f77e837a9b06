"""The fused sampler compiled on the GPU at a model's vocabulary (tests/engine/sampling_checks.py says what is checked),
and the engine's sampled tokens and log-probs through it."""
from __future__ import annotations

import pytest
import torch

from tests.engine.sampling_checks import check_distribution, check_greedy_and_table, check_model_dtype_reads_as_float32

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows, vocab", [(256, 128256), (7, 49152), (3, 1000)])
def test_greedy_rows_and_log_prob_table(rows, vocab):
    check_greedy_and_table("cuda", rows, vocab)
    check_greedy_and_table("cuda", rows, vocab, chunk=64)
    check_model_dtype_reads_as_float32("cuda", rows, vocab)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_draws_follow_the_distribution(temperature):
    check_distribution("cuda", draws=20000, temperature=temperature, vocab=128256)
    check_distribution("cuda", draws=5000, temperature=temperature, vocab=1000, chunk=64)


def test_engine_log_probs_match_a_recomputation(tmp_path):
    """Greedy with logprobs=0 goes through the fused kernel: the reported log-prob of each token is the model's
    log-softmax at it, the same as the torch path reports with top log-probs (logprobs=1 takes that path).
    Sampled at temperature 1 with logprobs=0 (also fused): each token's log-prob is what scoring the same
    tokens as a prompt gives (prompt_logprobs, the prefill's logits: close, not bit-equal)."""
    from server import LLM, SamplingParams
    from testkit.models import model_folder

    llm = LLM(model=str(model_folder("llama-tiny", tmp_path)), device="cuda", load_format="dummy",
              kv_cache_memory="256MiB", max_num_seqs=8)
    try:
        prompt = "one two three four five six"
        fused, = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0))
        torch_path, = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1))
        a, b = fused.outputs[0], torch_path.outputs[0]
        assert a.token_ids == b.token_ids
        for tok, la, lb in zip(a.token_ids, a.logprobs, b.logprobs):
            assert la[tok].rank == lb[tok].rank
            assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4
        sampled, = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=0))
        ids, lps = sampled.outputs[0].token_ids, sampled.outputs[0].logprobs
        scored, = llm.generate([sampled.prompt_token_ids + ids],
                               SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
        start = len(sampled.prompt_token_ids)
        for j, tok in enumerate(ids):
            assert abs(lps[j][tok].logprob - scored.prompt_logprobs[start + j][tok].logprob) < 0.1, j
    finally:
        llm.close()
