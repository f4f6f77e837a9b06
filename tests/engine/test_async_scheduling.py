"""Async scheduling (--async-scheduling, EngineCore._step_async): the same outputs as the synchronous
engine, token for token, with nothing extra computed leaking out: stops by string, token and EOS at
different steps, max_tokens, n > 1, log-probs, prompt log-probs, a grammar and penalties (which fall
back to synchronous steps), aborts, sleep and pause in the middle of a batch, preemption and chunked
prefill. Each test also checks that steps really were launched ahead, so it cannot pass on the
synchronous path alone. The HTTP server's side is in test_http_async_scheduling.py."""
from __future__ import annotations

import math

import pytest

from server import LLM, SamplingParams
from server.engine.memory_plan import kv_bytes_per_block
from server.wire.params import StructuredOutputs
from tests.conftest import PROMPTS


def greedy(n: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


@pytest.fixture(scope="module")
def async_llm(default_model_folder):
    engine = LLM(model=str(default_model_folder), device="cpu", async_scheduling=True)
    assert engine.engine.async_scheduling
    yield engine
    engine.close()


def run(llm: LLM, reqs: list[tuple[str, SamplingParams]], hook=None) -> dict[str, object]:
    """Add the requests, step until each finished (hook(step number, outputs so far) between steps), then
    check that nothing is left in flight or holding blocks. Returns the final output per request id."""
    eng = llm.engine
    for i, (prompt, params) in enumerate(reqs):
        eng.add_request(f"r{i}", prompt, params=params)
    done: dict[str, object] = {}
    step = 0
    while len(done) < len(reqs):
        assert eng.can_step, eng.sleep_state
        for out in eng.step():
            if out.finished:
                assert out.request_id not in done, "a request finished twice"
                done[out.request_id] = out
        step += 1
        if hook is not None:
            hook(step, done)
    eng.drain()
    assert not eng.has_unfinished and eng.stats().kv_blocks_used == 0 and eng.stats().running == 0
    return done


def same(a, b, check_logprobs: bool = True) -> None:
    """Two RequestOutputs of the same request: equal tokens, text and ends; log-probs equal to float noise
    (a step of the async engine may hold one more row, and a CPU GEMM's rounding can depend on the rows)."""
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs):
        assert x.token_ids == y.token_ids
        assert x.text == y.text
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        if check_logprobs and x.logprobs is not None:
            assert y.logprobs is not None and len(x.logprobs) == len(y.logprobs) == len(x.token_ids)
            for ex, ey in zip(x.logprobs, y.logprobs):
                assert ex.keys() == ey.keys()
                for t in ex:
                    assert math.isclose(ex[t].logprob, ey[t].logprob, rel_tol=1e-4, abs_tol=1e-4)
                    assert ex[t].decoded_token == ey[t].decoded_token
    if a.prompt_logprobs is not None:
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for ex, ey in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert ex.keys() == ey.keys()


def compare(llm: LLM, async_llm: LLM, reqs, hook=None, expect_ahead: bool = True) -> dict[str, object]:
    reference = run(llm, reqs)
    before = async_llm.engine.steps_ahead
    got = run(async_llm, reqs, hook)
    if expect_ahead:
        assert async_llm.engine.steps_ahead > before, "no step was launched ahead: the test ran synchronously"
    assert got.keys() == reference.keys()
    for rid in reference:
        same(got[rid], reference[rid])
    return got


def tokens_of(llm: LLM, prompt: str, n: int) -> list[int]:
    return llm.generate(prompt, greedy(n))[0].outputs[0].token_ids


def test_mixed_batch_equals_synchronous(llm, async_llm):
    """Ends at every step (different max_tokens, a stop string, a stop token), log-probs with and without
    a top-k, n=2 seeded sampling, prompt log-probs: identical outputs, no token past any end."""
    stop_token = tokens_of(llm, PROMPTS[3], 9)[6]
    reqs = [(p, greedy(2 + 3 * i)) for i, p in enumerate(PROMPTS)]
    reqs += [
        (PROMPTS[1], greedy(24, stop=["\n"])),
        (PROMPTS[2], greedy(24, stop=[" the", "."], include_stop_str_in_output=True)),
        (PROMPTS[3], greedy(24, stop_token_ids=[stop_token])),
        (PROMPTS[4], greedy(12, logprobs=0)),
        (PROMPTS[5], greedy(12, logprobs=3)),
        (PROMPTS[6], SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=12, logprobs=1)),
        (PROMPTS[7], greedy(8, prompt_logprobs=2)),
    ]
    got = compare(llm, async_llm, reqs)
    assert got["r10"].outputs[0].finish_reason == "stop" and got["r10"].outputs[0].stop_reason == stop_token
    assert len(got["r10"].outputs[0].token_ids) == 7


def test_eos_stops_without_an_extra_token(llm, async_llm):
    """A sequence that samples EOS at step t was already scheduled for t+1: that token is dropped."""
    ref = tokens_of(llm, PROMPTS[0], 12)
    saved = (llm.engine.eos_ids, async_llm.engine.eos_ids)
    eos = frozenset({ref[5]})
    llm.engine.scheduler.eos_ids = async_llm.engine.scheduler.eos_ids = eos
    try:
        got = compare(llm, async_llm, [(PROMPTS[0], greedy(16)), (PROMPTS[1], greedy(16)), (PROMPTS[2], greedy(8))])
    finally:
        llm.engine.scheduler.eos_ids, async_llm.engine.scheduler.eos_ids = saved
    first = ref.index(ref[5])
    assert got["r0"].outputs[0].finish_reason == "stop" and len(got["r0"].outputs[0].token_ids) == first + 1


