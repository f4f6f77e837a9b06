"""The model's elementwise and attention building blocks, as a swappable set.

`TorchOps` is plain PyTorch: the CPU path and the reference the fused GPU kernels (fused_ops.py)
are tested against. On CUDA each of these is one Triton kernel instead of several PyTorch ones:
at batch 1 a decode step is dominated by the number of kernels, not by arithmetic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from server.model.attention import decode_attention_torch, write_kv
from server.model.rope import apply_rotary


class TorchOps:
    name = "torch"

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

    @staticmethod
    def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k by position; write k and v into the cache at their slots."""
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(k_cache, v_cache, k, v, slots)
        return q, k

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    decode_attention = staticmethod(decode_attention_torch)


def ops_for(device: torch.device):
    if device.type == "cuda":
        from server.model.fused_ops import TritonOps

        return TritonOps
    return TorchOps
