"""Sampled log-probs are kept as plain (token, logprob, rank, text) tuples and read as vLLM's dicts
(server/wire/logprob_list.py): an RL rollout's million entries cost the collector nothing per token."""
from __future__ import annotations

import gc

import pytest

from server import SamplingParams
from server.wire.logprob_list import LogprobList
from server.wire.outputs import Logprob
from tests.conftest import PROMPTS


def test_reads_as_a_list_of_token_logprobs_dicts():
    # The second token was asked for its top 2 and is not among them (rank 3).
    lps = LogprobList([(5, -0.5, 1, "a"), (7, -2.0, 3, "b", 9, -0.1, 1, "c", 4, -1.0, 2, "d")])
    assert len(lps) == 2
    assert lps[0] == {5: Logprob(-0.5, 1, "a")}
    assert list(lps[1]) == [9, 4, 7]  # the top-k first, then the sampled token
    assert lps[1][7] == Logprob(-2.0, 3, "b") and lps[-1] == lps[1]
    assert isinstance(lps[1:], LogprobList) and lps[1:] == [lps[1]]
    assert list(lps) == [lps[0], lps[1]] and lps == [lps[0], lps[1]] and lps != [lps[0]]
    with pytest.raises(IndexError):
        lps[2]


def test_in_process_log_probs_are_untracked_tuples(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, logprobs=2, ignore_eos=True)
    outs = llm.generate(PROMPTS[2], params)[0].outputs
    gc.collect()
    for o in outs:
        assert len(o.logprobs) == len(o.token_ids) == 12
        # Tuples of numbers and strings: the collector untracks them once, then never walks them again.
        assert not any(gc.is_tracked(entry) for entry in o.logprobs.wire)
        entries = list(o.logprobs)
        assert all(tok in entry and len(entry) in (2, 3) for tok, entry in zip(o.token_ids, entries))
        assert sum(e[t].logprob for t, e in zip(o.token_ids, entries)) == pytest.approx(o.cumulative_logprob)
