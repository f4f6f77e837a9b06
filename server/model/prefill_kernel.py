"""Paged prefill attention in Triton: ONE launch for every prefill span of a step.

The step's spans (prompts or chunks of them, possibly after a cached prefix) are cut into tiles of
query tokens on the host (attention.prefill_tiles, one plan per step shared by every layer). The
grid is (tiles, KV heads): a program takes one tile's tokens times the query heads of one KV head
(GQA: the group's heads share each K/V load) and runs FlashAttention's online softmax over the
span's keys, read through its block table from the cache (write_kv put the new tokens' K/V there
first, so the cached prefix and the span itself are one sequence of keys). A query at position p
sees keys 0..p (lower-right causal, as attention.prefill_attention_torch). Key tiles that every
row sees wholly are read without the causal mask; the rest with it. Accumulation is fp32.

Replaces a PyTorch scaled_dot_product_attention call (plus its slicing, gathers and mask) per span
per layer: a step admitting 256 prompts made ~4096 of them on the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.model.attention import AttentionContext, plan_prefill, prefill_tile_rows
from server.model.kv_layout import check_kernel_views
from server.model.online_softmax import online_softmax_step

LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per step of the online softmax (4 blocks of 16)


@triton.jit
def _paged_prefill(q_ptr, k_ptr, v_ptr, out_ptr, tiles_ptr, tables_ptr, qk_scale,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_tile,
                   GROUP: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    meta = tiles_ptr + tile * stride_tile
    row0 = tl.load(meta).to(tl.int64)            # the tile's first token in the flat batch
    n = tl.load(meta + 1).to(tl.int32)           # its tokens (1..TILE_TOKENS)
    pos0 = tl.load(meta + 2).to(tl.int32)        # the first token's position in its sequence
    table = tl.load(meta + 3).to(tl.int64)       # where its span's block table starts in tables_ptr
    end = pos0 + n                               # keys 0..end-1: the prefix and the tile's tokens

    # Row r is (token r // GROUP, query head r % GROUP of this KV head's group); rows past the tile's
    # tokens are padding (tl.dot needs >= 16 rows): loaded as zeros, never stored.
    r = tl.arange(0, BLOCK_M)
    t = r // GROUP
    head = kv_head * GROUP + r % GROUP
    valid = (r < TILE_TOKENS * GROUP) & (t < n)
    pos = tl.minimum(pos0 + t, end - 1)          # padding rows attend as the last token: no empty rows
    d = tl.arange(0, HEAD_DIM)
    rows = row0 + t.to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=valid[:, None], other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    c = tl.arange(0, BLOCK_N)
    head_off = kv_head.to(tl.int64) * stride_kh
    start = 0
    # While loops, not range(): Triton's CPU interpreter (which runs this kernel in CI) cannot iterate
    # up to a bound loaded from memory. First the key tiles every row sees whole (keys <= pos0): no mask.
    while start + BLOCK_N <= pos0 + 1:
        tok = start + c
        # In 64 bits: the cache is block-major (kv_layout.py), a block's stride spans every layer.
        block = tl.load(tables_ptr + table + tok // BLOCK_SIZE).to(tl.int64)
        offs = block[:, None] * stride_kb + (tok % BLOCK_SIZE)[:, None] * stride_ks + head_off + d[None, :]
        k = tl.load(k_ptr + offs)
        v = tl.load(v_ptr + offs)
        m, l, acc = online_softmax_step(q, k, v, m, l, acc, qk_scale, tok, pos, False, True, IEEE)
        start += BLOCK_N
    # Then the tiles that reach the diagonal: key j is seen by the rows at positions >= j. The first
    # tile holds key 0, which every row sees, so no row's maximum stays -inf (no NaN).
    while start < end:
        tok = start + c
        inside = tok < end
        block = tl.load(tables_ptr + table + tok // BLOCK_SIZE, mask=inside, other=0).to(tl.int64)
        offs = block[:, None] * stride_kb + (tok % BLOCK_SIZE)[:, None] * stride_ks + head_off + d[None, :]
        k = tl.load(k_ptr + offs, mask=inside[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=inside[:, None], other=0.0)
        m, l, acc = online_softmax_step(q, k, v, m, l, acc, qk_scale, tok, pos, True, True, IEEE)
        start += BLOCK_N
    out = acc / l[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


def triton_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, ctx: AttentionContext, scale: float, out: torch.Tensor) -> None:
    """Same contract as attention.prefill_spans_torch: every span's rows of out [T, H, D], from
    q [T, H, D] and the cache (k and v, the new tokens' K/V, are in it already and unused here)."""
    if not ctx.prefills:
        return
    T, H, D = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    check_kernel_views(k_cache, v_cache)  # strided views of one block-major cache (kv_layout.py)
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError(f"q and out need head_dim contiguous: {q.stride()} and {out.stride()}")
    group = H // kv_heads
    plan = ctx.prefill_plan
    if plan is None:  # a context the runner did not build: plan it once for all layers
        plan = ctx.prefill_plan = plan_prefill(ctx.prefills, group, q.device, prefill_tile_rows(D))
    tiles = plan.tiles
    block_m, num_warps = launch_shape(plan.tile_tokens, group, D, q.element_size())
    _paged_prefill[(tiles.shape[0], kv_heads)](
        q, k_cache, v_cache, out, tiles, plan.tables, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tiles.stride(0),
        GROUP=group, TILE_TOKENS=plan.tile_tokens, BLOCK_M=block_m, BLOCK_N=BLOCK_N, HEAD_DIM=D,
        BLOCK_SIZE=block_size, IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=2,
    )


def launch_shape(tile_tokens: int, group: int, head_dim: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_M, num_warps). tl.dot needs at least 16 rows; rows past tile_tokens x group are masked out
    on load and store. Registers per thread on sm_90 (compiled without a GPU, strides divisible by 16):
    64 rows x head_dim 64 in bf16 take 124 with 4 warps; x 128 take 174 with 4, 134 with 8; fp32 spills
    less with 8. So tiles of 64 x 128 bf16 values or more get 8 warps."""
    block_m = triton.next_power_of_2(max(16, tile_tokens * group))
    return block_m, 8 if block_m * head_dim * element_size >= 64 * 128 * 2 else 4
