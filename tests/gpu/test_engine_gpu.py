"""The engine on a GPU: graphs replay what eager computes, and survive sleep/wake unchanged."""
from __future__ import annotations

import pytest
import torch

from testkit.models import model_folder
from server import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]


def greedy(n: int = 32) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return model_folder("llama-tiny", tmp_path_factory.mktemp("models"))


def _run(llm: LLM) -> list[list[int]]:
    # Batch sizes equal to graph buckets (1, 2, 4): eager and graph then run the very same shapes.
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], greedy())]
    out += [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], greedy())]
    out += [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]
    return out


def test_graph_decode_matches_eager_and_survives_sleep(tiny):
    kw = dict(model=str(tiny), device="cuda", load_format="dummy", kv_cache_memory="256MiB", max_num_seqs=8)
    eager = LLM(enforce_eager=True, **kw)
    try:
        expected = _run(eager)
    finally:
        eager.close()
    llm = LLM(**kw)
    try:
        assert llm.engine.runner.graphs is not None
        assert llm.engine.pool.stats().as_dict()["tags"]["cuda_graph"]["bytes"] > 0
        assert _run(llm) == expected, "graph replay diverged from eager decode"
        for level in (1, 2):
            llm.sleep(level=level)
            llm.wake_up()
            if level == 2:
                assert not llm.engine.sleep_state.weights_valid
                llm.update_weights()  # dummy weights: the same seeded values again
            assert _run(llm) == expected, f"outputs changed after a level-{level} sleep"
    finally:
        llm.close()


def test_all_engine_memory_is_in_the_pool(tiny):
    llm = LLM(model=str(tiny), device="cuda", load_format="dummy", kv_cache_memory="256MiB", max_num_seqs=8)
    try:
        llm.generate(PROMPTS, greedy(8))
        pool = llm.engine.pool
        for name, p in llm.engine.model.named_parameters():
            assert pool.tag_of(p) == "weights", f"{name} is not in the pool"
        assert pool.tag_of(llm.engine.runner.kv_cache) == "kv_cache"
        pooled = sum(t.bytes for t in pool.stats().tags.values())
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
        llm.sleep(level=1)
        free_asleep = torch.cuda.mem_get_info()[0]
        tags = pool.stats().as_dict()["tags"]
        assert all(t["state"] != "awake" for name, t in tags.items() if t["bytes"]), tags
        # Every pooled byte was really given back to the device (the sleep returns once it is).
        assert free_asleep - free_awake >= 0.95 * pooled, (free_awake, free_asleep, pooled)
        llm.wake_up()
        assert torch.cuda.mem_get_info()[0] <= free_asleep - 0.95 * pooled  # and re-created on wake
    finally:
        llm.close()


def test_fused_model_matches_the_pytorch_ops(tiny):
    """The whole forward with the fused kernels and GEMMs against the plain-PyTorch reference ops; at one
    row, the small-batch matmuls chained by dependent launch with the rotary and attention (small_gemm.py)."""
    from tests.model.fused_cases import whole_model_error

    llm = LLM(model=str(tiny), device="cuda", load_format="dummy", kv_cache_memory="256MiB", enforce_eager=True)
    try:
        err = whole_model_error(llm)
        assert err < 2e-2, f"relative error {err:.2e}"
        err = whole_model_error(llm, prompt_len=1)
        assert err < 2e-2, f"one row: relative error {err:.2e}"
    finally:
        llm.close()
