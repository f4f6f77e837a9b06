"""bench/roofline.py's cost of a mixture-of-experts step (the rollout's roofline at the Qwen3-MoE shapes): a token
is multiplied by its k experts only, and a step reads the distinct experts uniform routing would pick, from
k/E of them for one token to all of them for an RL batch."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bench.roofline import ModelCost, StepShape
from server import LLM
from testkit.models import MOE_CONFIGS, moe_model_folder


@pytest.fixture(scope="module")
def moe_cost():
    folder = moe_model_folder("qwen3-moe-tiny", Path(tempfile.mkdtemp()), max_position_embeddings=512)
    llm = LLM(model=str(folder), device="cpu", load_format="dummy", kv_cache_memory="16MiB", max_model_len=256)
    try:
        params = dict(llm.engine.model.named_parameters())
        yield ModelCost.of(llm.engine.model), params
    finally:
        llm.close()


def test_a_token_is_multiplied_by_its_experts_only(moe_cost):
    cost, params = moe_cost
    shape = MOE_CONFIGS["qwen3-moe-tiny"]
    k, experts = shape["num_experts_per_tok"], shape["num_experts"]
    expert = [p for n, p in params.items() if ".experts." in n]
    assert (cost.experts, cost.top_k) == (experts, k) and len(expert) == 2 * shape["num_hidden_layers"]
    assert cost.expert_bytes == sum(p.numel() * p.element_size() for p in expert)
    layer = sum(p.numel() for n, p in params.items() if ".layers." in n)
    assert cost.matmul_params == round(layer - sum(p.numel() for p in expert) * (1 - k / experts))


def test_a_step_reads_the_experts_its_tokens_pick(moe_cost):
    cost, _ = moe_cost
    k_over_e = cost.top_k / cost.experts
    one = cost.step(StepShape.of([(0, 1)], sampled=1))[0] - cost.kv_bytes_per_token
    assert one == pytest.approx(cost.weight_bytes - cost.expert_bytes * (1 - k_over_e))
    batch = cost.step(StepShape.decode(256 * 64, 256))[0] - (256 * 64 + 256) * cost.kv_bytes_per_token
    assert batch == pytest.approx(cost.weight_bytes, rel=1e-9)  # 256 tokens: every expert, all but surely
    mid = cost.step(StepShape.decode(8 * 64, 8))[0] - (8 * 64 + 8) * cost.kv_bytes_per_token
    assert one < mid < batch