def test_grammar_and_penalties_fall_back_to_synchronous_steps(llm, async_llm):
    """Masks and penalties need the previous token on the host: those steps run synchronously, others not."""
    reqs = [
        (PROMPTS[3], greedy(10, structured_outputs=StructuredOutputs(regex=r"(red|green|blue)(, (red|green|blue))*"))),
        (PROMPTS[0], greedy(12, repetition_penalty=1.3)),
        (PROMPTS[1], greedy(8, min_tokens=4)),
        (PROMPTS[5], greedy(20)),  # outlives the others: its last steps go ahead again
    ]
    compare(llm, async_llm, reqs)


def test_abort_mid_batch(llm, async_llm):
    reqs = [(p, greedy(14)) for p in PROMPTS[:4]]
    reference = run(llm, reqs)
    eng = async_llm.engine
    aborted = []

    def hook(step: int, done: dict) -> None:
        if step == 5:
            assert eng._inflight is not None  # the abort lands while a step is in flight
            req = eng.requests["r1"]
            assert eng.abort_request("r1")
            done["r1"] = req.output()
            aborted.append(step)

    got = run(async_llm, reqs, hook)
    assert aborted
    for rid in ("r0", "r2", "r3"):
        same(got[rid], reference[rid])
    cut = got["r1"].outputs[0]
    assert cut.finish_reason == "abort"
    assert cut.token_ids == reference["r1"].outputs[0].token_ids[:len(cut.token_ids)]


@pytest.mark.parametrize("how", ["sleep", "pause"])
def test_sleep_or_pause_with_a_step_in_flight(llm, async_llm, how):
    """mode=keep in the middle of a batch: the step in flight is recorded first, the sequences recompute
    their KV after the wake, and the outputs equal an uninterrupted synchronous run."""
    reqs = [(p, greedy(10 + 2 * i)) for i, p in enumerate(PROMPTS[:4])]
    eng = async_llm.engine
    slept = []

    def hook(step: int, done: dict) -> None:
        if step == 5:
            assert eng._inflight is not None
            if how == "sleep":
                async_llm.sleep(level=1, mode="keep")
                assert eng._inflight is None and async_llm.is_sleeping()
                async_llm.wake_up()
            else:
                async_llm.pause(mode="keep")
                assert eng._inflight is None
                async_llm.resume()
            slept.append(step)

    compare(llm, async_llm, reqs, hook)
    assert slept


def test_weight_update_and_prefix_reset_drain(llm, async_llm):
    """A weight reload (same weights) and a prefix-cache reset mid-batch wait for the step in flight."""
    reqs = [(p, greedy(10)) for p in PROMPTS[:3]]
    eng = async_llm.engine

    def hook(step: int, done: dict) -> None:
        if step == 4:
            async_llm.reset_prefix_cache()
            assert eng._inflight is None
        if step == 6:
            async_llm.pause(mode="keep")
            async_llm.update_weights()
            assert eng._inflight is None
            async_llm.resume()

    compare(llm, async_llm, reqs, hook)


def test_preemption_and_chunked_prefill(llm, default_model_folder):
    """A cache too small for every sequence at once (schedule_ahead finds no free block: the step falls back
    and preempts) and prompts split into chunks (no step goes ahead while a prompt is unfinished)."""
    reqs = [(p, greedy(24)) for p in PROMPTS]
    reference = run(llm, reqs)
    cfg = llm.engine.model_config
    per_block = kv_bytes_per_block(cfg, 16, llm.engine.dtype)
    small = LLM(model=str(default_model_folder), device="cpu", kv_cache_memory=12 * per_block, max_model_len=128,
                enable_prefix_caching=False, max_num_batched_tokens=24, async_scheduling=True)
    try:
        got = run(small, reqs)
        assert small.engine.stats().preemptions > 0, "the cache was meant to be too small for all at once"
        assert small.engine.steps_ahead > 0
    finally:
        small.close()
    for rid in reference:
        same(got[rid], reference[rid])


def test_llm_generate_and_max_model_len(llm, async_llm):
    """LLM.generate (FINAL_ONLY outputs, text at the end) and sequences that end at the context limit."""
    params = [greedy(12), greedy(5), greedy(1), greedy(20, stop=[","])]
    ref = llm.generate(PROMPTS[:4], params)
    got = async_llm.generate(PROMPTS[:4], params)
    for a, b in zip(got, ref):
        same(a, b)
    long = PROMPTS[2] * 3
    n = len(llm.engine.encode(long))
    eng = async_llm.engine
    saved = eng.max_model_len, llm.engine.max_model_len
    eng.max_model_len = llm.engine.max_model_len = n + 6
    try:
        got = compare(llm, async_llm, [(long, SamplingParams(temperature=0.0, max_tokens=None)),
                                       (PROMPTS[0], greedy(8))])
    finally:
        eng.max_model_len, llm.engine.max_model_len = saved
    assert got["r0"].outputs[0].finish_reason == "length" and len(got["r0"].outputs[0].token_ids) == 6
