"""Fused paged decode attention in Triton: one program per (sequence, KV head).

Each program loads its KV head's pages once and serves every query head of the group (GQA), so
K/V bytes are read once per step: decode attention is bound by those bytes, not by arithmetic.
Pages are gathered a tile at a time (several blocks per iteration), several tiles in flight.
Context lengths are read on the device, so the launch is the same for every step and can be
captured in a CUDA graph.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from server.model.online_softmax import online_softmax_step


@triton.jit
def _tile(q, k_ptr, v_ptr, tables_ptr, seq, kv_head, ctx, last, tok, d, m, l, acc, scale,
          stride_kb, stride_ks, stride_kh, stride_tb, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr):
    """One tile of context tokens into the running softmax (m, l) and output (acc). last: every query row's
    position, ctx - 1: it sees the keys at positions <= last."""
    valid = tok < ctx
    # In 64 bits: the cache is block-major (kv_layout.py), a block's stride spans every layer, and
    # block x stride passes 2^31 elements in a large cache (the runner's tables are int64 already).
    block = tl.load(tables_ptr + seq * stride_tb + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    offs = block[:, None] * stride_kb + (tok % BLOCK_SIZE)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
    k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
    v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
    return online_softmax_step(q, k, v, m, l, acc, scale, tok, last, True, False, IEEE)


# The block tables' row stride (the batch's longest table) changes from step to step: specialised
# (Triton's default for integers: == 1, divisible by 16) it would compile new variants mid-serving.
@triton.jit(do_not_specialize=["stride_tb"])
def _paged_decode(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                  stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh,
                  GROUP: tl.constexpr, PADDED_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
                  STAGES: tl.constexpr, INTERPRETED: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    g = tl.arange(0, PADDED_GROUP)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=(g < GROUP)[:, None], other=0.0)
    m = tl.full([PADDED_GROUP], float("-inf"), tl.float32)
    l = tl.zeros([PADDED_GROUP], tl.float32)
    acc = tl.zeros([PADDED_GROUP, HEAD_DIM], tl.float32)
    t = tl.arange(0, TILE)
    last = tl.zeros([PADDED_GROUP], tl.int32) + (ctx - 1)
    if INTERPRETED:
        # Triton's CPU interpreter (which runs this kernel in CI) cannot iterate up to a bound loaded
        # from memory: one tile at a time, with the same body.
        start = 0
        while start < ctx:
            m, l, acc = _tile(q, k_ptr, v_ptr, tables_ptr, seq, kv_head, ctx, last, start + t, d, m, l, acc, scale,
                              stride_kb, stride_ks, stride_kh, stride_tb, BLOCK_SIZE, IEEE)
            start += TILE
    else:
        # Software-pipelined: STAGES tiles' page loads in flight while one is computed. On the H200
        # (2026-12-01) at batch 256 x 384 tokens: 75 -> 60 us a layer at head_dim 64, 131 -> 103 at 128
        # (the loads were waited for one tile at a time).
        for start in tl.range(0, ctx, TILE, num_stages=STAGES):
            m, l, acc = _tile(q, k_ptr, v_ptr, tables_ptr, seq, kv_head, ctx, last, start + t, d, m, l, acc, scale,
                              stride_kb, stride_ks, stride_kh, stride_tb, BLOCK_SIZE, IEEE)
    out = acc / l[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])


def _interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET: 1, true, on...), as Triton reads
    it; it is read when a kernel is defined, so it is fixed for the process."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_INTERPRETED = _interpreted()


def triton_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            max_context: int | None = None) -> torch.Tensor:
    """Same contract as attention.decode_attention_torch: q [B, H, D] -> [B, H, D]."""
    B, H, D = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    # K and V are strided views of one block-major cache (kv_layout.py): the kernel reads both with
    # K's strides, and a token's head_dim values must be contiguous.
    if v_cache.stride() != k_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(f"K and V caches need the same strides, head_dim contiguous: "
                         f"{k_cache.stride()} and {v_cache.stride()}")
    group = H // kv_heads
    out = torch.empty_like(q)
    if B == 0:
        return out
    # tl.dot needs at least 16 rows; padded heads are masked out on load and store.
    padded = max(16, triton.next_power_of_2(group))
    tile = max(64, block_size)
    _paged_decode[(B, kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, PADDED_GROUP=padded, HEAD_DIM=D, BLOCK_SIZE=block_size, TILE=tile,
        IEEE=q.dtype == torch.float32, STAGES=3, INTERPRETED=_INTERPRETED, num_warps=4,
    )
    return out
