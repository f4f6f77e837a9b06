"""Model folders for benchmarks and GPU tests: real configs of common sizes with random weights
(--load-format dummy), beside a small tokenizer. Nothing is downloaded."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}

CONFIGS: dict[str, dict] = {
    # Llama-3.2-1B's shape: 1.24 B parameters with tied embeddings.
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    # Llama-3.1-8B's shape: 8.03 B parameters.
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    # A small model for fast GPU tests.
    "llama-tiny": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
    # Almost no model: for measuring the host work around a step on CPU (bench/step_host_cost.py); a 1k
    # vocabulary (ids the tokenizer knows) keeps the sampler's tensor ops small.
    "llama-micro": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32, vocab_size=1024, tie_word_embeddings=True),
}

# Mixture-of-experts shapes (Qwen3-MoE). Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active per token (61 GB in bf16).
MOE_CONFIGS: dict[str, dict] = {
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
                          rope_theta=1000000.0, rms_norm_eps=1e-6),
    # The same kind of layer, small: fast GPU tests and bench/moe.py --small.
    "qwen3-moe-tiny": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=49152,
                           num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, tie_word_embeddings=False,
                           rope_theta=1000000.0, rms_norm_eps=1e-6),
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def tokenizer_folder() -> Path:
    """A folder with a tokenizer: $SLEEPSERVE_TOKENIZER_DIR (the GPU runs carry one), else the
    converted embedded default model."""
    env = os.environ.get("SLEEPSERVE_TOKENIZER_DIR")
    if env:
        return Path(env)
    from server.model.source import resolve_model

    return resolve_model(None).folder


def model_folder(name: str, root: Path, max_position_embeddings: int = 131072) -> Path:
    """Write config.json (Llama architecture, bf16) plus the tokenizer files into root/name."""
    out = Path(root) / name
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "max_position_embeddings": max_position_embeddings, "bos_token_id": 1,
           "eos_token_id": 2, "torch_dtype": "bfloat16", "rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0,
           "attention_bias": False, "mlp_bias": False, **CONFIGS[name]}
    return _write_folder(out, cfg)


def _write_folder(out: Path, cfg: dict) -> Path:
    """config.json and the tokenizer's files: a model folder whose weights come from --load-format dummy."""
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return copy_tokenizer(out)


def copy_tokenizer(out: Path) -> Path:
    """The tokenizer's files (tokenizer_folder's) into the model folder `out`."""
    src = tokenizer_folder()
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    return out


def moe_model_folder(name: str, root: Path, max_position_embeddings: int = 40960) -> Path:
    """config.json of a Qwen3-MoE shape (bf16; weights come from --load-format dummy) plus the tokenizer files."""
    out = Path(root) / name
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_act": "silu",
           "max_position_embeddings": max_position_embeddings, "bos_token_id": 1, "eos_token_id": 2,
           "torch_dtype": "bfloat16", "attention_bias": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
           **MOE_CONFIGS[name]}
    return _write_folder(out, cfg)


def shape_folder(name: str, root: Path, max_position_embeddings: int = 131072) -> Path:
    """The folder of any named shape: a Qwen3-MoE one (MOE_CONFIGS) or a Llama one (CONFIGS). 131072 positions
    by default, the Llama shapes' (the benchmarks' contexts are far shorter; the real 30B-A3B has 40960)."""
    make = moe_model_folder if name in MOE_CONFIGS else model_folder
    return make(name, root, max_position_embeddings=max_position_embeddings)


def parameter_count(name: str) -> int:
    from server.model.config import ModelConfig

    return ModelConfig.from_dict({"model_type": "llama", **CONFIGS[name]}).num_parameters()


def write_trained_checkpoint(source: Path, out: Path, seed: int) -> Path:
    """A copy of the checkpoint in `source` after a pretend training step (every matrix moves by 2% of its
    spread, seeded), beside the same config and tokenizer: new weights to load with /update_weights."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    weights = load_file(str(source / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in weights.items():
        if t.dim() == 2:
            weights[name] = t + 0.02 * t.std() * torch.randn(t.shape, generator=g)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
