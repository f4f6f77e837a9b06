"""The batch-invariant mode on CUDA (--batch-invariant; batch_invariant.py is the CPU path and says why).

- GEMMs: one Triton matmul whose order of summation is a function of the weight's shape only (BLOCK_K,
  K splits and their groups), never of the number of rows: each K split's loop in order, its fp32 partial into
  a workspace, the splits then added a group at a time in order by a second kernel (no atomics); for many rows a
  program adds a group's splits itself in one K loop (GROUPED), or all of them once the output tiles fill the
  GPU (SERIAL, FLAT); 64- or 128-row tiles by the number of rows, on Hopper 256 columns for an unsplit weight's
  many rows (matmul_tile: the same sums every way); M itself is not specialised. cuBLAS picks its algorithm
  (and split-K) from M, and the default path's small-batch kernel (small_gemm.py) serves only a few rows: both
  made a row's bits follow the batch.
- Attention: every query token, decode or prefill, is one program of the paged decode kernel per KV head
  (decode_kernel.py) over its own context, in fixed tiles of keys folded in order; never split over
  programs (the default path's split count follows the batch size). A prefill token is that kernel's row:
  its block table is its span's, its context its position + 1, so a prompt's tokens, its chunks and a
  prefix-cache hit compute what a decode computes.
- RMSNorm (one program per row), rotary + cache write (one per token), SiLU × up (elementwise) are the
  default path's kernels, which are per-row already; where o_proj's or down's K always splits, their split sum, the
  residual add and the norm after them are one launch (fixed_tile_matmul_add_rmsnorm: the layers hand that output
  to the norm unsummed, Unsummed), and q|k|v's split sum runs with rotary and the cache write (fixed_tile_matmul_rope); where gate|up's K is not split, SiLU × up runs in the
  matmul's epilogue instead (fixed_tile_gate_up: the same roundings, one launch and no [M, 2I] round trip). On Hopper these, the matmul and its split sum, rotary
  and attention chain to the kernel before by dependent launch (mode_chained(), launch.py): each starts
  while its predecessor ends and waits for it in-kernel, so a dense layer's extra, unfused kernels cost no
  launch gaps; the arithmetic is the same. A sparse layer's routing and grouped GEMMs launch the ordinary way.
- Sparse (mixture-of-experts) layers: the router through the matmul above, then fused_moe.moe_invariant: one
  routing program per token and the grouped GEMMs on one tile whatever the batch (the default path's tile
  and its one-program routing for a few tokens follow the batch).
CUDA-graph padding rows are rows like any other: they cannot change a real row.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from server.model.batch_invariant import InvariantProjections, token_layout
from server.model.decode_kernel import triton_decode_attention
from server.model.fused_moe import moe_invariant
from server.model.fused_ops import TritonOps, _add_rmsnorm_row, _cache_row, _cos_sin, _rotate_heads
from server.model.kv_layout import check_kernel_views
from server.model.launch import chain_in, dependent_launch_on, gdc_launch
from server.model.ops import heads_then_rope, split_qkv


@triton.jit
def _tile(x_ptr, w_ptr, pid_m, pid_n, M, N, stride_x, stride_w, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (pid_m, pid_n)'s rows and columns, which of them exist, and the pointers to their x rows and weight
    rows: (rows, cols, row_ok, col_ok, x_rows, w_rows)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return (rows, cols, rows < M, cols < N, x_ptr + rows.to(tl.int64)[:, None] * stride_x,
            w_ptr + cols.to(tl.int64)[:, None] * stride_w)


@triton.jit
def _k_tile(rows, ok, k, k_ok):
    """An operand's [rows, BLOCK_K] tile at the K columns k, zero past K and in the rows not `ok`."""
    return tl.load(rows + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _mma(x, w, acc, IEEE: tl.constexpr):
    """acc + x @ w.T, the MMA accumulating in place: every path of the matmul (and of gate|up's, _gate_up_steps)
    multiplies through this one, so a row's sum has one arithmetic."""
    if IEEE:
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _k_step(x_rows, w_rows, row_ok, col_ok, k, K: tl.constexpr, acc, IEEE: tl.constexpr):
    """acc + the tile's product over the K columns k (masked past K): one BLOCK_K step."""
    k_ok = k < K
    return _mma(_k_tile(x_rows, row_ok, k, k_ok), _k_tile(w_rows, col_ok, k, k_ok), acc, IEEE)


@triton.jit
def _split_partial(x_rows, w_rows, row_ok, col_ok, split, K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, IEEE: tl.constexpr):
    """One K split's fp32 partial of a [BLOCK_M, BLOCK_N] tile: from zero, its K_CHUNK in BLOCK_K steps, in order."""
    ks = split * K_CHUNK + tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K_CHUNK, BLOCK_K):
        acc = _k_step(x_rows, w_rows, row_ok, col_ok, k0 + ks, K, acc, IEEE)
    return acc


@triton.jit
def _weights_ahead(w_rows, col_ok, ks, K: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr):
    """The weight tiles of the first AHEAD (1-4) BLOCK_K steps from the K columns ks, as _k_step loads them: loaded
    before a chained kernel's wait (weights never depend on the kernel before), so that they stream during it, as
    small_gemm.py loads its first chunk. Tiles past AHEAD are the first again (never used)."""
    w0 = _k_tile(w_rows, col_ok, ks, ks < K)
    w1 = w0
    w2 = w0
    w3 = w0
    if AHEAD > 1:
        w1 = _k_tile(w_rows, col_ok, ks + BLOCK_K, ks + BLOCK_K < K)
    if AHEAD > 2:
        w2 = _k_tile(w_rows, col_ok, ks + 2 * BLOCK_K, ks + 2 * BLOCK_K < K)
    if AHEAD > 3:
        w3 = _k_tile(w_rows, col_ok, ks + 3 * BLOCK_K, ks + 3 * BLOCK_K < K)
    return w0, w1, w2, w3


@triton.jit
def _mma_ahead(x_rows, row_ok, ks, w, j: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, acc,
               IEEE: tl.constexpr):
    """acc + the step j's product from its weight tile w loaded ahead: _k_step's x tile and MMA."""
    k = ks + j * BLOCK_K
    return _mma(_k_tile(x_rows, row_ok, k, k < K), w, acc, IEEE)


