"""Attention over a paged KV cache.

The batch is flat: T new tokens from many sequences. The first `num_decode_tokens` are decodes
(one token per sequence, read back through block tables); the rest are prefill spans (a prompt or
a chunk of it, possibly after a cached prefix). The plain-PyTorch functions here are the reference
and the CPU path; on CUDA a fused kernel replaces the decode part (see decode_kernel.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    q_start: int            # offset of the span's first token in the flat batch
    q_len: int              # new tokens in this step
    context_len: int        # cached prefix + new tokens
    block_table: torch.Tensor  # [num_blocks] int32 on the device


@dataclass
class AttentionContext:
    slot_mapping: torch.Tensor          # [T] int64: the cache slot each new token's K/V goes to
    num_decode_tokens: int
    block_tables: torch.Tensor          # [num_decode, max_blocks] int32
    context_lens: torch.Tensor          # [num_decode] int32
    max_decode_context: int | None      # a bound on context_lens, None inside CUDA graphs
    prefills: list[PrefillSpan] = field(default_factory=list)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V [T, kv_heads, D] into caches [blocks, block_size, kv_heads, D]. The caches are
    strided views of the block-major cache (kv_layout.py), so a slot is addressed as (block, offset
    in block): no flat view of them exists."""
    block_size = k_cache.shape[1]
    where = (slot_mapping // block_size, slot_mapping % block_size)
    k_cache.index_put_(where, k)
    v_cache.index_put_(where, v)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_blocks * block_size, kv_heads, D]."""
    g = cache[block_table.long()]
    return g.flatten(-4, -3)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           max_context: int | None = None) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]; each row attends to its first context_lens[b] cached tokens."""
    block_size = k_cache.shape[1]
    if max_context is not None:
        block_tables = block_tables[:, : -(-max_context // block_size)]
    k = gather_blocks(k_cache, block_tables).transpose(1, 2)  # [B, KVH, S, D]
    v = gather_blocks(v_cache, block_tables).transpose(1, 2)
    keys = torch.arange(k.shape[2], device=q.device)
    mask = keys[None, :] < context_lens[:, None]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


def prefill_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, span: PrefillSpan, scale: float) -> torch.Tensor:
    """Causal attention of one span's queries [L, H, D] over its prefix and itself."""
    L, ctx = span.q_len, span.context_len
    qs = q[span.q_start: span.q_start + L].transpose(0, 1)
    if ctx == L:  # nothing cached: the new keys are the whole context
        ks = k[span.q_start: span.q_start + L].transpose(0, 1)
        vs = v[span.q_start: span.q_start + L].transpose(0, 1)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    else:
        block_size = k_cache.shape[1]
        blocks = span.block_table[: -(-ctx // block_size)]
        ks = gather_blocks(k_cache, blocks)[:ctx].transpose(0, 1)
        vs = gather_blocks(v_cache, blocks)[:ctx].transpose(0, 1)
        # Query i sits at position ctx - L + i and sees keys 0..that position (lower-right causal).
        rows = torch.arange(L, device=q.device)[:, None] + (ctx - L)
        mask = torch.arange(ctx, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           ctx: AttentionContext, scale: float,
           decode_fn: Callable[..., torch.Tensor] = decode_attention_torch) -> torch.Tensor:
    """Attention of the flat batch, once the new K/V are in the cache. q [T, H, D] -> [T, H, D]."""
    nd = ctx.num_decode_tokens
    if not ctx.prefills:
        return decode_fn(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale, ctx.max_decode_context)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decode_fn(q[:nd], k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale,
                             ctx.max_decode_context)
    for span in ctx.prefills:
        out[span.q_start: span.q_start + span.q_len] = prefill_attention_torch(q, k, v, k_cache, v_cache, span, scale)
    return out
