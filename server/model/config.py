"""The few numbers of a Hugging Face config.json that the Llama-family model needs."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class ModelConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    mlp_bias: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported; sleepserve serves {', '.join(SUPPORTED_MODEL_TYPES)}")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            # transformers 5 moved rope_theta and rope_scaling into rope_parameters.
            rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
            theta = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
            rope_type = rope.get("rope_type") or rope.get("type") or "default"
            scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            window = d.get("sliding_window") if d.get("use_sliding_window", model_type == "mistral") else None
            return cls(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; the others say so in attention_bias.
                attention_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
                qk_norm=model_type == "qwen3",
                mlp_bias=bool(d.get("mlp_bias", False)),
                sliding_window=int(window) if window else None,
                eos_token_ids=eos_ids,
                torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            )
        except KeyError as e:
            raise ModelConfigError(f"config.json lacks {e.args[0]!r}, which a Llama-family model needs") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{folder} has no config.json; pass a Hugging Face model folder or a .gguf file")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from None

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + h
