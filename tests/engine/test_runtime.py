"""The runtime's guarantees on the default model (CPU): prefix caching, preemption, sampling, limits."""
from __future__ import annotations

import pytest

from server import LLM, SamplingParams
from server.wire.params import InvalidRequestError
from server.engine.memory_plan import kv_bytes_per_block
from tests.conftest import PROMPTS

LONG_PROMPT = ("You are a careful assistant. Read the following notes and answer briefly. " * 6
               + "Question: what colour is the sky on a clear day?")


def greedy(n: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def test_prefix_cache_hit_gives_identical_tokens(llm):
    llm.reset_prefix_cache()
    before = llm.engine.stats()
    cold = llm.generate(LONG_PROMPT, greedy())[0]
    assert cold.num_cached_tokens == 0
    warm = llm.generate(LONG_PROMPT, greedy())[0]
    after = llm.engine.stats()
    assert warm.num_cached_tokens >= 64, "the second request should reuse the first one's full blocks"
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == warm.num_cached_tokens
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    # A different question on the same preamble shares the preamble's blocks and still matches a cold run.
    other = LONG_PROMPT.replace("sky", "grass")
    shared = llm.generate(other, greedy())[0]
    assert shared.num_cached_tokens > 0
    llm.reset_prefix_cache()
    fresh = llm.generate(other, greedy())[0]
    assert fresh.num_cached_tokens == 0
    assert shared.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_preemption_under_a_tiny_cache_keeps_tokens(llm, default_model_folder):
    reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(24))]
    cfg = llm.engine.model_config
    per_block = kv_bytes_per_block(cfg, 16, llm.engine.dtype)
    # 12 usable blocks = 192 tokens for 8 sequences that need ~35 tokens (3 blocks) each: they must take turns.
    small = LLM(model=str(default_model_folder), device="cpu", kv_cache_memory=12 * per_block,
                max_model_len=128, enable_prefix_caching=False)
    try:
        outs = small.generate(PROMPTS, greedy(24))
        assert small.engine.stats().preemptions > 0, "the cache was meant to be too small for all at once"
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert small.engine.stats().kv_blocks_used == 0
    finally:
        small.close()


def test_seed_makes_sampling_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24)
    alone = llm.generate(PROMPTS[2], p)[0].outputs[0].token_ids
    batched = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[5]], p)[1].outputs[0].token_ids
    assert alone == batched
    other = llm.generate(PROMPTS[2], SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=24))
    assert other[0].outputs[0].token_ids != alone


def test_n_samples_and_logprobs(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, logprobs=3))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "three samples at temperature 1 should differ"
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and entry[tok].logprob <= 0.0
            assert len(entry) >= 3
    g = llm.generate(PROMPTS[0], greedy(8, logprobs=2))[0].outputs[0]
    assert all(entry[tok].rank == 1 for tok, entry in zip(g.token_ids, g.logprobs))


