"""A Qwen3-MoE GGUF file (llama.cpp's `qwen3moe` layout, written from a random transformers model in the test:
testkit/moe_gguf.py) served through `--model x.gguf`: converted once, its experts' size read from the file
(transformers' reader leaves `expert_feed_forward_length` out and would keep the class default of 768), and
greedy tokens equal to transformers' own generate on the model the file was written from."""
from __future__ import annotations

import json

import pytest
import torch

from server import LLM, SamplingParams

pytestmark = pytest.mark.timeout(600)
NEW_TOKENS = 10


def _model():
    import transformers

    from testkit.moe_models import COMMON

    torch.manual_seed(3)
    # Every layer sparse (llama.cpp's qwen3moe has no dense layers); experts of 32, not the default 768.
    cfg = transformers.Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                      norm_topk_prob=True, mlp_only_layers=[], **COMMON)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.2)  # spread enough that routing and tokens vary
    return model.eval()


def test_a_qwen3_moe_gguf_file_serves_transformers_tokens(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from server.model.default_model import converted_folder
    from testkit.models import tokenizer_folder
    from testkit.moe_gguf import write_qwen3_moe_gguf
    from testkit.moe_models import PROMPTS, model_greedy

    tok = AutoTokenizer.from_pretrained(tokenizer_folder())  # the embedded model's, from the suite's cache
    monkeypatch.setenv("SLEEPSERVE_CACHE", str(tmp_path / "cache"))  # this file's conversion: its own cache
    model = _model()
    path = write_qwen3_moe_gguf(model, tmp_path / "tiny-qwen3-moe.gguf")
    expected = model_greedy(model, tok, PROMPTS, NEW_TOKENS)

    llm = LLM(model=str(path), device="cpu", kv_cache_memory="32MiB", max_model_len=512)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS))
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.engine.model.config.moe_layers == [0, 1, 2]
    finally:
        llm.close()
    config = json.loads((converted_folder(path) / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["moe_intermediate_size"] == 32
    assert config["num_local_experts"] == 8 and config["num_experts_per_tok"] == 2 and config["norm_topk_prob"] is True
