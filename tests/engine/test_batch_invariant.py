"""--batch-invariant through the in-process LLM on the CPU (fp32, the embedded model): a request's tokens and
log-probs, bit for bit, alone and among other requests of other lengths (greedy and seeded sampling), on a
prefix-cache hit, with its prompt prefilled in other chunks, after level-1 and level-2 sleep cycles, and
re-scored as a prompt. SLEEPSERVE_BI_OTHERS sets how many others; tests/gpu/test_batch_invariant_gpu.py runs
these same tests on CUDA (bf16, CUDA graphs) with its own fixtures: 255 others and all four targets."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest

from server import LLM, SamplingParams
from server.config import EngineConfig
from server.model.ops import TorchOps
from testkit.batch_invariance import (
    GREEDY,
    SEEDED,
    TARGET_PROMPTS,
    alone_and_among,
    explain,
    rescored,
    result,
)

OTHERS = int(os.environ.get("SLEEPSERVE_BI_OTHERS", "16"))
# A small token budget: the others' prompts and a long prompt are prefilled in several chunks, beside decodes.
BUDGET = 32


@pytest.fixture(scope="module")
def inv(default_model_folder):
    engine = LLM(model=str(default_model_folder), device="cpu", batch_invariant=True, max_num_batched_tokens=BUDGET,
                 kv_cache_memory="256MiB", max_model_len=1024)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def n_others() -> int:
    return OTHERS


@pytest.fixture(scope="module")
def targets() -> list:
    """Two targets on the CPU, where a step costs ~0.3 s (the H200 test takes all four)."""
    return [(TARGET_PROMPTS[1], GREEDY), (TARGET_PROMPTS[1], SEEDED)]


def test_the_mode_reaches_the_model(inv):
    assert inv.engine.config.batch_invariant is True
    assert inv.engine.runner.model.ops.batch_invariant is True
    assert inv.engine.runner.model.ops.name.endswith("batch-invariant")


def test_alone_and_among_others_bitwise(inv, n_others, targets):
    inv.reset_prefix_cache()  # the targets' prompts are prefilled among the others, not read back
    pairs = alone_and_among(inv, n_others, targets=targets)
    for (alone, among), (prompt, params) in zip(pairs, targets):
        assert alone == among, f"{prompt[:20]!r} at temperature {params.temperature}: {explain(alone, among)}"
    greedy = [a for (a, _), (_, p) in zip(pairs, targets) if p.temperature == 0]
    seeded = [a for (a, _), (_, p) in zip(pairs, targets) if p.temperature > 0]
    assert greedy[-1][0] != seeded[-1][0], "the seeded target sampled its greedy tokens: the test shows nothing"


def test_prefix_cache_hit_bitwise(inv):
    ids = inv.tokenizer.encode(TARGET_PROMPTS[1] + " The keeper had lived alone on the rock for thirty years, and "
                                                   "every night he lit the lamp.")
    assert len(ids) > 32
    inv.reset_prefix_cache()
    fresh = inv.generate([ids], [GREEDY])[0]
    hit = inv.generate([ids], [GREEDY])[0]
    assert fresh.num_cached_tokens == 0 and hit.num_cached_tokens >= 32
    assert result(fresh) == result(hit), explain(result(fresh), result(hit))


def test_long_prompt_in_other_chunks_bitwise(inv):
    """The same long prompt prefilled in chunks at 0, 32, 64, ... and, behind a 20-token request that takes
    20 tokens of the first step, at 0, 12, 44, ...: the same prompt log-probs, tokens and log-probs."""
    ids = inv.tokenizer.encode(" ".join(f"Item {i} is a {c} box." for i, c in
                                        enumerate(["red", "blue", "green", "small", "large"] * 3)))
    assert len(ids) > 3 * BUDGET
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    inv.reset_prefix_cache()
    alone = inv.generate([ids], [params])[0]
    inv.reset_prefix_cache()
    first = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    behind = inv.generate([ids[5:25], ids], [first, params])[1]
    assert result(alone) == result(behind), explain(result(alone), result(behind))
    assert alone.prompt_logprobs == behind.prompt_logprobs


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_rescored_as_a_prompt_equals_the_sampled_logprobs(inv, params):
    gen, scored = rescored(inv, TARGET_PROMPTS[1], params)
    assert gen[1] == scored, explain(gen, (gen[0], scored))


def test_sleep_cycles_keep_the_bits(inv):
    ids = inv.tokenizer.encode(TARGET_PROMPTS[0])
    params = [replace(GREEDY, max_tokens=4), replace(SEEDED, max_tokens=4)]

    def run():
        return [result(o) for o in inv.generate([ids, ids], params)]

    before = run()
    inv.sleep(level=1)
    inv.wake_up()
    assert run() == before
    inv.sleep(level=2)
    inv.wake_up()
    inv.update_weights()  # level 2 discarded the weights: reloaded from the checkpoint
    assert run() == before


def test_tensor_parallel_alone_and_among_others_bitwise(default_model_folder):
    """TP=2 over gloo: every rank built in the mode (the workers' ops, the rank-order sums), the same bits alone
    and among others."""
    llm = LLM(model=str(default_model_folder), tensor_parallel_size=2, batch_invariant=True, device="cpu",
              kv_cache_memory="64MiB", max_model_len=512)
    try:
        assert llm.engine.runner.model.tp.ordered_reduce is True
        pairs = alone_and_among(llm, 6, targets=[(TARGET_PROMPTS[1], replace(GREEDY, max_tokens=4))])
        assert pairs[0][0] == pairs[0][1], explain(*pairs[0])
    finally:
        llm.close()


def test_default_mode_is_unchanged(llm, monkeypatch):
    """Off unless asked: the plain ops (the fused sampler on CUDA), and VLLM_BATCH_INVARIANT=1 turns it on."""
    assert llm.engine.config.batch_invariant is False
    assert llm.engine.runner.model.ops is TorchOps and llm.engine.runner.batch_invariant is False
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert EngineConfig().batch_invariant is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig().batch_invariant is True
    assert EngineConfig(batch_invariant=False).batch_invariant is False  # an explicit choice wins


def test_a_combination_it_cannot_keep_fails_at_start_naming_the_flag():
    with pytest.raises(ValueError, match="--batch-invariant.*--tp-all-reduce symm"):
        EngineConfig(batch_invariant=True, tp_all_reduce="symm")
