"""Attention over a paged KV cache.

The batch is flat: T new tokens from many sequences. The first `num_decode_tokens` are decodes
(one token per sequence, read back through block tables); the rest are prefill spans (a prompt or
a chunk of it, possibly after a cached prefix). The plain-PyTorch functions here are the reference
and the CPU path; on CUDA fused kernels replace both parts (decode_kernel.py: one program per
sequence; prefill_kernel.py: one launch for every span of the step, over a tile plan built here).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    q_start: int            # offset of the span's first token in the flat batch
    q_len: int              # new tokens in this step
    context_len: int        # cached prefix + new tokens
    block_table: torch.Tensor  # [num_blocks] int32 on the device


@dataclass
class PrefillPlan:
    """Every prefill span of a step cut into tiles of query tokens, for the one-launch prefill kernel.
    Built once per step on the host and copied with the step's other inputs; shared by every layer."""
    tiles: torch.Tensor    # [num_tiles, 4] int: first flat row, tokens in the tile, position of its
                           # first token, offset of its span's block table in `tables`
    tables: torch.Tensor   # [sum of the spans' table lengths] int: every span's block table, end to end
    tile_tokens: int       # the most query tokens a tile holds


# A prefill tile's rows are (query token, query head) pairs of one KV head: about this many of them.
PREFILL_TILE_ROWS = 64


def prefill_tile_rows(head_dim: int) -> int:
    """Tile rows for head_dim: on the H200 (bench/prefill.py, 2026-11-30) 128 rows took 64 x 512 prompts
    from 1.33 to 0.84 ms at head_dim 128 and changed nothing at 64 (0.35 ms either way)."""
    return 128 if head_dim >= 128 else PREFILL_TILE_ROWS


def prefill_tile_tokens(group: int, rows: int = PREFILL_TILE_ROWS) -> int:
    """Query tokens per prefill tile, for `group` query heads per KV head (GQA): the group's heads
    share the tile's K/V loads, so a tile holds fewer tokens as the group grows."""
    return max(1, rows // group)


def prefill_tiles(spans: Sequence[tuple[int, int, int, Sequence[int]]], tile_tokens: int) -> np.ndarray:
    """The tile plan of spans given as (offset in the flat batch, new tokens, context length, block
    table), their tables laid end to end in that order: [num_tiles, 4] int64 (PrefillPlan.tiles)."""
    offset, n, ctx, tlen = (np.fromiter(col, dtype=np.int64, count=len(spans)) for col in
                            ((s[0] for s in spans), (s[1] for s in spans), (s[2] for s in spans),
                             (len(s[3]) for s in spans)))
    counts = -(-n // tile_tokens)
    span = np.repeat(np.arange(len(spans)), counts)
    first = np.cumsum(counts) - counts
    skip = (np.arange(int(counts.sum())) - first[span]) * tile_tokens  # tokens of the span before the tile
    tiles = np.empty((len(span), 4), dtype=np.int64)
    tiles[:, 0] = offset[span] + skip
    tiles[:, 1] = np.minimum(tile_tokens, n[span] - skip)
    tiles[:, 2] = (ctx - n)[span] + skip
    tiles[:, 3] = (np.cumsum(tlen) - tlen)[span]
    return tiles


def plan_prefill(spans: list[PrefillSpan], group: int, device: torch.device,
                 rows: int = PREFILL_TILE_ROWS) -> PrefillPlan:
    """A plan for spans whose tables are already on the device (contexts not built by the runner,
    which packs the plan into its one copy of the step's inputs instead)."""
    tile_tokens = prefill_tile_tokens(group, rows)
    lens = [int(s.block_table.numel()) for s in spans]
    tiles = prefill_tiles([(s.q_start, s.q_len, s.context_len, range(n)) for s, n in zip(spans, lens)], tile_tokens)
    tables = torch.cat([s.block_table.reshape(-1).long() for s in spans])
    return PrefillPlan(torch.from_numpy(tiles).to(device), tables, tile_tokens)


@dataclass
class AttentionContext:
    slot_mapping: torch.Tensor          # [T] int64: the cache slot each new token's K/V goes to
    num_decode_tokens: int
    block_tables: torch.Tensor          # [num_decode, max_blocks] int32
    context_lens: torch.Tensor          # [num_decode] int32
    max_decode_context: int | None      # a bound on context_lens, None inside CUDA graphs
    prefills: list[PrefillSpan] = field(default_factory=list)
    prefill_plan: PrefillPlan | None = None  # the prefills as tiles (the runner builds it; the kernel reads it)
    # int32 zeros the decode kernel counts finished splits in, left at 0 after each launch (the runner's,
    # in the pool; decode_kernel.py); None: each sequence's context is one program's.
    split_counts: torch.Tensor | None = None


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
                           max_context: int | None = None, split_counts: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]; each row attends to its first context_lens[b] cached tokens. (split_counts:
    the Triton kernel's, unused here.)"""
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


def prefill_spans_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, ctx: AttentionContext, scale: float, out: torch.Tensor) -> None:
    """Every prefill span's attention into its rows of out [T, H, D], one span at a time."""
    for span in ctx.prefills:
        out[span.q_start: span.q_start + span.q_len] = prefill_attention_torch(q, k, v, k_cache, v_cache, span, scale)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           ctx: AttentionContext, scale: float,
           decode_fn: Callable[..., torch.Tensor] = decode_attention_torch,
           prefill_fn: Callable[..., None] = prefill_spans_torch) -> torch.Tensor:
    """Attention of the flat batch, once the new K/V are in the cache. q [T, H, D] -> [T, H, D].
    decode_fn computes the decodes' rows; prefill_fn writes the prefill spans' rows into `out`."""
    nd = ctx.num_decode_tokens
    if not ctx.prefills:
        return decode_fn(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale, ctx.max_decode_context,
                         ctx.split_counts)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decode_fn(q[:nd], k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale,
                             ctx.max_decode_context, ctx.split_counts)
    prefill_fn(q, k, v, k_cache, v_cache, ctx, scale, out)
    return out