def test_stop_string_truncates_and_reports(llm):
    full = llm.generate(PROMPTS[1], greedy(32))[0].outputs[0].text
    stop = full[10:14]
    assert stop and stop in full
    out = llm.generate(PROMPTS[1], greedy(32, stop=[stop]))[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(PROMPTS[1], greedy(32, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_streamed_deltas_add_up_and_never_show_cut_text(llm):
    core = llm.engine
    full = llm.generate(PROMPTS[6], greedy(40))[0].outputs[0].text
    stop = full[20:26]
    deltas: list[str] = []
    core.add_request("stream-test", PROMPTS[6], params=greedy(40, stop=[stop]),
                     on_output=lambda o: deltas.append(o.outputs[0].delta_text))
    while core.has_unfinished:
        core.step()
    assert "".join(deltas) == full[: full.index(stop)]


def test_final_only_hands_out_the_first_tokens_and_the_end_with_everything_else_identical(llm):
    """FINAL_ONLY (LLM.generate, non-streaming HTTP): an output when the first tokens are sampled and one at
    the end, text decoded once at the end; the end must be exactly what an output per step builds, with
    temperature 1 and a seed (tokens, text, log-probs), ended by length, by EOS or by abort."""
    from server.wire.params import RequestOutputKind

    core = llm.engine

    def run(kind: RequestOutputKind, abort_after: int | None = None, **kw) -> list:
        params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=20, logprobs=1, output_kind=kind, **kw)
        outs: list = []
        core.add_request(f"kind-{kind.name}-{abort_after}", PROMPTS[3], params=params, on_output=outs.append)
        steps = 0
        while core.has_unfinished:
            core.step()
            steps += 1
            if abort_after is not None and steps == abort_after:
                core.abort_request(f"kind-{kind.name}-{abort_after}")
        return outs

    for kw, abort_after in (({}, None), ({"ignore_eos": True}, None), ({}, 8)):
        every = run(RequestOutputKind.CUMULATIVE, abort_after, **kw)
        final = run(RequestOutputKind.FINAL_ONLY, abort_after, **kw)
        assert len(every) > 2 and len(final) == 2 and final[-1].finished
        assert [o.delta_token_ids for o in final[0].outputs] == [o.delta_token_ids for o in every[0].outputs]
        for a, b in zip(every[-1].outputs, final[-1].outputs):
            assert (a.text, a.token_ids, a.logprobs, a.finish_reason, a.stop_reason) == \
                   (b.text, b.token_ids, b.logprobs, b.finish_reason, b.stop_reason)
            assert a.text and b.text == "".join(o.outputs[b.index].delta_text for o in final)


def test_stop_token_ids_and_min_tokens(llm):
    first = llm.generate(PROMPTS[0], greedy(16))[0].outputs[0].token_ids
    i = next(i for i in range(2, len(first)) if first[i] not in first[:i])  # its first occurrence
    out = llm.generate(PROMPTS[0], greedy(16, stop_token_ids=[first[i]]))[0].outputs[0]
    assert out.token_ids == first[: i + 1] and out.stop_reason == first[i]
    at_least = llm.generate(PROMPTS[0], greedy(16, stop_token_ids=[first[0]], min_tokens=5))[0].outputs[0]
    assert len(at_least.token_ids) >= 5


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"logprobs": 99}, "logprobs"),
    ({"n": 0}, "n"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field and field in str(e.value)


def test_bad_requests_leave_the_engine_serving(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate("", greedy())
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate("hello " * 9000, greedy())
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.generate("hello", SamplingParams(max_tokens=10**6))
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[10, 20, 10**7]], greedy())
    assert not llm.engine.has_unfinished
    assert llm.generate(PROMPTS[0], greedy(4))[0].outputs[0].finish_reason == "length"


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], greedy(16))[0]
    ids = out.prompt_token_ids
    assert llm.tokenizer.decode(ids).rstrip().endswith("assistant")
    assert out.outputs[0].text


def test_decode_tables_kept_between_steps_equal_a_fresh_padding():
    """ModelRunner.decode_tables rewrites only the rows whose table grew since the last batch; on random steps
    (tables growing in place, replaced by new lists as preemption and admission do, batches changing) the
    result must be the tables padded from scratch."""
    import random

    import numpy as np

    from server.engine.kv_cache import NULL_BLOCK
    from server.engine.host_batch import DecodeTables, pad_tables

    rng = random.Random(0)
    cache = DecodeTables()
    tables = [[rng.randrange(1, 999) for _ in range(rng.randrange(1, 5))] for _ in range(12)]
    for step in range(300):
        for t in tables:
            if rng.random() < 0.2:
                t.append(rng.randrange(1, 999))  # a new block
        if rng.random() < 0.05:  # a sequence preempted and admitted again: a new list, maybe as long
            i = rng.randrange(len(tables))
            tables[i] = [rng.randrange(1, 999) for _ in range(len(tables[i]))]
        if rng.random() < 0.03:  # the batch changes: one ends, one joins
            tables.pop(rng.randrange(len(tables)))
            tables.append([rng.randrange(1, 999)])
        width = max(map(len, tables)) + rng.choice([0, 0, 3])
        want = np.empty((len(tables), width), dtype=np.int64)
        pad_tables(tables, width, want)
        got = cache.padded(tables, width)
        assert got.shape == want.shape and (got == want).all(), step
        assert (got[np.arange(width)[None, :] >= np.array([len(t) for t in tables])[:, None]] == NULL_BLOCK).all()
