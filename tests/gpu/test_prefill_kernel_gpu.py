"""The compiled one-launch prefill kernel on the GPU against the PyTorch path (one SDPA per span),
bf16 and fp16 at model shapes, and the engine in fp32 with it against the engine without it."""
from __future__ import annotations

import random

import pytest
import torch

from testkit.kernel_cases import prefill_error, random_prefill_case

pytestmark = pytest.mark.gpu


def _spans(kind: str, seed: int) -> list[tuple[int, int]]:
    """(new tokens, cached prefix) per span: a step's prefills as the scheduler makes them."""
    rng = random.Random(seed)
    if kind == "admit-256":      # 256 short prompts admitted at once (bench/throughput.py's)
        return [(32, 0)] * 256
    if kind == "long-64":        # 64 prompts of ~512, some after a cached prefix
        return [(rng.randint(384, 640), rng.choice([0, 0, 16, 200])) for _ in range(64)]
    if kind == "chunked":        # one long prompt's later chunk, beside short prompts and one-token spans
        return [(2048, 1000), (1, 300), (1, 0), (17, 5)] + [(rng.randint(2, 300), 0) for _ in range(20)]
    raise ValueError(kind)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["admit-256", "long-64", "chunked"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (32, 8, 64, 16),    # the 1.24B Llama shape
    (32, 8, 128, 16),   # the 8B shape
    (28, 4, 128, 32),   # a group of 7 (Qwen2-7B), larger blocks
    (16, 16, 64, 16),   # no GQA
])
def test_kernel_matches_reference(dtype, kind, heads, kv_heads, head_dim, block_size):
    from server.model.prefill_kernel import triton_prefill_attention

    for seed in range(2):  # fresh inputs each time: the kernel must compute the function, not one case
        case = random_prefill_case(_spans(kind, seed), heads, kv_heads, head_dim, block_size, dtype, "cuda", seed)
        err = prefill_error(triton_prefill_attention, case, head_dim ** -0.5)
        assert err < 1e-2, f"relative error {err:.2e}"


def test_engine_fp32_same_tokens_with_and_without_the_kernel(tmp_path):
    """The fp32 engine on the GPU (every other fused kernel and the decode graphs in both runs): with the
    prefill kernel and with one SDPA per span, the same greedy tokens and prompt log-probs (chunked
    prefills, prefix-cached spans: testkit/kernel_cases.engine_prefill_check)."""
    from server import LLM
    from server.model.attention import prefill_spans_torch
    from server.model.fused_ops import TritonOps
    from testkit.kernel_cases import engine_prefill_check
    from testkit.models import model_folder

    class SpanBySpan(TritonOps):
        prefill_attention = staticmethod(prefill_spans_torch)

    llm = LLM(model=str(model_folder("llama-tiny", tmp_path)), device="cuda", dtype="float32", load_format="dummy",
              kv_cache_memory="256MiB", max_num_seqs=8, max_num_batched_tokens=40)
    try:
        assert llm.engine.model.ops is TritonOps
        engine_prefill_check(llm, SpanBySpan, TritonOps, 1e-3)
    finally:
        llm.close()
