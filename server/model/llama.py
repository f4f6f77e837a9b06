"""The Llama family (Llama / SmolLM2, Mistral, Qwen2, Qwen3, and with sparse MLPs Qwen3-MoE and Mixtral:
moe.py) in plain PyTorch over a flat token batch.

Module and parameter names mirror Hugging Face checkpoints, so loading and in-place weight updates
are a by-name copy. Parameters are created on the meta device and materialized by the loader inside
the memory pool (tag `weights`), so every byte of them is sleepable.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from server.model.attention import AttentionContext, attend
from server.model.config import ModelConfig
from server.model.moe import EXPERT_NAMES, SparseMoeBlock
from server.model.ops import TorchOps
from server.model.rope import cos_sin_table
from server.model.shard import TensorParallel


class RMSNorm(nn.Module):
    """Holds the weight; the arithmetic is the ops set's add_rmsnorm (fused on CUDA)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ops) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.add_rmsnorm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """With tensor parallelism, cfg is this rank's (its heads) and o_proj's partial sums are all-reduced."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv, bias = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, q, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=bias and cfg.model_type not in ("qwen2", "qwen2_moe"))
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5
        # Views of this layer's slice of the pooled KV cache, bound by the model runner.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # The q|k|v weights side by side (set by the loader; q_proj.weight etc. are views of it).
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    def fused_groups(self) -> dict[str, list[nn.Linear]]:
        return {"qkv": [self.q_proj, self.k_proj, self.v_proj]}

    def forward(self, qkv, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext, ops) -> torch.Tensor:
        """qkv: the projections ops.norm_qkv gives (under the batch-invariant mode on CUDA they may be ones its
        qkv_heads finishes) -> o_proj's output, for the norm after it to read (ops.linear_to_norm: likewise)."""
        q, k, v = ops.qkv_heads(self, qkv, cos, sin, ctx.slot_mapping)
        T, D = q.shape[0], self.head_dim
        if ops.batch_invariant:  # one per-token path for decodes and prefills alike (batch_invariant.py)
            out = ops.attend(q, k, v, self.k_cache, self.v_cache, ctx, self.scale)
        else:
            out = attend(q, k, v, self.k_cache, self.v_cache, ctx, self.scale, ops.decode_attention,
                         ops.prefill_attention)
        return self.tp.row_parallel_to_norm(self.o_proj, out.reshape(T, self.num_heads * D), ops)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_weight: torch.Tensor | None = None
        self.gate_up_bias: torch.Tensor | None = None

    def fused_groups(self) -> dict[str, list[nn.Linear]]:
        return {"gate_up": [self.gate_proj, self.up_proj]}

    def down(self, act: torch.Tensor, ops) -> torch.Tensor:
        """down_proj of the activation (ops.norm_gate_up_act computes it with the norm before), for the next norm
        to read (ops.linear_to_norm)."""
        return self.tp.row_parallel_to_norm(self.down_proj, act, ops)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, index: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg, tp)
        # A sparse layer's experts go under the checkpoint's module name (mlp, Mixtral's block_sparse_moe).
        self.moe_name: str | None = None
        if cfg.is_sparse_layer(index):
            self.moe_name = EXPERT_NAMES[cfg.model_type][0]
            self.add_module(self.moe_name, SparseMoeBlock(cfg, tp, index))
        else:
            self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext, ops) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream travels beside the hidden state, so each norm also does the add
        # before it (fused with the matmul after it on CUDA). Float addition commutes, so this is bit
        # for bit Hugging Face's `residual + hidden`.
        qkv, residual = ops.norm_qkv(self.self_attn, self.input_layernorm, x, residual)
        x = self.self_attn(qkv, cos, sin, ctx, ops)
        if self.moe_name is not None:
            h, residual = self.post_attention_layernorm(x, residual, ops)
            return self._modules[self.moe_name](h, ops), residual
        act, residual = ops.norm_gate_up_act(self.mlp, self.post_attention_layernorm, x, residual)
        return self.mlp.down(act, ops), residual


class VocabEmbedding(nn.Module):
    """The embedding; with tensor parallelism each rank holds tp.vocab_shard rows (its slice of the
    vocabulary), looks up the tokens in it and zeros the others, and one all-reduce sums the rows."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(tp.vocab_shard, cfg.hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        lo, hi = self.tp.vocab
        outside = (ids < lo) | (ids >= hi)
        x = F.embedding((ids - lo).masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """`tp`: this rank's tensor-parallel layout (server/model/shard.py); None for one device. `config`
    is then this rank's (its heads and MLP rows): the KV cache and the memory plan read it."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp = tp or TensorParallel(cfg)
        cfg = tp.config
        self.config = cfg
        self.max_positions = max_positions
        self.model = LlamaModel(cfg, tp)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, tp.vocab_shard, bias=False)
        # Derived from the config, not the checkpoint: init_buffers() refills them after a reload.
        self.register_buffer("rope_cos", torch.empty(max_positions, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_positions, cfg.head_dim), persistent=False)
        self.ops = TorchOps

    @torch.no_grad()
    def init_buffers(self) -> None:
        cos, sin = cos_sin_table(self.config, self.max_positions)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """[T] token ids and positions -> final hidden states [T, hidden] (normed)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, ctx, self.ops)
        return self.model.norm(x, residual, self.ops)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [T, vocab]. With `out` (a CUDA graph's static buffer, in the model's dtype) the
        same matmul writes there instead and `out` is returned (the sampler converts it where it needs to): one buffer
        serves every graph, where a fp32 output per graph would cost ~0.5 MB x batch x graphs."""
        if self.tp.enabled:  # each rank's vocabulary slice, gathered (in the model's dtype: half the bytes)
            w = self.output_weight()
            part = self.ops.lm_head(hidden, w, None) if self.ops.batch_invariant else F.linear(hidden, w)
            logits = self.tp.gather_vocab(part)
            return logits.float() if out is None else out.copy_(logits)
        logits = self.ops.lm_head(hidden, self.output_weight(), out)
        return logits if out is not None else logits.float()
