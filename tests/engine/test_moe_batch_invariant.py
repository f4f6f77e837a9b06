"""--batch-invariant with mixture-of-experts models on the CPU (fp32, small random checkpoints of each family
made with transformers' classes): an expert's rows are the tokens the batch routed to it, so without the mode's
matmul in the router and the experts a token's bits follow the batch (4.8e-7 apart in log-prob among 12 others,
measured with the default sparse layer inside the mode). Alone vs among others of other lengths, greedy and
seeded, its prompt prefilled in chunks; the sampled log-probs re-scored as a prompt; the routed experts. CUDA:
the same checks in tests/gpu/test_batch_invariant_gpu.py."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from testkit.batch_invariance import GREEDY, SEEDED, TARGET_PROMPTS, alone_and_among, explain, rescored
from testkit.moe_models import FAMILIES, write_checkpoint

from server import LLM

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", params=FAMILIES)
def inv(request, tmp_path_factory):
    folder = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    # 16 tokens a step: the others' prompts and the targets' are prefilled in chunks, beside decodes.
    with LLM(model=str(folder), device="cpu", batch_invariant=True, max_num_batched_tokens=16,
             kv_cache_memory="32MiB", max_model_len=512, enable_return_routed_experts=True) as llm:
        yield llm


def test_alone_and_among_others_bitwise(inv):
    assert inv.engine.runner.model.ops.batch_invariant is True
    targets = [(TARGET_PROMPTS[1], GREEDY), (TARGET_PROMPTS[0], SEEDED)]
    for (alone, among), (prompt, params) in zip(alone_and_among(inv, 12, targets=targets), targets):
        assert alone == among, f"{prompt[:20]!r} at temperature {params.temperature}: {explain(alone, among)}"


def test_rescored_as_a_prompt_equals_the_sampled_logprobs(inv):
    gen, scored = rescored(inv, TARGET_PROMPTS[0], GREEDY)
    assert gen[1] == scored, explain(gen, (gen[0], scored))


def test_routed_experts_alone_and_among_others_equal(inv):
    """What a trainer replays: a request's routed experts (prompt and generated tokens) alone and in a batch."""
    params = replace(GREEDY, return_routed_experts=True)
    ids = inv.tokenizer.encode(TARGET_PROMPTS[1])
    alone = inv.generate([ids], [params])[0].outputs[0].routed_experts
    others = [inv.tokenizer.encode(f"Another request, number {i}, " * (1 + i % 3)) for i in range(8)]
    among = inv.generate(others[:4] + [ids] + others[4:], [GREEDY] * 4 + [params] + [GREEDY] * 4)[4]
    assert alone is not None and np.array_equal(alone, among.outputs[0].routed_experts)


def test_tensor_parallel_alone_and_among_others_bitwise(tmp_path):
    """TP=2 over gloo, Qwen2-MoE (experts and the shared expert cut along their width, the router whole on every
    rank): the partial sums added in rank order, the same bits alone and among others."""
    folder = write_checkpoint("qwen2_moe", tmp_path)
    with LLM(model=str(folder), device="cpu", batch_invariant=True, tensor_parallel_size=2,
             kv_cache_memory="32MiB", max_model_len=512) as llm:
        assert llm.engine.runner.model.tp.ordered_reduce is True
        pairs = alone_and_among(llm, 6, targets=[(TARGET_PROMPTS[1], replace(GREEDY, max_tokens=4))])
        assert pairs[0][0] == pairs[0][1], explain(*pairs[0])
