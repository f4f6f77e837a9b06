"""--batch-invariant with mixture-of-experts models on the CPU (fp32, small random checkpoints of each family
made with transformers' classes): an expert's rows are the tokens the batch routed to it, so without the mode's
matmul in the router and the experts a token's bits follow the batch (4.8e-7 apart in log-prob among 12 others,
measured with the default sparse layer inside the mode). Alone vs among others of other lengths, greedy and
seeded, its prompt prefilled in chunks; the sampled log-probs re-scored as a prompt; the routed experts. CUDA:
the same checks in tests/gpu/test_batch_invariant_gpu.py."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from testkit.batch_invariance import GREEDY, SEEDED, TARGET_PROMPTS, alone_and_among, explain, rescored
from testkit.moe_models import FAMILIES, hf_model, save_checkpoint, write_checkpoint

from server import LLM
from server.model.moe import moe_torch

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


def tied_router_checkpoint(root: Path) -> Path:
    """A Qwen3-MoE checkpoint whose router rows come in pairs 1e-7 apart (relative): every token's top-2 is a
    pair whose order rests on the logits' last bits, so a router whose bits follow the batch reorders it."""
    model = hf_model("qwen3_moe")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p[1::2] = p[0::2] * (1 + 1e-7 * torch.randn_like(p[0::2]))
    return save_checkpoint(model, root / "tied-router")


def routed_alone_and_among(llm) -> tuple[np.ndarray, np.ndarray]:
    params = replace(GREEDY, return_routed_experts=True)
    ids = llm.tokenizer.encode(TARGET_PROMPTS[1])
    alone = llm.generate([ids], [params])[0].outputs[0].routed_experts
    others = [llm.tokenizer.encode(f"Another request, number {i}, " * (1 + i % 3)) for i in range(8)]
    among = llm.generate(others[:4] + [ids] + others[4:], [GREEDY] * 4 + [params] + [GREEDY] * 4)[4]
    return alone, among.outputs[0].routed_experts


def test_routed_experts_alone_and_among_others_equal(tmp_path, monkeypatch):
    """What a trainer replays: a request's routed experts (prompt and generated tokens) alone and in a batch,
    on a router whose top-2 is a near tie for every token. The control: the default sparse layer inside the
    mode (the router by the plain matmul) orders some of those ties otherwise in a batch."""
    args = dict(device="cpu", batch_invariant=True, kv_cache_memory="32MiB", max_model_len=512,
                enable_return_routed_experts=True)
    folder = tied_router_checkpoint(tmp_path)
    with LLM(model=str(folder), **args) as llm:
        alone, among = routed_alone_and_among(llm)
    assert alone is not None and np.array_equal(alone, among)
    from server.model.batch_invariant import BatchInvariantTorchOps

    monkeypatch.setattr(BatchInvariantTorchOps, "moe", staticmethod(moe_torch))
    with LLM(model=str(folder), **args) as llm:
        alone, among = routed_alone_and_among(llm)
    if np.array_equal(alone, among):
        pytest.skip("the default sparse layer gave these tokens the same routing alone and in the batch here: "
                    "the control shows nothing")


def test_tensor_parallel_alone_and_among_others_bitwise(tmp_path):
    """TP=2 over gloo, Qwen2-MoE (experts and the shared expert cut along their width, the router whole on every
    rank): the partial sums added in rank order, the same bits alone and among others."""
    folder = write_checkpoint("qwen2_moe", tmp_path)
    with LLM(model=str(folder), device="cpu", batch_invariant=True, tensor_parallel_size=2,
             kv_cache_memory="32MiB", max_model_len=512) as llm:
        assert llm.engine.runner.model.tp.ordered_reduce is True
        pairs = alone_and_among(llm, 6, targets=[(TARGET_PROMPTS[1], replace(GREEDY, max_tokens=4))])
        assert pairs[0][0] == pairs[0][1], explain(*pairs[0])
