"""The matmuls of a small decode batch (a few rows) on the CUDA cores, with the work around them folded in.

At batch 1 a matmul reads its whole weight to produce one row: it is bound by the weight's bytes, and what
it loses against the HBM's rate is the time its loads take to start (ramp-up) and the kernel boundaries
around it (the norm before it, SiLU × up after it, each a launch). One kernel here does:

    out = epilogue( norm(x + residual) @ W.T + bias )

- NORM: the residual add and RMSNorm of the layer before the matmul (every program recomputes the row's
  mean square from x: a few KB from L2); program 0 also writes the residual sum out.
- SILU: W holds gate | up rows (the loader's packed gate_up); a program computes the same rows of both and
  writes silu(gate) × up, so the activation costs no launch and no [T, 2I] round trip.
- GDC (programmatic dependent launch, Hopper and newer): the kernel is launched before the one it follows
  has finished. It issues the loads of its first chunk of weights first (weights never depend on the kernel
  before; at K <= 2048, or 4096, that is all of a program's weights), then waits
  for that kernel (griddepcontrol.wait) before it reads x or writes anything, so the weight stream overlaps
  the previous kernel's tail and the launch gap. It lets the next kernel launch at once: every kernel of
  a chain waits for its predecessor's completion before writing, so the order is kept transitively.

Rounding follows the unfused ops (TorchOps): the residual sum and the normed row are rounded to the model
dtype before the matmul, the matmul accumulates in fp32 and rounds once, and SiLU × up rounds as
silu_mul_packed does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.model.launch import chain_in, dependent_launch_on, gdc_launch


@triton.jit
def _in_row(k, K: tl.constexpr, EVEN: tl.constexpr):
    """Which of the columns k lie in a row of K. EVEN (chunks divide K): all of them, a mask the compiler
    sees as constant, so the loads it guards stay vectorized."""
    if EVEN:
        ok = k >= 0
    else:
        ok = k < K
    return ok


@triton.jit
def _load_x(x_ptr, r_ptr, rout_ptr, m, M, k, K: tl.constexpr, EVEN: tl.constexpr, stride_x, stride_r,
            stride_ro, pid, RESIDUAL: tl.constexpr, WRITE: tl.constexpr):
    """Row m's chunk k of the matmul's input: x, or x + residual rounded to x's dtype (written out by
    program 0 when WRITE). Rows past M and columns past K read as zeros."""
    ok = _in_row(k, K, EVEN) & (m < M)
    x = tl.load(x_ptr + m * stride_x + k, mask=ok, other=0.0)
    if RESIDUAL:
        x = x + tl.load(r_ptr + m * stride_r + k, mask=ok, other=0.0)
        if WRITE:
            tl.store(rout_ptr + m * stride_ro + k, x, mask=ok & (pid == 0))
    return x


@triton.jit
def _small_gemm(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, rout_ptr, M, N, eps, stride_x, stride_r, stride_ro,
                stride_o, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
                GDC: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k = tl.arange(0, BLOCK_K)
    CHUNKS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K  # the last one masked when BLOCK_K does not divide K
    # The first chunk of weights first: it does not depend on the kernel before (see GDC above). Streamed
    # once, marked to leave L2 first, so that the activations stay there.
    w_rows = w_ptr + n[:, None].to(tl.int64) * K + k[None, :]
    EVEN: tl.constexpr = K % BLOCK_K == 0
    w_ok = n_ok[:, None] & _in_row(k, K, EVEN)[None, :]
    w0 = tl.load(w_rows, mask=w_ok, other=0.0, eviction_policy="evict_first")
    if SILU:
        u_rows = w_rows + N.to(tl.int64) * K
        u0 = tl.load(u_rows, mask=w_ok, other=0.0, eviction_policy="evict_first")
    chain_in(GDC)
    rows = tl.arange(0, ROWS)
    if NORM:  # each row's 1 / rms, from the whole row (x + residual, as the matmul will read it)
        inv = tl.zeros([ROWS], tl.float32)
        for m in tl.static_range(ROWS):
            sq = tl.zeros([BLOCK_K], tl.float32)
            for c in tl.static_range(CHUNKS):
                h = _load_x(x_ptr, r_ptr, rout_ptr, m, M, c * BLOCK_K + k, K, EVEN, stride_x, stride_r, stride_ro, pid,
                            RESIDUAL, True).to(tl.float32)
                sq += h * h
            inv = tl.where(rows == m, 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps), inv)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    if SILU:
        acc_u = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for c in tl.static_range(CHUNKS):
        if c == 0:
            w = w0.to(tl.float32)
            if SILU:
                u = u0.to(tl.float32)
        else:
            if not EVEN:
                w_ok = n_ok[:, None] & _in_row(c * BLOCK_K + k, K, EVEN)[None, :]
            w = tl.load(w_rows + c * BLOCK_K, mask=w_ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if SILU:
                u = tl.load(u_rows + c * BLOCK_K, mask=w_ok, other=0.0, eviction_policy="evict_first")
                u = u.to(tl.float32)
        for m in tl.static_range(ROWS):
            xs = _load_x(x_ptr, r_ptr, rout_ptr, m, M, c * BLOCK_K + k, K, EVEN, stride_x, stride_r, stride_ro, pid,
                         RESIDUAL, not NORM)
            if NORM:
                inv_m = tl.sum(tl.where(rows == m, inv, 0.0), axis=0)
                if EVEN:
                    nw = tl.load(nw_ptr + c * BLOCK_K + k)
                else:
                    nw = tl.load(nw_ptr + c * BLOCK_K + k, mask=_in_row(c * BLOCK_K + k, K, EVEN), other=0.0)
                xs = nw * (xs.to(tl.float32) * inv_m).to(xs.dtype)
            xf = xs.to(tl.float32)[None, :]
            acc += tl.where(rows[:, None] == m, tl.sum(w * xf, axis=1)[None, :], 0.0)
            if SILU:
                acc_u += tl.where(rows[:, None] == m, tl.sum(u * xf, axis=1)[None, :], 0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc_u += tl.load(b_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype)
    if SILU:
        g = out.to(tl.float32)
        out = (g / (1.0 + tl.exp(-g))).to(dtype) * acc_u.to(dtype)
    tl.store(out_ptr + rows[:, None] * stride_o + n[None, :], out, mask=(rows < M)[:, None] & n_ok[None, :])


# Up to this many rows a matmul runs here (and its neighbours chain by dependent launch). bench/small_gemm.py
# on the H200 (2026-12-02), a layer's four matmuls with their norms and SiLU, each op at its best tile, against
# cuBLAS with the unfused kernels: at 1 row 1.45x faster (1B shape: 49.8 -> 34.5 us) and 1.19x (8B: 124.1 ->
# 104.1 us); at 2 rows 1.04x (1B) but 0.76x (8B), and slower on both from 4 rows.
SMALL_ROWS = 1


def small_rows(x: torch.Tensor) -> bool:
    return 0 < x.shape[0] <= SMALL_ROWS


def chained(x: torch.Tensor) -> bool:
    """Whether the kernels of a step of x's rows chain by dependent launch (launch.py): a small batch on a
    device that has it."""
    return small_rows(x) and dependent_launch_on(x.device)


def default_tile(K: int, silu: bool) -> dict:
    """4 weight rows a program (gate and up count as two each), 4 warps, the row in 2048-element chunks, or
    whole at K = 4096. From bench/small_gemm.py's sweep on the H200 (2026-12-02): within 8% of the best tile
    of each matmul of the 1B and 8B shapes at one row, 3% on average."""
    return {"block_n": 2 if silu else 4, "num_warps": 4, "block_k_cap": 4096 if K == 4096 else 2048}


def block_k(K: int, cap: int = 2048) -> int:
    """K is walked in chunks of this many elements: a power of two up to cap (the last chunk masked when it
    does not divide K; 14336 = 7 x 2048, 576 is one masked chunk of 1024)."""
    return min(cap, triton.next_power_of_2(K))


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               silu: bool = False, gdc: bool = False, out: torch.Tensor | None = None,
               block_n: int | None = None, block_k_cap: int | None = None,
               num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """epilogue(norm(x + residual) @ weight.T + bias) for x [M, K] of a few rows. Returns (out, x + residual),
    the sum None without a residual. silu: weight is [2I, K] (gate | up) and out [M, I]. out: where to write
    (contiguous rows). The tile defaults to default_tile's."""
    M, K = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous() and weight.shape[1] == K
    N = weight.shape[0] // 2 if silu else weight.shape[0]
    tile = default_tile(K, silu)
    block_n, block_k_cap, num_warps = (block_n or tile["block_n"], block_k_cap or tile["block_k_cap"],
                                       num_warps or tile["num_warps"])
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.stride(1) == 1
    rout = torch.empty((M, K), dtype=x.dtype, device=x.device) if residual is not None else x
    r = residual if residual is not None else x
    assert r.stride(1) == 1
    bk = block_k(K, block_k_cap)
    _small_gemm[(triton.cdiv(N, block_n),)](
        x, r, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, out, rout, M, N, eps, x.stride(0), r.stride(0), rout.stride(0),
        out.stride(0),
        K=K, BLOCK_N=block_n, BLOCK_K=bk, ROWS=triton.next_power_of_2(M), NORM=norm_weight is not None,
        RESIDUAL=residual is not None, SILU=silu, HAS_BIAS=bias is not None, num_warps=num_warps,
        **gdc_launch(gdc))
    return out, (rout if residual is not None else None)
