"""Fused paged decode attention in Triton: one program per (sequence, KV head, split of its context).

Each program loads its KV head's pages once and serves every query head of the group (GQA), so
K/V bytes are read once per step: decode attention is bound by those bytes, not by arithmetic. A small
batch's contexts are split over programs (decode_splits) so that it still fills the device; the split
count depends on the batch alone, so a sequence's result can differ in its last bits between batch sizes
(as a GEMM's rows already can).
Pages are gathered a tile at a time (several blocks per iteration), several tiles in flight.
Context lengths are read on the device, so the launch is the same for every step and can be
captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.model.kv_layout import check_kernel_views
from server.model.launch import INTERPRETED, chain_in, gdc_launch
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


# The block tables' row stride (the batch's longest table) and the split count change from step to step:
# specialised (Triton's default for integers: == 1, divisible by 16) they would compile new variants
# mid-serving.
@triton.jit(do_not_specialize=["stride_tb", "splits"])
def _paged_decode(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, parts_ptr, counts_ptr, scale, splits,
                  stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh,
                  GROUP: tl.constexpr, PADDED_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
                  STAGES: tl.constexpr, INTERPRETED: tl.constexpr, MAX_SPLITS: tl.constexpr,
                  MIN_SPLIT_TILES: tl.constexpr, GDC: tl.constexpr):
    """Program (sequence, KV head, split): the split's share of the context, whole tiles of at least
    MIN_SPLIT_TILES. One active split writes the output; several write partial results (m, l, acc), and
    the last to finish (an atomic count per (sequence, KV head), left at 0 again) combines them.
    GDC: launched before the kernel before it ends (a small batch's chain, small_gemm.py; the batch-invariant
    mode's at any batch): waits for it first."""
    chain_in(GDC)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq)
    tiles = tl.cdiv(ctx, TILE)
    per = tl.maximum(tl.cdiv(tiles, splits), MIN_SPLIT_TILES)  # tiles per split
    active = tl.maximum(tl.cdiv(tiles, per), 1)
    if split >= active:
        return
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
    lo = split * per * TILE
    hi = tl.minimum(ctx, lo + per * TILE)
    if INTERPRETED:
        # Triton's CPU interpreter (which runs this kernel in CI) cannot iterate up to a bound loaded
        # from memory: one tile at a time, with the same body.
        start = lo
        while start < hi:
            m, l, acc = _tile(q, k_ptr, v_ptr, tables_ptr, seq, kv_head, ctx, last, start + t, d, m, l, acc, scale,
                              stride_kb, stride_ks, stride_kh, stride_tb, BLOCK_SIZE, IEEE)
            start += TILE
    else:
        # Software-pipelined: STAGES tiles' page loads in flight while one is computed. On the H200
        # (2026-12-01) at batch 256 x 384 tokens: 75 -> 60 us a layer at head_dim 64, 131 -> 103 at 128
        # (the loads were waited for one tile at a time).
        for start in tl.range(lo, hi, TILE, num_stages=STAGES):
            m, l, acc = _tile(q, k_ptr, v_ptr, tables_ptr, seq, kv_head, ctx, last, start + t, d, m, l, acc, scale,
                              stride_kb, stride_ks, stride_kh, stride_tb, BLOCK_SIZE, IEEE)
    out_rows = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if active == 1:
        tl.store(out_rows, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])
        return
    # A split's part: m and l [PADDED_GROUP], then acc [PADDED_GROUP, HEAD_DIM], in float32.
    PART: tl.constexpr = PADDED_GROUP * (HEAD_DIM + 2)
    parts = parts_ptr + (seq * tl.num_programs(1) + kv_head).to(tl.int64) * (MAX_SPLITS * PART)
    part = parts + split * PART
    tl.store(part + g, m)
    tl.store(part + PADDED_GROUP + g, l)
    tl.store(part + 2 * PADDED_GROUP + g[:, None] * HEAD_DIM + d[None, :], acc)
    tl.debug_barrier()  # every thread's stores before the count that publishes them
    count = counts_ptr + seq * tl.num_programs(1) + kv_head
    if tl.atomic_add(count, 1, sem="acq_rel") == active - 1:
        # The last split: every other part is written. Read past L1 (.cg): these lines were written by other
        # multiprocessors during this launch.
        big = tl.full([PADDED_GROUP], float("-inf"), tl.float32)
        for i in tl.static_range(MAX_SPLITS):
            there = (g < PADDED_GROUP) & (i < active)
            big = tl.maximum(big, tl.load(parts + i * PART + g, mask=there, other=float("-inf"), cache_modifier=".cg"))
        total = tl.zeros([PADDED_GROUP], tl.float32)
        acc = tl.zeros([PADDED_GROUP, HEAD_DIM], tl.float32)
        for i in tl.static_range(MAX_SPLITS):
            there = (g < PADDED_GROUP) & (i < active)
            w = tl.exp(tl.load(parts + i * PART + g, mask=there, other=float("-inf"), cache_modifier=".cg") - big)
            total += w * tl.load(parts + i * PART + PADDED_GROUP + g, mask=there, other=0.0, cache_modifier=".cg")
            acc += w[:, None] * tl.load(parts + i * PART + 2 * PADDED_GROUP + g[:, None] * HEAD_DIM + d[None, :],
                                        mask=there[:, None], other=0.0, cache_modifier=".cg")
        tl.store(out_rows, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])
        tl.atomic_xchg(count, 0)  # ready for the next launch (the next layer's, or a graph's replay)


