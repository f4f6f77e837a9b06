"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert) on the PyTorch path: small random checkpoints made with
transformers' own classes give transformers' greedy tokens in process (through the server:
tests/http/test_http_moe.py); the experts are stacked per layer in the pool under `weights`; --load-format dummy
serves the shape."""
from __future__ import annotations

import pytest
import torch
from testkit.moe_models import FAMILIES, NEW_TOKENS, PROMPTS, hf_greedy, write_checkpoint

from server import LLM, SamplingParams
from server.model.config import ModelConfig, ModelConfigError
from server.model.loader import WeightLoadError, check_checkpoint, checkpoint_shapes, safetensors_files

pytestmark = pytest.mark.timeout(600)
ARGS = dict(device="cpu", kv_cache_memory="32MiB", max_model_len=512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {f: write_checkpoint(f, root) for f in FAMILIES}


@pytest.fixture(scope="module")
def references(checkpoints):
    return {f: hf_greedy(folder) for f, folder in checkpoints.items()}


@pytest.fixture(scope="module", params=FAMILIES)
def family_llm(request, checkpoints):
    llm = LLM(model=str(checkpoints[request.param]), **ARGS)
    yield request.param, llm
    llm.close()


def test_greedy_tokens_equal_transformers_in_process(family_llm, references):
    family, llm = family_llm
    outs = llm.generate(PROMPTS, GREEDY)  # batched: prompts of different lengths in one step
    assert [o.outputs[0].token_ids for o in outs] == references[family]
    alone = llm.generate(PROMPTS[1], GREEDY)[0]  # and alone: a decode batch of one
    assert alone.outputs[0].token_ids == references[family][1]


def test_experts_are_stacked_in_the_pool(family_llm):
    family, llm = family_llm
    model = llm.engine.model
    cfg = model.config
    params = dict(model.named_parameters())
    sparse = "block_sparse_moe" if family == "mixtral" else "mlp"
    w13 = params[f"model.layers.0.{sparse}.experts.w13_weight"]
    w2 = params[f"model.layers.0.{sparse}.experts.w2_weight"]
    assert w13.shape == (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert w2.shape == (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    assert params[f"model.layers.0.{sparse}.gate.weight"].shape == (cfg.num_experts, cfg.hidden_size)
    if family == "qwen3_moe":  # mlp_only_layers=[1]: a dense MLP there
        assert "model.layers.1.mlp.gate_proj.weight" in params and cfg.moe_layers == [0, 2]
    else:
        assert cfg.moe_layers == [0, 1, 2]
    if family == "qwen2_moe":  # the shared expert and its gate, gate|up side by side like a dense MLP's
        assert params["model.layers.0.mlp.shared_expert.gate_proj.weight"].shape == (48, cfg.hidden_size)
        assert params["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, cfg.hidden_size)
        assert cfg.attention_bias and "model.layers.0.self_attn.q_proj.bias" in params
    # Every parameter's bytes are pool memory under `weights` (what a sleep offloads or discards).
    total = sum(p.numel() * p.element_size() for p in params.values())
    assert llm.engine.pool.stats().tags["weights"].bytes >= total


def test_config_reads_the_families():
    qwen = ModelConfig.from_dict(dict(model_type="qwen3_moe", vocab_size=10, hidden_size=8, intermediate_size=16,
                                      num_hidden_layers=6, num_attention_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=4, decoder_sparse_step=2,
                                      mlp_only_layers=[3]))
    assert qwen.moe_layers == [1, 5] and qwen.qk_norm and qwen.num_experts == 4 and not qwen.norm_topk_prob
    mix = ModelConfig.from_dict(dict(model_type="mixtral", vocab_size=10, hidden_size=8, intermediate_size=16,
                                     num_hidden_layers=2, num_attention_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2))
    assert mix.moe_intermediate_size == 16 and mix.norm_topk_prob and mix.moe_layers == [0, 1]
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        ModelConfig.from_dict(dict(model_type="mixtral", vocab_size=10, hidden_size=8, intermediate_size=16,
                                   num_hidden_layers=2, num_attention_heads=2, num_local_experts=2,
                                   num_experts_per_tok=3))


def test_a_checkpoint_missing_an_expert_or_misshapen_is_refused_by_name(family_llm, checkpoints):
    family, llm = family_llm
    shapes = checkpoint_shapes(safetensors_files(checkpoints[family]))
    name = next(n for n in shapes if ".experts.3." in n)
    del shapes[name]
    with pytest.raises(WeightLoadError, match=name.replace(".", r"\.")):
        check_checkpoint(llm.engine.model, shapes, require_all=True)
    shapes[name] = ((5, 5), "F32")
    with pytest.raises(WeightLoadError, match=rf"{name.replace('.', chr(92) + '.')}: shape \[5, 5\]"):
        check_checkpoint(llm.engine.model, shapes, require_all=False)


def test_dummy_weights_serve_the_shape(checkpoints):
    llm = LLM(model=str(checkpoints["qwen3_moe"]), load_format="dummy", **ARGS)
    try:
        out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 4
        w13 = dict(llm.engine.model.named_parameters())["model.layers.0.mlp.experts.w13_weight"]
        assert 0.01 < w13.float().std().item() < 0.03  # drawn, not left as whatever the pool held
        # Reloading "the served checkpoint" of a dummy model draws the same weights again.
        before = w13.clone()
        llm.update_weights()
        assert torch.equal(before, w13)
    finally:
        llm.close()
