"""The few numbers of a Hugging Face config.json that the Llama family, and its mixture-of-experts
relatives (Qwen3-MoE, Mixtral), need."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")


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
    # Mixture of experts (0 experts: a dense model). A sparse layer's MLP is num_experts experts of
    # moe_intermediate_size each, of which a router picks num_experts_per_tok per token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False         # renormalize the top-k probabilities to sum to 1 (Mixtral always)
    decoder_sparse_step: int = 1         # Qwen3-MoE: every n-th layer is sparse ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which keep a dense MLP
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one more expert every token goes through, gated

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has experts (Hugging Face's Qwen3MoeDecoderLayer rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_sparse_layer(i)]

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
            window = (d.get("sliding_window") if d.get("use_sliding_window", model_type in ("mistral", "mixtral"))
                      else None)
            moe = _moe_fields(model_type, d)
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
                # Qwen2 always has q/k/v biases (Qwen2-MoE unless qkv_bias is off); the others say so in attention_bias.
                attention_bias=(model_type == "qwen2" or (model_type == "qwen2_moe" and bool(d.get("qkv_bias", True)))
                                or bool(d.get("attention_bias", False))),
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                mlp_bias=bool(d.get("mlp_bias", False)),
                sliding_window=int(window) if window else None,
                eos_token_ids=eos_ids,
                torch_dtype=d.get("torch_dtype") or d.get("dtype"),
                **moe,
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
        attention = h * (q + 2 * kv) + q * h + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        sparse = len(self.moe_layers)
        experts = self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h  # + the router
        if self.shared_expert_intermediate_size:  # its MLP and its gate
            experts += 3 * h * self.shared_expert_intermediate_size + h
        mlps = (self.num_layers - sparse) * 3 * h * i + sparse * experts
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * attention + mlps + h


def _moe_fields(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """The experts of a Qwen3-MoE or Mixtral config.json ({} for a dense model). Hugging Face writes the
    expert count as num_experts or num_local_experts depending on the version; Mixtral's experts are
    intermediate_size wide and every layer is sparse, its top-k always renormalized."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    if experts < 1:
        raise ModelConfigError(f"a {model_type} config.json needs num_experts (or num_local_experts) of at least 1")
    top_k = int(d.get("num_experts_per_tok") or 0)
    if not 1 <= top_k <= experts:
        raise ModelConfigError(f"num_experts_per_tok must be from 1 to num_experts ({experts}), got {top_k}")
    if model_type == "mixtral":
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(d["intermediate_size"]),
                    norm_topk_prob=True)
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(d["moe_intermediate_size"]),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                decoder_sparse_step=max(1, int(d.get("decoder_sparse_step") or 1)),
                mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
                shared_expert_intermediate_size=(int(d.get("shared_expert_intermediate_size") or 0)
                                                 if model_type == "qwen2_moe" else 0))
