"""The fused MoE kernels (server/model/fused_moe.py) on the GPU: against the PyTorch reference at small and at
Qwen3-30B-A3B's layer shape, replayed from a CUDA graph, and inside the engine (graphs equal eager decode, through
sleep levels; routed experts the same from graphs as from eager steps)."""
from __future__ import annotations

import pytest
import torch

from server import LLM, SamplingParams
from testkit.models import moe_model_folder
from tests.model.moe_cases import (
    check_align,
    check_fused_moe,
    check_moe_invariant,
    check_moe_layer,
    moe_inputs,
)

pytestmark = pytest.mark.gpu

A3B = (2048, 768, 128, 8)  # hidden, expert width, experts, top-k


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 1e-2), (torch.bfloat16, 3e-2)])
def test_fused_moe_matches_the_reference(dtype, tol):
    check_align("cuda")
    check_fused_moe(dtype, "cuda", tol)
    check_moe_layer(dtype, "cuda", tol)
    H, I, E, K = A3B
    shapes = [(T, E, K, H, I, True) for T in (1, 7, 64, 256, 1000)]  # decode tiles to prefill tiles
    print(check_fused_moe(dtype, "cuda", tol, shapes=shapes))
    # the whole layer (the one-program route+align up to 8 tokens, the separate kernels above)
    print(check_moe_layer(dtype, "cuda", tol, shapes=[(T, E, K, H, I, True, True) for T in (1, 8, 9, 256)]))
    print(check_moe_invariant(dtype, "cuda", tol))  # --batch-invariant's layer: a token's row alone = in a batch


@pytest.mark.parametrize("T", [4, 64])  # the one-program route+align, and the separate kernels
def test_a_cuda_graph_replays_the_eager_layer(T):
    from types import SimpleNamespace

    from server.model.fused_moe import moe

    H, I, E, K = A3B
    x, gate, w13, w2 = moe_inputs(T, E, K, H, I, torch.bfloat16, "cuda")
    static_x = x.clone()
    layer = SimpleNamespace(gate=SimpleNamespace(weight=gate), experts=SimpleNamespace(w13_weight=w13, w2_weight=w2),
                            top_k=K, norm_topk_prob=True, round_weights=True,
                            routed=torch.zeros((T, K), dtype=torch.int32, device="cuda"))
    expected = moe(static_x, layer)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe(static_x, layer)  # warm-up off the default stream, as graph capture wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(static_x, layer)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    other, _, _, _ = moe_inputs(T, E, K, H, I, torch.bfloat16, "cuda", seed=5)
    static_x.copy_(other)
    graph.replay()
    torch.cuda.synchronize()
    captured_ids = layer.routed.clone()
    assert torch.equal(out, moe(static_x, layer)), "the graph did not route the new inputs as eager does"
    assert torch.equal(captured_ids, layer.routed), "the graph recorded other routed experts than eager"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return moe_model_folder("qwen3-moe-tiny", tmp_path_factory.mktemp("moe"))


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _run(llm: LLM):
    outs = []
    for n in (1, 2, 4):  # graph buckets: eager and graph run the very same shapes
        outs += llm.generate(PROMPTS[:n], GREEDY)
    for o in outs:  # every token but the last sampled one, 4 sparse layers, top-4
        assert o.outputs[0].routed_experts.shape == (len(o.prompt_token_ids) + GREEDY.max_tokens - 1, 4, 4)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].routed_experts for o in outs]


def test_engine_graphs_match_eager_and_survive_sleep(tiny):
    kw = dict(model=str(tiny), device="cuda", load_format="dummy", kv_cache_memory="256MiB", max_num_seqs=8,
              enable_return_routed_experts=True)
    with LLM(enforce_eager=True, **kw) as eager:
        tokens, routed = _run(eager)
    with LLM(**kw) as llm:
        assert llm.engine.runner.graphs is not None
        got_tokens, got_routed = _run(llm)
        assert got_tokens == tokens, "graph replay diverged from eager decode"
        assert all((a == b).all() for a, b in zip(got_routed, routed)), "routed experts differ under graphs"
        for level in (1, 2):
            llm.sleep(level=level)
            llm.wake_up()
            if level == 2:
                llm.update_weights()  # dummy weights: the same seeded values again
            assert _run(llm)[0] == tokens, f"outputs changed after a level-{level} sleep"


def test_serving_a_moe_model_compiles_nothing_new(tiny):
    """Every variant of the MoE kernels serving needs is compiled at start-up (the memory profile's long prefill,
    the graph capture): batches of every size up to past the one-program path, odd and even, prompts split into
    chunks that share steps with decodes. (tests/gpu/test_no_compile_mid_serving_gpu.py, for a dense model.)"""
    import triton

    from server.model import fused_moe

    def variants() -> dict[str, int]:
        kernels = {n: f for n, f in vars(fused_moe).items() if isinstance(f, triton.runtime.JITFunction)}
        return {n: sum(len(c[0]) for c in f.device_caches.values()) for n, f in kernels.items()}

    with LLM(model=str(tiny), device="cuda", load_format="dummy", kv_cache_memory="256MiB", max_num_seqs=12,
             max_num_batched_tokens=96, enable_return_routed_experts=True) as llm:
        at_start = variants()
        words = "one two three four five six seven eight nine ten eleven twelve".split()
        for batch in (1, 3, 8, 9, 12):
            prompts = [" ".join(words[:1 + (batch * 5 + i * 7) % 12] * (1 + i % 9)) for i in range(batch)]
            params = [SamplingParams(temperature=0.0, max_tokens=3 + (i * 11) % 30, ignore_eos=True,
                                     return_routed_experts=i % 2 == 0) for i in range(batch)]
            llm.generate(prompts, params)
        grew = {k: (at_start[k], n) for k, n in variants().items() if n != at_start[k]}
        assert not grew, f"MoE kernels compiled after start-up (variants at start, after): {grew}"
