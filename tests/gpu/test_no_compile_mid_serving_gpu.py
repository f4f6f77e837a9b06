"""No Triton kernel compiles after start-up, whatever the batches look like.

Triton compiles one variant of a kernel per specialisation of its arguments: an integer's being 1 or
divisible by 16, a pointer's 16-byte alignment. A compile takes ~0.5-1 s with the engine's one thread
stalled, so a variant first met mid-serving stalls every stream (seen on the H200: 256 streamed requests
at once compiled decode attention during admission, and the first tokens took 0.97 s instead of 0.16).
The start-up (memory profile, graph capture) must meet every variant serving can need: this test serves
batches of every parity, mixed prefill + decode steps and eager decodes, and counts the variants; with
--batch-invariant too, whose start-up compiles its matmul's tiles and their split sums (with the norm and with
rotary after them) by warm-up.
"""
from __future__ import annotations

import pytest
import triton

from server import LLM, SamplingParams
from server.engine import fused_sample
from server.model import batch_invariant_kernels, decode_kernel, fused_ops, prefill_kernel, small_gemm
from testkit.models import model_folder

pytestmark = pytest.mark.gpu


def compiled_variants() -> dict[str, int]:
    """How many variants of each of our Triton kernels are compiled, every device together."""
    kernels = {name: fn for module in (decode_kernel, fused_ops, prefill_kernel, small_gemm, fused_sample,
                                       batch_invariant_kernels)
               for name, fn in vars(module).items() if isinstance(fn, triton.runtime.JITFunction)}
    assert len(kernels) >= 5, f"found only {sorted(kernels)}"
    return {name: sum(len(cache[0]) for cache in fn.device_caches.values()) for name, fn in kernels.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return model_folder("llama-tiny", tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_serving_compiles_nothing_new(tiny, batch_invariant):
    # 7 sequences at most: an odd largest graph, whose staging must still give aligned segments; a small
    # token budget splits long prompts into chunks that share steps with decodes (mixed, eager steps).
    llm = LLM(model=str(tiny), device="cuda", load_format="dummy", kv_cache_memory="256MiB", max_num_seqs=7,
              max_num_batched_tokens=64, batch_invariant=batch_invariant)
    try:
        assert llm.engine.runner.graphs is not None
        at_start = compiled_variants()
        words = "one two three four five six seven eight nine ten eleven twelve".split()
        for batch in range(1, 10):
            prompts = [" ".join(words[:1 + (batch * 5 + i * 7) % 12] * (1 + i % 9)) for i in range(batch)]
            # Greedy; sampled, with log-probs in odd batches (the fused sampler) and without in even ones;
            # greedy with log-probs (the fused sampler's greedy rows).
            params = [SamplingParams(temperature=(0.0, 1.0, 0.0)[i % 3], max_tokens=3 + (i * 11) % 40, ignore_eos=True,
                                     logprobs=0 if i % 3 == 2 or (i % 3 == 1 and batch % 2) else None,
                                     prompt_logprobs=1 if i == 2 else None)
                      for i in range(batch)]
            outs = llm.generate(prompts, params)
            assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
        grew = {k: (at_start[k], n) for k, n in compiled_variants().items() if n != at_start[k]}
        assert not grew, f"kernels compiled after start-up (variants at start, after): {grew}"
    finally:
        llm.close()


@pytest.mark.parametrize("max_model_len,block_size", [(16, 16), (24, 16), (128, 128)])
def test_start_up_warm_up_fits_a_short_context_on_the_device(tiny, max_model_len, block_size):
    """The start-up's warm-up step (two blocks of prefill over NULL_BLOCK, eager, Triton's prefill kernel) stays
    inside the rotary tables and the block table of a context shorter than two blocks, with CUDA graphs
    captured after it, and the engine then serves (tests/engine/test_step_layout.py checks the same on the CPU)."""
    llm = LLM(model=str(tiny), device="cuda", load_format="dummy", kv_cache_memory="64MiB",
              max_model_len=max_model_len, block_size=block_size, max_num_seqs=4)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.close()
