"""The fused sampler compiled on the GPU at a model's vocabulary (tests/sampling_checks.py says what is checked),
and the engine's sampled tokens and log-probs through it."""
from __future__ import annotations

import pytest
import torch

from tests.sampling_checks import check_distribution, check_greedy_and_table

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows, vocab", [(256, 128256), (7, 49152), (3, 1000)])
def test_greedy_rows_and_log_prob_table(rows, vocab):
    check_greedy_and_table("cuda", rows, vocab)
    check_greedy_and_table("cuda", rows, vocab, chunk=64)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_draws_follow_the_distribution(temperature):
    check_distribution("cuda", draws=20000, temperature=temperature, vocab=128256)
    check_distribution("cuda", draws=5000, temperature=temperature, vocab=1000, chunk=64)


def test_engine_log_probs_match_a_recomputation(tmp_path):
    """Greedy with logprobs=0 goes through the fused kernel: the reported log-prob of each token is the model's
    log-softmax at it, the same as the torch path reports with top log-probs (logprobs=1 takes that path)."""
    from server import LLM, SamplingParams
    from tests.models import model_folder

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
    finally:
        llm.close()
