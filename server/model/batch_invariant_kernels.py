"""The batch-invariant mode on CUDA (--batch-invariant; batch_invariant.py is the CPU path and says why).

- GEMMs: one Triton matmul whose tiling is a function of the weight's shape only (BLOCK_M/N/K, warps,
  stages), never of the number of rows: no split-K, the K loop in order, one compiled variant for every M
  (M is not specialised). cuBLAS picks its algorithm (and split-K) from M, and the default path's small-batch
  kernel (small_gemm.py) serves only a few rows: both made a row's bits follow the batch.
- Attention: every query token, decode or prefill, is one program of the paged decode kernel per KV head
  (decode_kernel.py) over its own context, in fixed tiles of keys folded in order; never split over
  programs (the default path's split count follows the batch size). A prefill token is that kernel's row:
  its block table is its span's, its context its position + 1, so a prompt's tokens, its chunks and a
  prefix-cache hit compute what a decode computes.
- RMSNorm (one program per row), rotary + cache write (one per token), SiLU × up (elementwise) are the
  default path's kernels, which are per-row already; they are launched without dependent-launch chaining.
CUDA-graph padding rows are rows like any other: they cannot change a real row.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from server.model.batch_invariant import InvariantProjections, token_layout
from server.model.decode_kernel import triton_decode_attention
from server.model.fused_ops import TritonOps, _rope_and_cache


@triton.jit(do_not_specialize=["M"])
def _fixed_tile_matmul(x_ptr, w_ptr, b_ptr, out_ptr, M, N, stride_x, stride_w, stride_o,
                       K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K].T (+ b): program (N tile, M tile), the M tiles of one N tile next to each
    other in launch order (its weights read from HBM once, then from L2). fp32 accumulation over K in
    BLOCK_K steps, in order; one rounding to the output dtype."""
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_n = pid // m_tiles
    pid_m = pid % m_tiles
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@functools.cache
def _processors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's CPU interpreter
    return torch.cuda.get_device_properties(device).multi_processor_count


def matmul_tile(N: int, K: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The tile for a weight of N x K: a function of the weight and the device, not of the rows. 64 rows a
    tile (Hopper's warpgroup MMA takes 64); the widest column tile that still gives every multiprocessor
    a program at one M tile (a decode step: the matmul is bound by the weight's bytes, read by as many
    multiprocessors as there are programs)."""
    sms = _processors(device)
    block_n = 128
    while block_n > 32 and triton.cdiv(N, block_n) < sms:
        block_n //= 2
    fp32 = dtype == torch.float32
    return {"BLOCK_M": 64, "BLOCK_N": block_n, "BLOCK_K": 32 if fp32 else 64, "num_warps": 4,
            "num_stages": 3 if fp32 else 4}


def fixed_tile_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, tile: dict | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N] in x's dtype (into `out` when given, [M, N] with unit
    column stride): row i's bits depend on row i's values only. tile: another tile than matmul_tile's
    (bench/batch_invariant.py --sweep-tiles compares some)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    if weight.stride(-1) != 1:
        raise ValueError("the weight's rows must be contiguous (K innermost)")
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    tile = tile or matmul_tile(N, K, x.dtype, x.device)
    grid = (triton.cdiv(N, tile["BLOCK_N"]) * triton.cdiv(M, tile["BLOCK_M"]),)
    _fixed_tile_matmul[grid](x, weight, bias if bias is not None else weight, out, M, N, x.stride(0),
                             weight.stride(0), out.stride(0), K=K, HAS_BIAS=bias is not None,
                             IEEE=x.dtype == torch.float32, **tile)
    return out


def attend_per_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, ctx, scale: float) -> torch.Tensor:
    """Every token of the step as a row of the paged decode kernel, one program per (token, KV head), never
    split: the K/V of the step are in the cache already (rope_and_cache wrote them)."""
    if ctx.prefills:
        tables, lens = token_layout(ctx, q.shape[0])
    else:  # a decode step (a CUDA graph's too): the decode rows are every token's rows already
        tables, lens = ctx.block_tables, ctx.context_lens
    return triton_decode_attention(q, k_cache, v_cache, tables, lens, scale, None, None, gdc=False)


class BatchInvariantTritonOps(InvariantProjections, TritonOps):
    """TritonOps with the matmuls and attention above; the per-row kernels as they are, never chained."""

    name = "triton-batch-invariant"
    matmul = staticmethod(fixed_tile_matmul)

    @staticmethod
    def rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots):
        T, H, D = q.shape
        if v_cache.stride() != k_cache.stride() or k_cache.stride(3) != 1:
            raise ValueError(f"K and V caches need the same strides, head_dim contiguous: "
                             f"{k_cache.stride()} and {v_cache.stride()}")
        if T:
            _rope_and_cache[(T,)](q, k, v, cos, sin, k_cache, v_cache, slots, H, k.shape[1],
                                  q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
                                  k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                  HALF=D // 2, HEADS_P2=triton.next_power_of_2(max(H, k.shape[1])),
                                  BLOCK_SIZE=k_cache.shape[1], num_warps=4, GDC=False)
        return q, k

    attend = staticmethod(attend_per_token)