@triton.jit
def _zeros_at_run_time(M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """+0.0 everywhere, which the compiler cannot tell from M (never negative): an MMA into a zero it knows of skips
    reading it (wgmma's scale-d 0: a·b, not +0 + a·b, a -0 where the loop's first step gives +0), so the steps taken
    out of the loop start from what the loop starts from."""
    return tl.zeros([BLOCK_M, BLOCK_N], tl.float32) + tl.where(M < 0, 1.0, 0.0)


@triton.jit
def _split_partial_ahead(x_rows, w_rows, row_ok, col_ok, split, w0, w1, w2, w3, M, K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr,
                         IEEE: tl.constexpr, AHEAD: tl.constexpr):
    """_split_partial with its first AHEAD steps' weight tiles given (_weights_ahead): the same x tiles, the same
    MMAs in the same order from zero, the steps after them in the loop."""
    ks = split * K_CHUNK + tl.arange(0, BLOCK_K)
    acc = _zeros_at_run_time(M, BLOCK_M, BLOCK_N)
    acc = _mma_ahead(x_rows, row_ok, ks, w0, 0, K, BLOCK_K, acc, IEEE)
    if AHEAD > 1:
        acc = _mma_ahead(x_rows, row_ok, ks, w1, 1, K, BLOCK_K, acc, IEEE)
    if AHEAD > 2:
        acc = _mma_ahead(x_rows, row_ok, ks, w2, 2, K, BLOCK_K, acc, IEEE)
    if AHEAD > 3:
        acc = _mma_ahead(x_rows, row_ok, ks, w3, 3, K, BLOCK_K, acc, IEEE)
    for k0 in range(AHEAD * BLOCK_K, K_CHUNK, BLOCK_K):
        acc = _k_step(x_rows, w_rows, row_ok, col_ok, k0 + ks, K, acc, IEEE)
    return acc


@triton.jit
def _splits_in_one_loop(x_rows, w_rows, row_ok, col_ok, first, K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, K_CHUNK: tl.constexpr,
                        IEEE: tl.constexpr):
    """The SPLIT_K partials of _split_partial from split `first` on added in split order, ((part first + part
    first+1) + ...) (first: 0 for all of a weight's splits, a group's first split for GROUPED), from ONE loop over
    every split's BLOCK_K steps (the last split's masked tail included, as _split_partial walks it) instead of a
    loop a split, each filling and draining its own software pipeline. The same loads, MMAs (from zeroed
    registers at a split's first step, as _split_partial starts) and additions: the same bits as SERIAL's loops
    and the workspace. Compiled for sm_90 by Triton 3.6 this stays one pipelined loop with the MMAs asynchronous
    (a wait for all of them only in the branch that folds a split), because the loop uses the partial only under
    that `if`: the pipeliner lets an MMA run on past its iteration only when nothing outside an `if` reads its
    result. (Triton's OptimizeAccumulatorInit, which would turn the reset into wgmma's use-accumulator flag, runs
    for Blackwell only; the reset is a zeroing of the registers inside the branch.)"""
    STEPS: tl.constexpr = K_CHUNK // BLOCK_K
    ks = first * K_CHUNK + tl.arange(0, BLOCK_K)
    part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # never added to: split 0's partial replaces it
    for step in range(0, SPLIT_K * STEPS):
        part = _k_step(x_rows, w_rows, row_ok, col_ok, step * BLOCK_K + ks, K, part, IEEE)
        if step % STEPS == STEPS - 1:
            # Split 0's partial itself, not 0.0 + it (+0.0 for a -0.0). A select, not `if ...: total = part`:
            # yielding the MMA's result as a second loop value would make the pipeliner wait for every MMA.
            total = tl.where(step == STEPS - 1, part, total + part)
            part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    return total


@triton.jit(do_not_specialize=["M"])
def _fixed_tile_matmul(x_ptr, w_ptr, b_ptr, out_ptr, M, N, stride_x, stride_w, stride_o,
                       K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, K_CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                       SERIAL: tl.constexpr, FLAT: tl.constexpr, GDC: tl.constexpr, GROUPED: tl.constexpr = 1,
                       AHEAD: tl.constexpr = 0):
    """out[M, N] = x[M, K] @ w[N, K].T (+ b): program (N tile, K split, M tile), the M tiles of one weight block
    next to each other in launch order (its weights read from HBM once, then from L2). fp32 accumulation over
    the split's K_CHUNK in BLOCK_K steps, in order. SPLIT_K == 1: one rounding to the output dtype. SERIAL
    (SPLIT_K > 1): program (N tile, M tile) computes the splits one after the other, each from zero, and adds
    them in split order, then rounds once: bit for bit what the split programs and _sum_splits compute, with
    no workspace and no second launch (for many rows, whose M tiles fill the GPU without splitting); FLAT:
    the same in one K loop over all the splits (_splits_in_one_loop), not one loop a split. Else
    out is the fp32 workspace [SPLIT_K, M, N] and _sum_splits folds it; GROUPED > 1: program (N tile, group, M
    tile) adds a group of GROUPED consecutive splits in one loop (as FLAT does all of them) and writes that group's
    partial: out is [SPLIT_K / GROUPED, M, N], which _sum_splits folds in groups of one. GDC: chained by
    dependent launch (launch.py): launched before the kernel before it ends, it waits in-kernel for it, and lets
    the next (_sum_splits, or the layer's next kernel) launch at once: no launch gaps, the same arithmetic. AHEAD
    (1-4; a program a split, GROUPED 1, not SERIAL): its split's first AHEAD steps' weight tiles are loaded before
    that wait (_weights_ahead), its MMAs unchanged."""
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % m_tiles
    rest = pid // m_tiles
    if SERIAL:
        pid_s = 0
        pid_n = rest
    else:
        pid_s = rest % (SPLIT_K // GROUPED)
        pid_n = rest // (SPLIT_K // GROUPED)
    rows, cols, row_ok, col_ok, x_rows, w_rows = _tile(x_ptr, w_ptr, pid_m, pid_n, M, N, stride_x, stride_w,
                                                       BLOCK_M, BLOCK_N)
    if AHEAD:
        w0, w1, w2, w3 = _weights_ahead(w_rows, col_ok, pid_s * K_CHUNK + tl.arange(0, BLOCK_K), K, BLOCK_K, AHEAD)
    chain_in(GDC)
    if SERIAL and FLAT:
        acc = _splits_in_one_loop(x_rows, w_rows, row_ok, col_ok, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, K_CHUNK,
                                  IEEE)
    elif GROUPED > 1:
        acc = _splits_in_one_loop(x_rows, w_rows, row_ok, col_ok, pid_s * GROUPED, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                  GROUPED, K_CHUNK, IEEE)
    elif AHEAD:
        acc = _split_partial_ahead(x_rows, w_rows, row_ok, col_ok, pid_s, w0, w1, w2, w3, M, K, BLOCK_M, BLOCK_N,
                                   BLOCK_K, K_CHUNK, IEEE, AHEAD)
    else:
        acc = _split_partial(x_rows, w_rows, row_ok, col_ok, pid_s, K, BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK, IEEE)
        if SERIAL:
            for split in tl.static_range(1, SPLIT_K):  # as _sum_splits adds them: ((part 0 + part 1) + ...)
                acc += _split_partial(x_rows, w_rows, row_ok, col_ok, split, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                      K_CHUNK, IEEE)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1 or SERIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = out_ptr + (pid_s * M + rows).to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(part, acc, mask=mask)


@triton.jit
def _fold_group(ws_ptr, at, M, N, GROUP: tl.constexpr, OK):
    """Partials at, at+1, ..., at+GROUP-1 of the workspace's element (row, cols) (`at` a pointer offset of part
    `first`, M * N apart) added in order from the first itself."""
    acc = tl.load(ws_ptr + at, mask=OK, other=0.0)
    for j in tl.static_range(1, GROUP):
        acc += tl.load(ws_ptr + at + (j * M).to(tl.int64) * N, mask=OK, other=0.0)
    return acc


@triton.jit
def _fold_splits(ws_ptr, at, M, N, SPLIT_K: tl.constexpr, GROUP: tl.constexpr, OK):
    """The workspace's SPLIT_K partials of the elements at `at` added in groups of GROUP consecutive ones, each
    group in split order, then the groups in order (fp32, no rounding): what _sum_splits and _sum_add_rmsnorm add."""
    acc = _fold_group(ws_ptr, at, M, N, GROUP, OK)
    for g in tl.static_range(1, SPLIT_K // GROUP):
        acc += _fold_group(ws_ptr, at + (g * GROUP * M).to(tl.int64) * N, M, N, GROUP, OK)
    return acc


@triton.jit(do_not_specialize=["M"])
def _sum_splits(ws_ptr, b_ptr, out_ptr, M, N, stride_o, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                HAS_BIAS: tl.constexpr, GDC: tl.constexpr, GROUP: tl.constexpr = 1):
    """out[row, cols] = the S partials added in groups of GROUP consecutive ones, each group in split order, then
    the groups in order: (((g 0 + g 1) + ...) + g S/GROUP-1) (+ b) with g i = ((part iG + part iG+1) + ...), one
    rounding: program (row, column block), an element's sum in one order whatever M. GROUP 1 (or S): every split
    in order, (((part 0 + part 1) + ...) + part S-1). GDC: launched before the split matmul ended; waits for it
    (its partials complete and visible) before reading anything, and lets the next kernel launch."""
    chain_in(GDC)
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(N, BLOCK)
    row = pid // col_blocks
    cols = (pid % col_blocks) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    at = row.to(tl.int64) * N + cols
    acc = _fold_splits(ws_ptr, at, M, N, SPLIT_K, GROUP, ok)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _sum_add_rmsnorm(ws_ptr, b_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, M, N, eps, SPLIT_K: tl.constexpr,
                     BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GDC: tl.constexpr,
                     GROUP: tl.constexpr = 1):
    """_sum_splits then fused_ops._add_rmsnorm, in one program a row: the row's S partials added in groups of GROUP
    in order (+ b) and rounded, as _sum_splits writes the matmul's output; then x + residual rounded (written to rout),
    its mean square over the row, the normed row times w, as _add_rmsnorm computes them (one row a program, the row
    in one BLOCK). Where a split matmul's output goes only to the next norm (o_proj, down_proj), one launch and no
    [M, N] round trip instead of two; the same launch at every number of rows (BatchInvariantTritonOps)."""
    chain_in(GDC)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    at = row.to(tl.int64) * N + cols
    acc = _fold_splits(ws_ptr, at, M, N, SPLIT_K, GROUP, ok)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    start = row.to(tl.int64) * N
    _add_rmsnorm_row(acc.to(out_ptr.dtype.element_ty), r_ptr + start, w_ptr, out_ptr + start, rout_ptr + start, cols,
                     ok, N, eps, HAS_RESIDUAL)


@triton.jit
def _summed_heads(ws_ptr, b_ptr, at, col, M, N, ok, SPLIT_K: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                  dtype: tl.constexpr):
    """A token's heads of the q|k|v row as _sum_splits writes them (the partials at `at`, columns col, folded,
    + b, rounded to dtype)."""
    acc = _fold_splits(ws_ptr, at, M, N, SPLIT_K, GROUP, ok)
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=ok, other=0.0).to(tl.float32)
    return acc.to(dtype)


@triton.jit(do_not_specialize=["M"])
def _sum_rope_and_cache(ws_ptr, b_ptr, out_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, qw_ptr, kw_ptr, q_eps,
                        k_eps, M, N, n_heads, n_kv_heads, stride_o, stride_ct, stride_cb, stride_cs, stride_ch,
                        SPLIT_K: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
                        HEADS_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr, QK_NORM: tl.constexpr, GDC: tl.constexpr):
    """_sum_splits of the q|k|v matmul, then fused_ops._rope_and_cache, in one program a token: the row's q, k and v
    heads summed and rounded as _sum_splits writes them, q and k rotated (QK_NORM: each head normed first) and
    written to out as _rope_and_cache leaves them there, v written to out, k and v to the cache at the token's slot.
    One launch and no [M, N] round trip instead of two, with their arithmetic."""
    chain_in(GDC)
    t = tl.program_id(0)
    d = tl.arange(0, HALF)
    h = tl.arange(0, HEADS_P2)
    dtype = out_ptr.dtype.element_ty
    c1, c2, s1, s2 = _cos_sin(cos_ptr + t * stride_ct, sin_ptr + t * stride_ct, d, HALF)
    head = h[:, None] * (2 * HALF) + d[None, :]  # a head's first half, from the heads' first column
    row = t.to(tl.int64) * N
    qm = (h < n_heads)[:, None]
    qa = _summed_heads(ws_ptr, b_ptr, row + head, head, M, N, qm, SPLIT_K, GROUP, HAS_BIAS, dtype)
    qb = _summed_heads(ws_ptr, b_ptr, row + head + HALF, head + HALF, M, N, qm, SPLIT_K, GROUP, HAS_BIAS, dtype)
    out_row = out_ptr + t.to(tl.int64) * stride_o
    _rotate_heads(qa.to(tl.float32), qb.to(tl.float32), out_row + head, qm, c1, c2, s1, s2, qw_ptr, q_eps, d, HALF,
                  QK_NORM)
    km = (h < n_kv_heads)[:, None]
    k_col = n_heads * 2 * HALF + head
    ka = _summed_heads(ws_ptr, b_ptr, row + k_col, k_col, M, N, km, SPLIT_K, GROUP, HAS_BIAS, dtype)
    kb = _summed_heads(ws_ptr, b_ptr, row + k_col + HALF, k_col + HALF, M, N, km, SPLIT_K, GROUP, HAS_BIAS, dtype)
    ra, rb = _rotate_heads(ka.to(tl.float32), kb.to(tl.float32), out_row + k_col, km, c1, c2, s1, s2, kw_ptr, k_eps,
                           d, HALF, QK_NORM)
    v_col = k_col + n_kv_heads * 2 * HALF
    va = _summed_heads(ws_ptr, b_ptr, row + v_col, v_col, M, N, km, SPLIT_K, GROUP, HAS_BIAS, dtype)
    vb = _summed_heads(ws_ptr, b_ptr, row + v_col + HALF, v_col + HALF, M, N, km, SPLIT_K, GROUP, HAS_BIAS, dtype)
    tl.store(out_row + v_col, va, mask=km)
    tl.store(out_row + v_col + HALF, vb, mask=km)
    _cache_row(kc_ptr, vc_ptr, slot_ptr + t, ra, rb, va, vb, h, d, km, stride_cb, stride_cs, stride_ch, HALF,
               BLOCK_SIZE)


@triton.jit
def _gate_up_steps(x_rows, g_rows, u_rows, row_ok, col_ok, K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """The gate and the up partials of a tile over all of K, in BLOCK_K steps, in order: for each, the loads and
    MMAs of _split_partial over all of K (an unsplit weight's one split), x's tile loaded once a step for both."""
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    return _gate_up_from(x_rows, g_rows, u_rows, row_ok, col_ok, 0, acc_g, acc_u, K, BLOCK_K, IEEE)


@triton.jit
def _gate_up_from(x_rows, g_rows, u_rows, row_ok, col_ok, first: tl.constexpr, acc_g, acc_u, K: tl.constexpr,
                  BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """acc_g and acc_u plus the gate and up products of the BLOCK_K steps from K column `first` on, in order, x's tile
    loaded once a step for both: the loop of _gate_up_steps and of _gate_up_steps_ahead."""
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(first, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = _k_tile(x_rows, row_ok, k, k_ok)
        acc_g = _mma(x, _k_tile(g_rows, col_ok, k, k_ok), acc_g, IEEE)
        acc_u = _mma(x, _k_tile(u_rows, col_ok, k, k_ok), acc_u, IEEE)
    return acc_g, acc_u


@triton.jit
def _gate_up_steps_ahead(x_rows, g_rows, u_rows, row_ok, col_ok, g0, g1, u0, u1, M, K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                         AHEAD: tl.constexpr):
    """_gate_up_steps with the first AHEAD (1-2) steps' gate and up tiles given (_weights_ahead): the same x tiles
    and MMAs in the same order from the same zeros (_zeros_at_run_time), the steps after them in the loop."""
    ks = tl.arange(0, BLOCK_K)
    acc_g = _zeros_at_run_time(M, BLOCK_M, BLOCK_N)
    acc_u = _zeros_at_run_time(M, BLOCK_M, BLOCK_N)
    x = _k_tile(x_rows, row_ok, ks, ks < K)
    acc_g = _mma(x, g0, acc_g, IEEE)
    acc_u = _mma(x, u0, acc_u, IEEE)
    if AHEAD > 1:
        x = _k_tile(x_rows, row_ok, ks + BLOCK_K, ks + BLOCK_K < K)
        acc_g = _mma(x, g1, acc_g, IEEE)
        acc_u = _mma(x, u1, acc_u, IEEE)
    return _gate_up_from(x_rows, g_rows, u_rows, row_ok, col_ok, AHEAD * BLOCK_K, acc_g, acc_u, K, BLOCK_K, IEEE)


@triton.jit(do_not_specialize=["M"])
def _fixed_tile_gate_up(x_ptr, w_ptr, b_ptr, out_ptr, M, I, stride_x, stride_w, stride_o, K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                        IEEE: tl.constexpr, GDC: tl.constexpr, AHEAD: tl.constexpr = 0):
    """out[M, I] = silu(x @ gate.T (+ b)) * (x @ up.T (+ b)) for w = gate | up [2I, K], the loader's packed gate_up,
    K not split: program (column tile, M tile) computes BLOCK_N gate columns and the same up columns as
    _fixed_tile_matmul computes each (from zero, all of K in BLOCK_K steps; the column tile does not order an
    element's sum: matmul_tile), rounds both, then SiLU and the product as _silu_mul_packed rounds them. The
    same bits as the matmul and _silu_mul_packed, without the [M, 2I] round trip and one launch fewer. AHEAD (1-2):
    the first AHEAD steps' gate and up tiles loaded before the chained wait, as _fixed_tile_matmul's."""
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % m_tiles
    pid_n = pid // m_tiles
    rows, cols, row_ok, col_ok, x_rows, g_rows = _tile(x_ptr, w_ptr, pid_m, pid_n, M, I, stride_x, stride_w,
                                                       BLOCK_M, BLOCK_N)
    u_rows = w_ptr + (cols + I).to(tl.int64)[:, None] * stride_w  # the up rows: I rows past the gate rows
    if AHEAD:
        g0, g1, _, _ = _weights_ahead(g_rows, col_ok, tl.arange(0, BLOCK_K), K, BLOCK_K, AHEAD)
        u0, u1, _, _ = _weights_ahead(u_rows, col_ok, tl.arange(0, BLOCK_K), K, BLOCK_K, AHEAD)
    chain_in(GDC)
    if AHEAD:
        acc_g, acc_u = _gate_up_steps_ahead(x_rows, g_rows, u_rows, row_ok, col_ok, g0, g1, u0, u1, M, K, BLOCK_M,
                                            BLOCK_N, BLOCK_K, IEEE, AHEAD)
    else:
        acc_g, acc_u = _gate_up_steps(x_rows, g_rows, u_rows, row_ok, col_ok, K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + I + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out, silu * up, mask=row_ok[:, None] & col_ok[None, :])


def mode_chained(x: torch.Tensor) -> bool:
    """Whether the mode's kernels for x chain by dependent launch (launch.py): on a device that has it, at any
    number of rows. A 1B decode step at batch 1 runs ~9 kernels a layer more than the default path's fused
    chain (norms, rotary, SiLU, split sums, unfused), and their launch gaps were most of the mode's ~350 us
    over the default (2026-12-04, H200). Every chained kernel waits for the one before it before touching
    memory, so the order of the stream holds; no arithmetic changes."""
    return x.shape[0] > 0 and dependent_launch_on(x.device)


@functools.cache
def _processors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's CPU interpreter
    return torch.cuda.get_device_properties(device).multi_processor_count


# Split-K: programs wanted at one M tile (a decode step), per multiprocessor (a 64x64 bf16 tile with 4 stages
# keeps ~32 KiB of weight loads in flight; HBM wants ~30 KiB an SM in flight, so two programs an SM keep it
# busy with room); and the fewest BLOCK_K steps a split walks (fewer leave its pipeline mostly fill and drain).
PROGRAMS_PER_SM = 2
MIN_SPLIT_STEPS = 4
# The fp32 workspace of one launch at most: longer inputs (prefill) run in launches of fewer rows.
WORKSPACE_BYTES = 64 << 20
SUM_BLOCK = 512  # columns a program of _sum_splits adds (a 2048-column row: 4 programs a row)


def splits_for(N: int, K: int, block_n: int, block_k: int, sms: int) -> int:
    """How many K splits for a weight of N x K: 1 where the column tiles alone give every multiprocessor a
    program; else enough for PROGRAMS_PER_SM programs an SM, each split at least MIN_SPLIT_STEPS steps of K.
    A function of the weight and the device only (never of M): a row's sum has the same splits at any batch."""
    n_tiles = triton.cdiv(N, block_n)
    if n_tiles >= sms:
        return 1
    steps = triton.cdiv(K, block_k)
    want = triton.cdiv(PROGRAMS_PER_SM * sms, n_tiles)
    return max(1, min(want, steps // MIN_SPLIT_STEPS))


# The rows a decode step of many sequences has (the batch the mode is tuned for besides one row): there a split
# weight's 128 x 128 output tiles take GROUPS partials each (groups_for), about one wave of programs.
GROUP_ROWS = 256


def groups_for(N: int, sms: int) -> int:
    """Partials a 128 x 128 output tile writes at GROUP_ROWS rows so that the programs make about one wave:
    1 where the tiles alone fill the multiprocessors (the 8B's qkv: 96 tiles), 2 for 4096 columns, 4 for 2048."""
    return max(1, sms // (triton.cdiv(GROUP_ROWS, 128) * triton.cdiv(N, 128)))


def split_order(N: int, K: int, block_n: int, block_k: int, sms: int) -> tuple[int, int]:
    """(SPLIT_K, GROUP): the K splits of a weight of N x K and how many consecutive splits make a group, their sums
    added in order before the groups are (_sum_splits). One row wants about splits_for's count, a program a split;
    many rows want groups_for's partials a tile, a program a group adding its splits in one loop. So the count is
    the multiple of the groups nearest splits_for's (ties up; each split at least MIN_SPLIT_STEPS steps), in groups of
    count / groups: on an H100 at 1 / 64 / 256 rows the 1B down's 8 in groups of 2 took 0.0157 / 0.0188 / 0.0256
    ms against 9 splits in order's 0.0156 / 0.0192 / 0.0423, the 8B down's 6 in groups of 3 0.0445 / 0.0501 /
    0.0659 against 5's 0.0451 / 0.0522 / 0.0944 (bits alike at every row count; 2026-12-05, binv-splits). A
    function of the weight and the device only. GROUP 1: every split in order (one group, or a split a group)."""
    splits = splits_for(N, K, block_n, block_k, sms)
    groups = min(groups_for(N, sms), splits)
    if splits == 1 or groups == 1:
        return splits, 1
    steps = triton.cdiv(K, block_k)
    most = max(groups, steps // MIN_SPLIT_STEPS // groups * groups)
    wanted = min(most, groups * max(1, (2 * splits + groups) // (2 * groups)))
    splits = triton.cdiv(steps, triton.cdiv(steps, wanted))  # as fixed_tile_matmul cuts K into whole steps
    if splits % groups or splits == groups:
        return splits, 1
    return splits, splits // groups


def unsplit_tile(N: int, K: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The tile before split-K (kept for bench/batch_invariant.py --sweep-tiles to compare): the widest column
    tile that still gives every multiprocessor a program at one M tile, each program walking all of K."""
    sms = _processors(device)
    block_n = 128
    while block_n > 32 and triton.cdiv(N, block_n) < sms:
        block_n //= 2
    fp32 = dtype == torch.float32
    return {"BLOCK_M": 64, "BLOCK_N": block_n, "BLOCK_K": 32 if fp32 else 64, "num_warps": 4,
            "num_stages": 3 if fp32 else 4, "SPLIT_K": 1}


# From this many rows a 16-bit matmul may take 128-row tiles on two warpgroups: at 256 rows the 64-row tile read
# each weight tile 4 times and ran at 0.4-0.6x cuBLAS (2026-12-04, H200).
WIDE_ROWS = 128
# The share of the multiprocessors the output tiles alone must give a program before a program adds its K
# splits itself (one wave of 128 programs on an H100's 132 SMs counts): below it the splits' own programs fill
# the GPU better, through the workspace.
FILL = 0.9
# From WIDE_ROWS rows on Hopper, an unsplit weight's 128-row tiles take this many columns where those still fill
# the GPU (3 stages: 144 KiB of shared memory a program): on an H200 at 256 rows the 1B's and 8B's gate_up took
# 0.82x and 0.81x, their LM heads 0.92x and 0.84x of the 128-column tile's time, and row 0 kept the bits the
# one-row tile gives it on all ten weights (2026-12-05, binv: Hopper's k16 MMA orders an element's sum the same
# at any N). Other GPUs keep 128 columns: neither their speed nor their bits were measured.
WIDE_COLUMNS = 256


@functools.cache
def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def matmul_tile(N: int, K: int, dtype: torch.dtype, device: torch.device, rows: int = 1) -> dict:
    """The tile for a weight of N x K. What orders an element's sum (BLOCK_K, SPLIT_K, GROUP) is a function of the
    weight and the device only. At one M tile, 128 columns where that alone gives every multiprocessor a
    program (lm_head, the 8B's gate_up), else 64 columns and K split (split_order) until the programs fill the
    GPU: a decode step's matmul is bound by reading the weight, by as many programs as run at once. Only how
    rows and columns are spread follows `rows`, and each way gives a row's element the same k16 MMAs and the
    same additions (tests/gpu/test_batch_invariant_gpu.py checks the bits):
    - 64 rows a program (one warpgroup MMA of Hopper's, m64), or 128 on two warpgroups from WIDE_ROWS in 16
      bits where the 128-row tiles still fill the GPU; then on Hopper an unsplit weight's 256 columns
      (WIDE_COLUMNS) where those still fill it;
    - the K splits through the workspace and _sum_splits (a program a split); from WIDE_ROWS rows, where the
      weight's 128 x 128 tiles leave the GPU idle (groups_for > 1), those tiles a program a group of splits
      (GROUPED: 1B down at 256 rows 0.0256 ms against 0.0423 for its splits in one loop, H100 2026-12-05); and
      once the output tiles alone fill the GPU (FILL), a program all of K: the splits in one loop (SERIAL,
      FLAT) where they are added in order, a group where in groups. At 256 rows on an H100 the one loop took
      0.70-0.87x of the workspace's time (1B qkv, o_proj; 8B qkv, o_proj, down) and 1.05x on the 1B down
      (2026-12-05, binv-gemm)."""
    sms = _processors(device)
    block_n = 128 if triton.cdiv(N, 128) >= sms else 64
    n_tiles = triton.cdiv(N, block_n)
    fp32 = dtype == torch.float32
    block_k = 32 if fp32 else 64

    def fills(block_m: int, columns: int = block_n) -> bool:
        return triton.cdiv(rows, block_m) * triton.cdiv(N, columns) >= FILL * sms

    splits, group = split_order(N, K, block_n, block_k, sms)
    stages = 3 if fp32 else 4
    if splits > 1 and groups_for(N, sms) > 1 and rows >= WIDE_ROWS and not fp32:
        # many rows of a weight whose tiles alone leave the GPU idle: 128-row tiles, a program a group of splits;
        # 128 columns on Hopper only (elsewhere the MMA's width was never shown not to order a sum: WIDE_COLUMNS)
        return {"BLOCK_M": 128, "BLOCK_N": 128 if _hopper(device) else block_n, "BLOCK_K": block_k,
                "num_warps": 8, "num_stages": stages,
                "SPLIT_K": splits, "GROUP": group, "SERIAL": False, "FLAT": False, "GROUPED": True}
    wide = rows >= WIDE_ROWS and not fp32 and fills(128)
    block_m = 128 if wide else 64
    # 16 bits only: in fp32 the serial tile needs 255 registers and spills (164 through the workspace). Where the
    # output tiles fill the GPU a program adds all the splits (in order) or, when they fall into groups, a group.
    alone = splits > 1 and not fp32 and fills(block_m)
    serial, grouped = alone and group == 1, alone and group > 1
    if wide and splits == 1 and _hopper(device) and fills(128, WIDE_COLUMNS):
        block_n, stages = WIDE_COLUMNS, 3
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 8 if wide else 4,
            "num_stages": stages, "SPLIT_K": splits, "GROUP": group, "SERIAL": serial, "FLAT": serial,
            "GROUPED": grouped}


def distinct_tiles(N: int, K: int, dtype: torch.dtype, device: torch.device, max_rows: int) -> list[tuple[int, dict]]:
    """Every tile matmul_tile gives a weight of N x K at 1..max_rows rows, each with the fewest rows that get it.
    matmul_tile follows the rows only through whole 64- and 128-row tiles and WIDE_ROWS, so only the first row
    of each 64 and WIDE_ROWS can bring a new one (every row of 1..8192 took 0.8 s of start-up for five weights)."""
    seen: dict[tuple, tuple[int, dict]] = {}
    for rows in sorted({*range(1, max_rows + 1, 64), min(WIDE_ROWS, max_rows)}):
        tile = matmul_tile(N, K, dtype, device, rows)
        seen.setdefault(tuple(sorted(tile.items())), (rows, tile))
    return list(seen.values())


def mode_weights(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The (weight, bias) pairs the mode's matmul multiplies, one per distinct shape, dtype and bias: each fused
    group's weight side by side (qkv_weight, gate_up_weight: fused_groups()), every other Linear (o_proj,
    down_proj, a router, a shared expert's gate), the LM head. Not the Linears of a fused group (their weights
    are views the matmul never takes alone), nor the experts' 3-D weights (the grouped GEMMs' own)."""
    found: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def add(weight, bias) -> None:
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            bias = bias if isinstance(bias, torch.Tensor) else None
            found.setdefault((tuple(weight.shape), weight.dtype, bias is not None), (weight, bias))

    grouped: set[int] = set()
    for module in model.modules():
        for group, members in getattr(module, "fused_groups", dict)().items():
            grouped.update(id(m) for m in members)
            add(getattr(module, f"{group}_weight", None), getattr(module, f"{group}_bias", None))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module) not in grouped:
            add(module.weight, module.bias)
    if hasattr(model, "output_weight"):
        add(model.output_weight(), None)
    return list(found.values())


@torch.inference_mode()
def warm_up(model: torch.nn.Module, max_rows: int) -> int:
    """Compile, at start-up, every variant of the mode's matmul a step of up to max_rows rows can meet (64- and
    128-row tiles, the workspace and its split sum or its sum with the norm or the rotary after it, the splits in one
    loop) for each weight shape, on zeros (the rotary's cache writes into NULL_BLOCK, which nothing reads):
    the decode graphs' capture reaches only the batches up to --max-num-seqs and the memory profile's prefill
    runs only without --kv-cache-memory, so a variant first met while serving stalled the engine for its
    compile (~1 s). Returns how many matmuls ran."""
    ran = 0
    packed = {id(w) for w in gate_up_weights(model)}
    attns = {id(m.qkv_weight): m for m in model.modules() if isinstance(getattr(m, "qkv_weight", None), torch.Tensor)}
    for weight, bias in mode_weights(model):
        N, K = weight.shape
        for rows, tile in distinct_tiles(N, K, weight.dtype, weight.device, max_rows):
            x = torch.zeros((rows, K), dtype=weight.dtype, device=weight.device)
            fixed_tile_matmul(x, weight, bias, tile=tile)
            ran += 1
            attn = attns.get(id(weight))
            if attn is not None and matmul_plan(rows, N, K, weight.dtype, weight.device, tile).through_workspace:
                # q|k|v's split sum with rotary and the cache write: every token at position 0, into NULL_BLOCK
                slots = torch.zeros(rows, dtype=torch.int64, device=weight.device)
                fixed_tile_matmul_rope(x, weight, bias, attn, model.rope_cos[slots], model.rope_sin[slots], slots)
                ran += 1
            if id(weight) in packed and tile.get("SPLIT_K", 1) == 1:  # its SiLU x up kernel (fixed_tile_gate_up)
                fixed_tile_gate_up(x, weight, bias, tile=tile)
                ran += 1
            if sums_to_norm(N, K, weight.dtype, weight.device):  # o_proj's, down's: the sum with the norm after it
                zeros = torch.zeros((rows, N), dtype=weight.dtype, device=weight.device)
                fixed_tile_matmul_add_rmsnorm(x, weight, bias, zeros, zeros[0] + 1, 1e-6)
                ran += 1
    return ran


def gate_up_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The packed gate | up weights (fused_groups()' gate_up) that fixed_tile_gate_up multiplies."""
    return [w for m in model.modules() if "gate_up" in getattr(m, "fused_groups", dict)()
            if isinstance(w := getattr(m, "gate_up_weight", None), torch.Tensor)]


@dataclass(frozen=True)
class MatmulPlan:
    """How fixed_tile_matmul computes a weight of N x K at M rows: the launch's tile (BLOCK_M/N/K, warps, stages) and
    how K is split and the splits added (matmul_tile's SPLIT_K, GROUP, SERIAL, FLAT, GROUPED, made whole: no split
    left empty, the ways the compiler would fold into another rounding turned off)."""

    tile: dict
    splits: int
    group: int
    chunk: int      # K columns a split walks, whole BLOCK_K steps (the last split's tail masked)
    serial: bool
    flat: bool
    grouped: bool

    @property
    def through_workspace(self) -> bool:
        """Whether the splits' partials go through the workspace and a second kernel adds them (which a caller may
        replace: fixed_tile_matmul's finish), rather than the matmul writing its output itself."""
        return self.splits > 1 and not self.serial


def matmul_plan(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device,
                tile: dict | None = None) -> MatmulPlan:
    """fixed_tile_matmul's plan for x [M, K] @ weight [N, K].T (tile: another than matmul_tile's)."""
    tile = dict(tile or matmul_tile(N, K, dtype, device, M))
    splits = tile.pop("SPLIT_K", 1)
    group = tile.pop("GROUP", 1)
    serial = tile.pop("SERIAL", False)
    flat = tile.pop("FLAT", False)
    grouped = tile.pop("GROUPED", False)
    block_k = tile["BLOCK_K"]
    # The splits' K range in whole BLOCK_K steps (the last split's tail masked); no split left empty.
    chunk = triton.cdiv(triton.cdiv(K, block_k), splits) * block_k
    splits = triton.cdiv(K, chunk)
    if splits % group:
        raise ValueError(f"{splits} K splits of {N} x {K} do not fall into groups of {group}")
    # A group of one split, or of all, is every split in order: what the serial programs add.
    linear = group in (1, splits)
    if serial and not linear:
        raise ValueError("a serial tile adds the splits in order: not in groups of " + str(group))
    # A split of one BLOCK_K step is no loop to Triton's compiler, which then folds `acc + dot(x, w, 0)` into
    # `dot(x, w, acc)`: another rounding than the workspace's (FLAT too: a reset every step leaves the partial a
    # constant zero). Serial only from two steps a split (the mode's tiles have at least MIN_SPLIT_STEPS); a
    # program a group likewise (else a program a split: the same sums).
    serial = serial and chunk >= 2 * block_k
    grouped = grouped and not linear and chunk >= 2 * block_k
    return MatmulPlan(tile, splits, group, chunk, serial, flat and serial and splits > 1, grouped)


# A chained one-row program's weight tiles loaded before its wait (AHEAD): at most this many bytes of registers (at
# 64 x 64 bf16 tiles on 4 warps, 16 registers a thread a tile), at most 4 steps.
AHEAD_BYTES = 32 << 10


def _ahead_limit(value: str) -> int:
    if value == "all":
        return 1 << 30
    if not value.isdigit():
        raise ValueError(f"SLEEPSERVE_WEIGHTS_AHEAD={value!r}: a number of K steps (0: never) or 'all'")
    return int(value)


# A program loads weight tiles ahead only where it walks at most SLEEPSERVE_WEIGHTS_AHEAD BLOCK_K steps (read once;
# "all": any, 0: never). Why 16 (H100, 12-06, decode tok/s of the mode at each limit, one machine): the 1B's batch-1
# step +8% at 16 (qkv 6 steps a program, o_proj 4, down 16), nothing more at 32 (gate|up), and the 8B's batch 1 / 64
# -3% / -6% at all (gate|up 64 steps, down 38): where a program walks many steps, what it saves before the wait is
# small and the registers it holds cost occupancy. `make gpu-check ARGS=binv-ahead` times the limits again.
AHEAD_MAX_STEPS = _ahead_limit(os.environ.get("SLEEPSERVE_WEIGHTS_AHEAD", "16"))


def steps_ahead(tile: dict, span: int, element_size: int, tiles_a_step: int = 1) -> int:
    """How many BLOCK_K steps of weight tiles a chained program of `tile` loads before its wait (the kernels' AHEAD):
    64-row tiles on 4 warps only (a few rows' tiles, whose programs each read little), AHEAD_BYTES of them, at most
    4 and at most the `span` (K columns) it walks."""
    if tile["BLOCK_M"] != 64 or tile["num_warps"] != 4:
        return 0
    step_bytes = tiles_a_step * tile["BLOCK_N"] * tile["BLOCK_K"] * element_size
    return min(4 // tiles_a_step, AHEAD_BYTES // step_bytes, span // tile["BLOCK_K"])


def ahead_for(tile: dict, span: int, element_size: int, chain: bool, tiles_a_step: int = 1) -> int:
    """steps_ahead for a chained launch whose programs walk at most AHEAD_MAX_STEPS K steps; else 0."""
    if not chain or triton.cdiv(span, tile["BLOCK_K"]) > AHEAD_MAX_STEPS:
        return 0
    return steps_ahead(tile, span, element_size, tiles_a_step)


def fixed_tile_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, tile: dict | None = None, finish=None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N] in x's dtype (into `out` when given, [M, N] with unit
    column stride): row i's bits depend on row i's values only. tile: another tile than matmul_tile's
    (bench/batch_invariant.py --sweep-tiles compares some; SPLIT_K defaults to 1, SERIAL and FLAT to False).

    With SPLIT_K > 1 each split writes an fp32 partial into a [SPLIT_K, rows, N] workspace, allocated here
    like any activation (inside a decode graph's capture it is the graph pool's, so the pool owns it), and
    _sum_splits adds splits 0..S-1 in order: no atomics, no host sync, the same sums at any number of rows.
    finish: for a plan through the workspace only (MatmulPlan.through_workspace), the kernel that adds the
    partials instead of _sum_splits and does what reads the output next with them (the norm: _sum_add_rmsnorm;
    rotary and the cache write: _sum_rope_and_cache): finish(ws, r0, rows, parts, group, chain) launches it for
    the rows r0..r0+rows of one launch, ws holding their `parts` partials [parts, rows, N], added in groups of
    `group` as _fold_splits adds them."""
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
    plan = matmul_plan(M, N, K, x.dtype, x.device, tile)
    tile, splits, group, chunk = plan.tile, plan.splits, plan.group, plan.chunk
    block_m = tile["BLOCK_M"]
    n_tiles = triton.cdiv(N, tile["BLOCK_N"])
    has_bias = bias is not None
    b = bias if has_bias else weight
    ieee = x.dtype == torch.float32
    chain = mode_chained(x)
    if not plan.through_workspace:
        if finish is not None:
            raise ValueError(f"a {N} x {K} weight's tile at {M} rows writes its output itself: no split sum to finish")
        grid = (n_tiles * triton.cdiv(M, block_m),)
        ahead = ahead_for(tile, K, x.element_size(), chain) if splits == 1 else 0
        _fixed_tile_matmul[grid](x, weight, b, out, M, N, x.stride(0), weight.stride(0), out.stride(0), K=K,
                                 SPLIT_K=splits, K_CHUNK=chunk, HAS_BIAS=has_bias, IEEE=ieee,
                                 SERIAL=splits > 1, FLAT=plan.flat, **gdc_launch(chain), **tile, AHEAD=ahead)
        return out
    # Partials a tile writes: one a split, or one a group (its splits added in its program, in order).
    parts = splits // group if plan.grouped else splits
    ahead = 0 if plan.grouped else ahead_for(tile, chunk, x.element_size(), chain)
    step = max(block_m, WORKSPACE_BYTES // (parts * N * 4) // block_m * block_m)  # rows a launch
    ws = torch.empty((parts * min(M, step) * N,), dtype=torch.float32, device=x.device)
    for r0 in range(0, M, step):  # a row's sums do not depend on its launch or its place in one
        xs, outs = x[r0:r0 + step], out[r0:r0 + step]
        rows = xs.shape[0]
        grid = (n_tiles * parts * triton.cdiv(rows, block_m),)
        _fixed_tile_matmul[grid](xs, weight, b, ws, rows, N, xs.stride(0), weight.stride(0), N, K=K,
                                 SPLIT_K=splits, K_CHUNK=chunk, HAS_BIAS=has_bias, IEEE=ieee, SERIAL=False,
                                 FLAT=False, GROUPED=group if plan.grouped else 1, **gdc_launch(chain), **tile,
                                 AHEAD=ahead)
        partial_group = 1 if plan.grouped else group
        if finish is not None:
            finish(ws, r0, rows, parts, partial_group, chain)
            continue
        _sum_splits[(rows * triton.cdiv(N, SUM_BLOCK),)](ws, b, outs, rows, N, outs.stride(0), SPLIT_K=parts,
                                                         BLOCK=SUM_BLOCK, HAS_BIAS=has_bias, GROUP=partial_group,
                                                         num_warps=4, **gdc_launch(chain))
    return out


@functools.cache
def sums_to_norm(N: int, K: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a weight of N x K goes through the workspace and a split sum at every number of rows (no tile
    writes its output itself: K split, and never added in one program, which only splits in order do, from enough
    rows, in 16 bits): then its output can be summed, added to the residual and normed in one launch
    (fixed_tile_matmul_add_rmsnorm) at every batch, which is what keeps a row's bits whatever the batch."""
    return all(t["SPLIT_K"] > 1 and not t["SERIAL"] for _, t in distinct_tiles(N, K, dtype, device, 1 << 16))


def fixed_tile_matmul_add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                  residual: torch.Tensor, norm_weight: torch.Tensor,
                                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TritonOps.add_rmsnorm(fixed_tile_matmul(x, weight, bias), residual, norm_weight, eps) for a weight that
    sums_to_norm: (the normed rows, x @ weight.T + residual), the split sum, the residual add and the norm one
    launch a row block instead of two. A decode step of the 1B ran 11 kernels a layer against the default's 5; this
    takes two of them (o_proj's and down's sums, each with the norm after it) out of every layer."""
    M, N = x.shape[0], weight.shape[0]
    residual = residual.contiguous()
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rout = torch.empty_like(out)
    has_bias = bias is not None

    def finish(ws, r0, rows, parts, group, chain):  # as TritonOps.add_rmsnorm launches its norm: a row a program
        _sum_add_rmsnorm[(rows,)](ws, bias if has_bias else weight, residual[r0:], norm_weight, out[r0:], rout[r0:],
                                  rows, N, eps, SPLIT_K=parts, BLOCK=triton.next_power_of_2(N), HAS_BIAS=has_bias,
                                  HAS_RESIDUAL=True, GROUP=group, num_warps=4 if N <= 4096 else 8,
                                  **gdc_launch(chain))

    fixed_tile_matmul(x, weight, bias, out, finish=finish)
    return out, rout


def fixed_tile_matmul_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, attn, cos: torch.Tensor,
                           sin: torch.Tensor, slots: torch.Tensor):
    """BatchInvariantTritonOps.qkv_heads of the q|k|v matmul x @ weight.T (+ bias): (q, k, v) as heads [T, heads,
    D], q and k rotated (Qwen3's heads normed first), k and v written to attn's cache at their slots. Where the
    weight's tile at these rows goes through the workspace, its split sum, rotary and the cache write are one launch
    (_sum_rope_and_cache: a program a token, the q|k|v row rounded as _sum_splits rounds it, then _rope_and_cache's
    arithmetic); else the matmul, then rope_and_cache. The same bits either way."""
    M, N, K = x.shape[0], weight.shape[0], weight.shape[1]
    if not matmul_plan(M, N, K, x.dtype, x.device).through_workspace:
        return heads_then_rope(BatchInvariantTritonOps, attn, split_qkv(attn, fixed_tile_matmul(x, weight, bias)),
                               cos, sin, slots)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    D = attn.head_dim
    H, KVH = attn.num_heads, attn.num_kv_heads
    k_cache, v_cache = attn.k_cache, attn.v_cache
    check_kernel_views(k_cache, v_cache)
    norms = attn.q_norm is not None
    qw, kw, q_eps, k_eps = ((attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, attn.k_norm.eps)
                            if norms else (cos, cos, 0.0, 0.0))
    has_bias = bias is not None

    def finish(ws, r0, rows, parts, group, chain):
        _sum_rope_and_cache[(rows,)](ws, bias if has_bias else weight, out[r0:], cos[r0:], sin[r0:], k_cache,
                                     v_cache, slots[r0:], qw, kw, q_eps, k_eps, rows, N, H, KVH, out.stride(0),
                                     cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                     SPLIT_K=parts, GROUP=group, HAS_BIAS=has_bias, HALF=D // 2,
                                     HEADS_P2=triton.next_power_of_2(max(H, KVH)), BLOCK_SIZE=k_cache.shape[1],
                                     QK_NORM=norms, num_warps=4, **gdc_launch(chain))

    fixed_tile_matmul(x, weight, bias, out, finish=finish)
    q, k, v = split_qkv(attn, out)
    return q.view(M, H, D), k.view(M, KVH, D), v.view(M, KVH, D)


def fixed_tile_gate_up(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       tile: dict | None = None) -> torch.Tensor:
    """silu(gate) * up of x [M, K] @ weight [2I, K].T (+ bias), weight the packed gate | up -> [M, I]: row i's bits
    depend on row i only, and are those of fixed_tile_matmul then SiLU x up. Where the weight's tile (matmul_tile)
    splits K the two stay two launches; else one (_fixed_tile_gate_up), each program half the tile's columns of
    gate and the same of up (as many programs as the matmul alone) where those are 64 or more wide, else the tile's
    64 of each (the widths whose bits were compared: 64, 128 and 256), and no [M, 2I] activation written and
    read back (at 256 rows, 8.4 MB a 1B layer, 14.7 MB an 8B one)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    I = weight.shape[0] // 2
    tile = dict(tile or matmul_tile(2 * I, K, x.dtype, x.device, M))
    chain = mode_chained(x)
    if tile.get("SPLIT_K", 1) > 1:
        return TritonOps.silu_mul_packed(fixed_tile_matmul(x, weight, bias, tile=tile), gdc=chain)
    if weight.stride(-1) != 1:
        raise ValueError("the weight's rows must be contiguous (K innermost)")
    out = torch.empty((M, I), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    for key in ("SPLIT_K", "SERIAL", "FLAT", "GROUP", "GROUPED"):
        tile.pop(key, None)
    if tile["BLOCK_N"] >= 128:
        tile["BLOCK_N"] //= 2
    grid = (triton.cdiv(I, tile["BLOCK_N"]) * triton.cdiv(M, tile["BLOCK_M"]),)
    _fixed_tile_gate_up[grid](x, weight, bias if bias is not None else weight, out, M, I, x.stride(0),
                              weight.stride(0), out.stride(0), K=K, HAS_BIAS=bias is not None,
                              IEEE=x.dtype == torch.float32, **gdc_launch(chain), **tile,
                              AHEAD=ahead_for(tile, K, x.element_size(), chain, tiles_a_step=2))
    return out


def attend_per_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, ctx, scale: float) -> torch.Tensor:
    """Every token of the step as a row of the paged decode kernel, one program per (token, KV head), never
    split: the K/V of the step are in the cache already (rope_and_cache wrote them)."""
    if ctx.prefills:
        tables, lens = token_layout(ctx, q.shape[0])
    else:  # a decode step (a CUDA graph's too): the decode rows are every token's rows already
        tables, lens = ctx.block_tables, ctx.context_lens
    return triton_decode_attention(q, k_cache, v_cache, tables, lens, scale, None, None, gdc=mode_chained(q))


@dataclass(frozen=True)
class Unsummed:
    """A split matmul's output left for the op that reads it next to add its splits (BatchInvariantTritonOps): o_proj's
    or down_proj's for the norm after them (linear_to_norm, add_rmsnorm: fixed_tile_matmul_add_rmsnorm), q|k|v's for
    rotary and the cache write (norm_qkv, qkv_heads: fixed_tile_matmul_rope). The matmul's input, weight and bias."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None


class BatchInvariantTritonOps(InvariantProjections, TritonOps):
    """TritonOps with the matmuls and attention above; the per-row kernels as they are, chained (mode_chained())."""

    name = "triton-batch-invariant"
    matmul = staticmethod(fixed_tile_matmul)

    @staticmethod
    def rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots, norms=None):
        return TritonOps.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots, norms, gdc=mode_chained(q))

    @classmethod
    def norm_qkv(cls, attn, norm, x: torch.Tensor, residual: torch.Tensor | None):
        """The input norm, then q|k|v left unsummed for qkv_heads, which adds its splits with the rotation where
        the weight's tile at these rows splits K (fixed_tile_matmul_rope)."""
        h, residual = norm(x, residual, cls)
        if not h.shape[0]:
            return cls.qkv(attn, h), residual
        return Unsummed(h, attn.qkv_weight, attn.qkv_bias), residual

    @classmethod
    def qkv_heads(cls, attn, qkv, cos, sin, slots):
        if isinstance(qkv, Unsummed):
            return fixed_tile_matmul_rope(qkv.x, qkv.weight, qkv.bias, attn, cos, sin, slots)
        return heads_then_rope(cls, attn, qkv, cos, sin, slots)

    @classmethod
    def linear_to_norm(cls, module: torch.nn.Linear, x: torch.Tensor):
        """o_proj and down_proj on one device, their output read by the next norm first (ops.py): for a weight that
        sums_to_norm, an Unsummed that add_rmsnorm finishes in one launch; else the matmul's output."""
        w = module.weight
        if x.shape[0] and sums_to_norm(w.shape[0], w.shape[1], x.dtype, x.device):
            return Unsummed(x, w, module.bias)
        return cls.linear(module, x)

    @staticmethod
    def add_rmsnorm(x, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    gdc: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Chained at any number of rows (mode_chained), whatever the caller's gdc. x an Unsummed (linear_to_norm):
        its matmul, split sum, residual add and norm (fixed_tile_matmul_add_rmsnorm)."""
        if isinstance(x, Unsummed):
            if residual is not None:
                return fixed_tile_matmul_add_rmsnorm(x.x, x.weight, x.bias, residual, weight, eps)
            x = fixed_tile_matmul(x.x, x.weight, x.bias)
        return TritonOps.add_rmsnorm(x, residual, weight, eps, gdc=mode_chained(x))

    @staticmethod
    def silu_mul_packed(gate_up: torch.Tensor) -> torch.Tensor:
        return TritonOps.silu_mul_packed(gate_up, gdc=mode_chained(gate_up))

    attend = staticmethod(attend_per_token)

    @staticmethod
    def gate_up_act(mlp, x: torch.Tensor) -> torch.Tensor:
        return fixed_tile_gate_up(x, mlp.gate_up_weight, mlp.gate_up_bias)

    @classmethod
    def moe(cls, x: torch.Tensor, block) -> torch.Tensor:
        return moe_invariant(x, block, cls.project)
