"""The model's elementwise and attention building blocks, as a swappable set.

`TorchOps` is plain PyTorch: the CPU path and the reference the fused GPU kernels (fused_ops.py)
are tested against. On CUDA each of these is one Triton kernel instead of several PyTorch ones:
at batch 1 a decode step is dominated by the number of kernels, not by arithmetic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from server.model.attention import decode_attention_torch, prefill_spans_torch, write_kv
from server.model.moe import moe_torch
from server.model.rope import apply_rotary


class TorchOps:
    name = "torch"
    # Whether every reduction's order is fixed independently of the batch (batch_invariant.py's ops).
    batch_invariant = False

    @staticmethod
    def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual' = x + residual (or x); returns (rmsnorm(residual') * weight, residual').
        The same arithmetic as Hugging Face's layer: the sum is rounded to the model dtype first."""
        if residual is not None:
            x = x + residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype), x

    @classmethod
    def rope_and_cache(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       norms=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H, D] and k [T, KVH, D] by position; write k and v into the cache at their slots.
        norms: (q_norm, k_norm), Qwen3's RMSNorm of each head, applied first (each head a row of add_rmsnorm)."""
        if norms is not None:
            T, D = q.shape[0], q.shape[2]
            q, k = ((cls.add_rmsnorm(t.reshape(-1, D), None, norm.weight, norm.eps)[0].view(T, -1, D))
                    for t, norm in zip((q, k), norms))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(k_cache, v_cache, k, v, slots)
        return q, k

    @staticmethod
    def qkv(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three projections as Hugging Face computes them (three GEMMs)."""
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)

    @staticmethod
    def gate_up_act(mlp, x: torch.Tensor) -> torch.Tensor:
        """silu(gate_proj(x)) * up_proj(x)."""
        return F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)

    @staticmethod
    def norm_qkv(attn, norm, x: torch.Tensor, residual: torch.Tensor | None):
        """The layer's input norm, then q|k|v: (the projections, for this set's qkv_heads; the residual stream)."""
        return norm_then_qkv(TorchOps, attn, norm, x, residual)

    @classmethod
    def qkv_heads(cls, attn, qkv, cos: torch.Tensor, sin: torch.Tensor,
                  slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """norm_qkv's projections -> q [T, H, D], k and v [T, KVH, D]: q and k rotated (Qwen3's heads normed
        first), k and v written to the layer's cache at their slots."""
        return heads_then_rope(cls, attn, qkv, cos, sin, slots)

    @staticmethod
    def norm_gate_up_act(mlp, norm, x: torch.Tensor, residual: torch.Tensor):
        """The post-attention norm, then silu(gate) * up: (the activation, the residual stream)."""
        return norm_then_gate_up_act(TorchOps, mlp, norm, x, residual)

    @staticmethod
    def linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """o_proj and down_proj on one device."""
        return module(x)

    # o_proj's and down_proj's output on one device where the next thing to read it is the next norm (add_rmsnorm):
    # an ops set may hand the norm something it finishes itself (BatchInvariantTritonOps: the split sums).
    linear_to_norm = linear

    # x @ weight.T for the weights outside a layer's projections: a router, a shared expert's down and gate.
    project = staticmethod(F.linear)
    sigmoid = staticmethod(torch.sigmoid)  # a shared expert's gate

    @staticmethod
    def lm_head(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Logits in the model's dtype, written to `out` when given."""
        return torch.mm(hidden, weight.t(), out=out)

    @staticmethod
    def silu_mul_packed(gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] holding gate | up -> silu(gate) * up, [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    decode_attention = staticmethod(decode_attention_torch)
    prefill_attention = staticmethod(prefill_spans_torch)  # one SDPA per span (attention.attend's prefill_fn)
    # A sparse layer (moe.py): the router's top-k, then the experts' weighted sum.
    moe = staticmethod(moe_torch)


def norm_then_qkv(ops, attn, norm, x: torch.Tensor, residual: torch.Tensor | None):
    """norm_qkv as two steps of an ops set: its add_rmsnorm, then its qkv ((q, k, v), the residual stream)."""
    h, residual = norm(x, residual, ops)
    return ops.qkv(attn, h), residual


def split_qkv(attn, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q|k|v matmul's output [T, (H + 2 KVH) x D] as its q, k and v columns (views)."""
    q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    return out[:, :q], out[:, q:q + kv], out[:, q + kv:]


def heads_then_rope(ops, attn, qkv, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor):
    """qkv_heads as the three projections ([T, heads x D] each) viewed as heads, then the ops set's rope_and_cache."""
    T, D = qkv[0].shape[0], attn.head_dim
    q, k, v = (t.view(T, -1, D) for t in qkv)
    norms = None if attn.q_norm is None else (attn.q_norm, attn.k_norm)  # Qwen3's, before the rotation
    q, k = ops.rope_and_cache(q, k, v, cos, sin, attn.k_cache, attn.v_cache, slots, norms)
    return q, k, v


def norm_then_gate_up_act(ops, mlp, norm, x: torch.Tensor, residual: torch.Tensor):
    """norm_gate_up_act as two steps of an ops set: its add_rmsnorm, then its gate_up_act."""
    h, residual = norm(x, residual, ops)
    return ops.gate_up_act(mlp, h), residual

