"""Async scheduling on a GPU, where it really overlaps: the decode graphs take their input ids from the
previous step's sampled tokens on the device (never through the host), two pinned staging buffers alternate,
and the tokens come back by a non-blocking copy. Outputs must equal the synchronous engine's, on one engine
switched between the two (same weights, same graphs)."""
from __future__ import annotations

import pytest

from server import LLM, SamplingParams
from testkit.models import model_folder
from tests.engine.test_async_scheduling import run, same

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,",
           "The quick brown fox", "List three colors:", "Hello", "Translate to French: good morning"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return model_folder("llama-tiny", tmp_path_factory.mktemp("models"))


def both(llm: LLM, reqs, hook=None) -> tuple[dict, dict]:
    llm.engine.set_async_scheduling(False)
    off = run(llm, reqs)
    llm.engine.set_async_scheduling(True)
    before = llm.engine.steps_ahead
    on = run(llm, reqs, hook)
    llm.engine.set_async_scheduling(False)
    assert llm.engine.steps_ahead > before, "no step went ahead"
    return off, on


def test_graph_decode_with_device_input_ids(tiny):
    """bf16 with graphs; every sequence runs to its length, so both modes run the very same batch shapes
    (3 and 5 pad into the buckets 4 and 8) and must agree token for token, seeded sampling included."""
    llm = LLM(model=str(tiny), device="cuda", load_format="dummy", kv_cache_memory="256MiB", max_num_seqs=8)
    try:
        assert llm.engine.runner.graphs is not None
        for k in (1, 3, 5):
            reqs = [(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1))
                    for p in PROMPTS[:k]]
            reqs.append((PROMPTS[7], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)))
            off, on = both(llm, reqs)
            for rid in off:
                same(on[rid], off[rid])
    finally:
        llm.close()


def test_mixed_ends_and_sleep_mid_batch(tiny):
    """float32 (batch-shape rounding far below any argmax margin): ends at different steps by stop token
    and length, and a level-1 sleep (mode keep) with a step in flight."""
    llm = LLM(model=str(tiny), device="cuda", load_format="dummy", kv_cache_memory="256MiB", max_num_seqs=8,
              dtype="float32")
    try:
        ref = run(llm, [(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))])
        stop = ref["r0"].outputs[0].token_ids[7]
        reqs = [(p, SamplingParams(temperature=0.0, max_tokens=6 + 7 * i, stop_token_ids=[stop]))
                for i, p in enumerate(PROMPTS)]
        off, on = both(llm, reqs)
        for rid in off:
            same(on[rid], off[rid])
        assert on["r0"].outputs[0].finish_reason == "stop"

        def hook(step: int, done: dict) -> None:
            if step == 9:
                assert llm.engine._inflight is not None
                llm.sleep(level=1, mode="keep")
                llm.wake_up()

        off, on = both(llm, reqs, hook)
        for rid in off:
            same(on[rid], off[rid])
    finally:
        llm.close()
