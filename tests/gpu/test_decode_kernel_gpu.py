"""The compiled Triton kernel on the GPU against the PyTorch reference, bf16 and fp16, at model shapes."""
from __future__ import annotations

import pytest
import torch

from testkit.kernel_cases import random_case, relative_error, split_decode

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, block_size, max_len", [
    (1, 32, 8, 64, 16, 1),
    (7, 32, 8, 64, 16, 517),
    (64, 32, 8, 64, 16, 300),
    (16, 32, 8, 128, 16, 2049),
    (8, 28, 4, 128, 32, 1000),
    (3, 9, 3, 64, 16, 4095),
])
def test_kernel_matches_reference(dtype, batch, heads, kv_heads, head_dim, block_size, max_len):
    from server.model.decode_kernel import SPLIT_COUNTS, triton_decode_attention

    counts = torch.zeros(SPLIT_COUNTS, dtype=torch.int32, device="cuda")
    for seed in range(3):  # fresh inputs each time: the kernel must compute the function, not one case
        case = random_case(batch, heads, kv_heads, head_dim, block_size, max_len, dtype, "cuda", seed)
        err = relative_error(triton_decode_attention, case, head_dim ** -0.5)
        assert err < 1e-2, f"relative error {err:.2e}"
        # As the engine launches it: a small batch's contexts split over programs, combined by the last.
        err = relative_error(split_decode(counts), case, head_dim ** -0.5)
        assert err < 1e-2, f"split: relative error {err:.2e}"


def test_engine_long_context_at_batch_one_through_graphs_and_a_sleep(tmp_path):
    """At batch 1 the decode graphs split a 400-token context over programs (decode_kernel.decode_splits), their
    counts kept in the pool's CUDA_GRAPH memory: each greedy token's log-prob must be what scoring the same
    tokens as a prompt gives (the prefill kernel: close, not bit-equal), before and after a level-1 sleep."""
    from server import LLM, SamplingParams
    from testkit.models import model_folder

    llm = LLM(model=str(model_folder("llama-tiny", tmp_path)), device="cuda", load_format="dummy",
              kv_cache_memory="256MiB", max_num_seqs=8)
    try:
        prompt = [100 + (7 * i) % 900 for i in range(400)]
        for cycle in range(2):
            out, = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0))
            ids, lps = out.outputs[0].token_ids, out.outputs[0].logprobs
            scored, = llm.generate([prompt + ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
            for j, tok in enumerate(ids):
                assert abs(lps[j][tok].logprob - scored.prompt_logprobs[len(prompt) + j][tok].logprob) < 0.1, (cycle, j)
            llm.sleep(level=1)
            llm.wake_up()
    finally:
        llm.close()
