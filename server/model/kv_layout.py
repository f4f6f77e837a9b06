"""The paged KV cache's layout: block-major, one tensor for every layer.

    kv[num_blocks, layers, 2, block_size, kv_heads, head_dim]

A block's K and V of every layer are one contiguous run of bytes, so any range of blocks is one
contiguous range of the tensor's memory: a chunk of blocks that a wake maps separately is one pool
piece, i.e. one physical handle, whatever the number of layers. (Layer-major, a chunk was 2 x layers
handles, and a sleep's release time follows the number of handles: 397 for an 8B model on an H200,
76 ms in cuMemRelease.) Each layer attends through strided views kv[:, i, 0] (K) and kv[:, i, 1] (V),
[num_blocks, block_size, kv_heads, head_dim] whose block stride spans all layers; inside a block a
layer's tokens are still contiguous, so the kernels read the same tiles as before. Nothing may
assume the views are contiguous: writes go by (block, offset in block), never through a flat view.
"""
from __future__ import annotations

import torch
from torch import nn

from server.model.config import ModelConfig


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """cfg is the rank's (its own KV heads under tensor parallelism)."""
    return (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)


def layer_views(kv: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K and V, [num_blocks, block_size, kv_heads, head_dim] strided views (no copy)."""
    return kv[:, layer, 0], kv[:, layer, 1]


def attach(layers: nn.ModuleList, kv: torch.Tensor) -> None:
    """Bind each decoder layer's attention to its views of the cache."""
    for i, layer in enumerate(layers):
        layer.self_attn.k_cache, layer.self_attn.v_cache = layer_views(kv, i)


def check_kernel_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """What the attention and rotary kernels assume of a layer's views: K and V are read and written with K's
    strides (one block-major cache), and a token's head_dim values are contiguous."""
    if v_cache.stride() != k_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(f"K and V caches need the same strides, head_dim contiguous: "
                         f"{k_cache.stride()} and {v_cache.stride()}")
