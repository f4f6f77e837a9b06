"""Small random mixture-of-experts checkpoints (Qwen3-MoE, Mixtral), made with transformers' own classes in
fp32 beside the embedded model's tokenizer, and transformers' greedy tokens for them. Nothing is downloaded."""
from __future__ import annotations

from pathlib import Path

import torch

from testkit.models import copy_tokenizer

FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW_TOKENS = 12


def hf_model(family: str, seed: int = 0):
    """A transformers model of the family with weights of a spread that makes routing and tokens vary
    (the default init of 0.02 routes nearly uniformly). Qwen3-MoE: 8 experts, top-2, renormalized, its
    middle layer dense (mlp_only_layers), so both kinds of layer are served."""
    import transformers

    torch.manual_seed(seed)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                          norm_topk_prob=True, mlp_only_layers=[1], **COMMON)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif family == "qwen2_moe":  # with its shared expert and q/k/v biases
        cfg = transformers.Qwen2MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48, **COMMON)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **COMMON)
        model = transformers.MixtralForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.2)
    return model.eval()


def write_checkpoint(family: str, root: Path, seed: int = 0) -> Path:
    return save_checkpoint(hf_model(family, seed), Path(root) / f"{family}-{seed}")


def save_checkpoint(model, out: Path) -> Path:
    """A transformers model's folder: its weights and config, and the embedded model's tokenizer files."""
    model.save_pretrained(out)
    return copy_tokenizer(out)


def hf_greedy(folder: Path, prompts: list[str] = PROMPTS, n: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' own generate, greedy, n new tokens for each prompt (alone: no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model_greedy(model, tok, prompts, n)


def model_greedy(model, tok, prompts: list[str] = PROMPTS, n: int = NEW_TOKENS) -> list[list[int]]:
    """A transformers model's own generate, greedy, n new tokens for each prompt (alone: no padding)."""
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            refs.append(out[0, ids.shape[1]:].tolist())
    return refs


def hf_routed(model, token_ids: list[int]):
    """transformers' own top-k experts for every token but the last: [tokens, sparse layers, k] (numpy)."""
    import numpy as np

    with torch.no_grad():
        out = model(torch.tensor([token_ids[:-1]]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return np.stack([torch.topk(logits.float(), k, dim=-1).indices.numpy() for logits in out.router_logits], axis=1)