# A sequence's context is split over programs only while the batch leaves the device idle: up to MAX_SPLITS
# splits, until batch x KV heads x splits reaches SPLIT_TARGET programs, each split at least MIN_SPLIT_TILES
# tiles (a short context stays one program: the combine would cost more than it saves).
MAX_SPLITS, SPLIT_TARGET, MIN_SPLIT_TILES = 16, 256, 2
SPLIT_COUNTS = SPLIT_TARGET  # split_counts a caller keeps: enough for every batch that splits (B x KV heads < 256)


# Tiles in flight and warps a program: swept on the H200 (2026-12-02: tiles of 32/64/128 tokens, 2-5 stages, 2/4/8
# warps, at head_dim 64 and 128, batch 1 to 256): 4 stages of 2 warps was the best overall, 0.89-0.91x the
# time of 3 stages of 4 at head_dim 64 and 256 sequences, and never slower.
STAGES, WARPS = 4, 2


def decode_splits(batch: int, kv_heads: int) -> int:
    """Splits per (sequence, KV head) for a batch: a function of its shape only, so a CUDA graph keeps it."""
    return max(1, min(MAX_SPLITS, -(-SPLIT_TARGET // max(1, batch * kv_heads))))


def triton_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            max_context: int | None = None, split_counts: torch.Tensor | None = None,
                            gdc: bool = False) -> torch.Tensor:
    """Same contract as attention.decode_attention_torch: q [B, H, D] -> [B, H, D]. split_counts: int32
    zeros, SPLIT_COUNTS of them, that the caller keeps between launches (AttentionContext.split_counts);
    without them a sequence's context is one program's. gdc: chained by dependent launch (launch.py)."""
    B, H, D = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    check_kernel_views(k_cache, v_cache)  # strided views of one block-major cache (kv_layout.py)
    group = H // kv_heads
    out = torch.empty_like(q)
    if B == 0:
        return out
    # tl.dot needs at least 16 rows; padded heads are masked out on load and store.
    padded = max(16, triton.next_power_of_2(group))
    tile = max(64, block_size)
    splits = 1 if split_counts is None else decode_splits(B, kv_heads)
    if max_context is not None:  # known outside CUDA graphs: no programs beyond the tiles there are
        splits = max(1, min(splits, -(-max_context // (tile * MIN_SPLIT_TILES))))
    if splits > 1:
        assert split_counts is not None and split_counts.numel() >= B * kv_heads  # decode_splits: < SPLIT_COUNTS
        parts = torch.empty((B, kv_heads, MAX_SPLITS, padded * (D + 2)), dtype=torch.float32, device=q.device)
        counts = split_counts
    else:
        # Never touched with one split; typed as the real ones, so both cases are one compiled kernel.
        parts = torch.empty(1, dtype=torch.float32, device=q.device)
        counts = torch.empty(1, dtype=torch.int32, device=q.device)
    _paged_decode[(B, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, parts, counts, scale, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, PADDED_GROUP=padded, HEAD_DIM=D, BLOCK_SIZE=block_size, TILE=tile,
        IEEE=q.dtype == torch.float32, STAGES=STAGES, INTERPRETED=INTERPRETED, MAX_SPLITS=MAX_SPLITS,
        MIN_SPLIT_TILES=MIN_SPLIT_TILES, num_warps=WARPS, **gdc_launch(gdc),
    )
    return out
