"""The sparse MLP on CUDA in Triton: routing, token grouping by expert, two grouped GEMMs, the combine.

    route       one program per token: softmax over the router's logits, the top k, renormalized (or not)
    align       the T*k (token, expert) assignments grouped by expert, each group padded to BLOCK_M rows:
                a histogram (atomics), one program's prefix sum (each block's expert, the padded total),
                then a scatter (atomics give each assignment its row in its group)
    gate|up     one grouped GEMM: each block of BLOCK_M rows is one expert's; it reads the expert's gate
                and up rows (w13) and writes silu(gate) * up, rounded as Hugging Face's bf16 layer rounds
    down        one grouped GEMM over w2, each row scaled by its routing weight
    combine     one program per token: the sum of its k rows, in order k = 0..k-1 (deterministic)

Every size is fixed by the number of tokens (T*k assignments, at most T*k + E*(BLOCK_M - 1) padded rows):
grids cover the worst case and blocks past the padded total (a device scalar) return at once, so nothing
waits for the host and a decode CUDA graph captures the whole layer at every batch size. The order of rows
inside a group depends on the atomics, but each row's arithmetic does not: results are deterministic.

The PyTorch reference is model/moe.py (experts_torch); tests/moe_cases.py checks these against it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route(logits_ptr, ids_ptr, weights_ptr, E, stride, K: tl.constexpr, BLOCK_E: tl.constexpr,
           BLOCK_K: tl.constexpr, RENORM: tl.constexpr, ROUND: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    kk = tl.arange(0, BLOCK_K)
    top_p = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)  # the lowest id among equals
        top_p = tl.where(kk == k, best, top_p)
        top_i = tl.where(kk == k, idx, top_i)
        p = tl.where(e == idx, -1.0, p)
    if RENORM:
        top_p = top_p / tl.sum(tl.where(kk < K, top_p, 0.0), axis=0)
    if ROUND:  # Qwen3-MoE scales by weights rounded to the model dtype
        top_p = top_p.to(logits_ptr.dtype.element_ty).to(tl.float32)
    tl.store(ids_ptr + t * K + kk, top_i, mask=kk < K)
    tl.store(weights_ptr + t * K + kk, top_p, mask=kk < K)


@triton.jit
def _count(ids_ptr, counts_ptr, M, CHUNK: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < M
    e = tl.load(ids_ptr + offs, mask=mask, other=0)
    tl.atomic_add(counts_ptr + e, 1, mask=mask)


@triton.jit
def _offsets(counts_ptr, cursor_ptr, block_expert_ptr, padded_ptr, E, max_blocks,
             BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + e, ends - padded, mask=e < E)
    tl.store(padded_ptr, tl.sum(padded, axis=0))
    b0 = 0
    while b0 < max_blocks:  # (while, not range(): Triton's interpreter cannot iterate to a runtime bound)
        b = b0 + tl.arange(0, BLOCK_B)
        # A block's expert: how many groups end at or before its first row (empty groups included).
        expert = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.minimum(expert, E - 1), mask=b < max_blocks)
        b0 += BLOCK_B


@triton.jit
def _scatter(ids_ptr, cursor_ptr, sorted_ptr, M, CHUNK: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < M
    e = tl.load(ids_ptr + offs, mask=mask, other=0)
    row = tl.atomic_add(cursor_ptr + e, 1, mask=mask)
    tl.store(sorted_ptr + row, offs, mask=mask)


@triton.jit
def _grouped_gemm(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ptr, block_expert_ptr, padded_ptr,
                  M, N, stride_a, stride_be, stride_bn, stride_c, KDIM: tl.constexpr,
                  A_DIV: tl.constexpr, GATE_UP: tl.constexpr, WEIGHTED: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[row] = A[row // A_DIV] @ B[expert]^T for the rows of one block (one expert's). GATE_UP: B's rows
    [n, n + BLOCK_N) are gate and [N + n, ...) up, and C gets silu(gate) * up. WEIGHTED: scaled by the row's
    routing weight. Rows are assignment indices (token * k + slot); M marks padding."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < M
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    a_rows = (rows // A_DIV).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # KDIM is the model's (H, then I): a constexpr bound, which Triton pipelines (and its interpreter can walk).
    for k0 in range(0, KDIM, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < KDIM
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + offs_k[None, :], mask=valid[:, None] & k_mask[None, :],
                    other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(b_base + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None], mask=b_mask, other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        if GATE_UP:
            up = tl.load(b_base + (offs_n[None, :] + N).to(tl.int64) * stride_bn + offs_k[:, None], mask=b_mask,
                         other=0.0)
            if IEEE:
                acc_up += tl.dot(a, up, input_precision="ieee")
            else:
                acc_up += tl.dot(a, up)
    dtype = c_ptr.dtype.element_ty
    if GATE_UP:  # as Hugging Face rounds: gate and up in the model dtype, silu(gate) rounded, times up
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = silu * acc_up.to(dtype).to(tl.float32)
    if WEIGHTED:
        w = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        acc = acc.to(dtype).to(tl.float32) * w[:, None]
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_c + offs_n[None, :], acc.to(dtype),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _combine(parts_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = h < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(parts_ptr + (t * K + k).to(tl.int64) * H + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * H + h, acc.to(out_ptr.dtype.element_ty), mask=mask)


def route(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool,
          round_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k] int32, weights [T, k] fp32): the router's matmul (cuBLAS), then one kernel."""
    logits = torch.nn.functional.linear(x, gate)
    T, E = logits.shape
    ids = torch.empty((T, top_k), dtype=torch.int32, device=x.device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    if T:
        _route[(T,)](logits, ids, weights, E, logits.stride(0), K=top_k, BLOCK_E=triton.next_power_of_2(E),
                     BLOCK_K=triton.next_power_of_2(top_k), RENORM=renormalize, ROUND=round_weights, num_warps=1)
    return ids, weights


def tiles(M: int, N: int) -> dict[str, int]:
    """Block sizes by the number of assignments: a decode batch's few rows per expert take 16-row blocks (little
    padding, the weights read once per block); a prefill's take 64. Starting points for bench/moe.py to tune."""
    if M <= 1024:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}
    return {"BLOCK_M": 64, "BLOCK_N": 128 if N >= 128 else 64, "BLOCK_K": 64}


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted rows: assignment indices grouped by expert, each group padded with M to block_m rows;
    each block's expert; the padded total, a device scalar). Shapes depend on M only."""
    M = ids.numel()
    dev = ids.device
    max_rows = M + num_experts * (block_m - 1)
    max_blocks = triton.cdiv(max_rows, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    padded = torch.empty(1, dtype=torch.int32, device=dev)
    sorted_rows = torch.full((max_blocks * block_m,), M, dtype=torch.int32, device=dev)
    flat = ids.reshape(-1)
    CHUNK = 256
    grid = (triton.cdiv(M, CHUNK),)
    _count[grid](flat, counts, M, CHUNK=CHUNK, num_warps=4)
    _offsets[(1,)](counts, cursor, block_expert, padded, num_experts, max_blocks, BLOCK_M=block_m,
                   BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_B=64, num_warps=4)
    _scatter[grid](flat, cursor, sorted_rows, M, CHUNK=CHUNK, num_warps=4)
    return sorted_rows, block_expert, padded


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, config: dict[str, int] | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k]; x [T, H], w13 [E, 2I, H],
    w2 [E, H, I] (contiguous), ids [T, k] int32, weights [T, k]."""
    T, H = x.shape
    E, I = w13.shape[0], w2.shape[2]
    K = ids.shape[1]
    out = torch.empty_like(x)
    if T == 0:
        return out
    M = T * K
    x = x.contiguous()
    cfg = config or tiles(M, max(I, H))
    bm = cfg["BLOCK_M"]
    sorted_rows, block_expert, padded = align(ids, E, bm)
    blocks = block_expert.numel()
    ieee = x.dtype == torch.float32
    act = torch.empty((M, I), dtype=x.dtype, device=x.device)
    flat_w = weights.reshape(-1)
    common = dict(IEEE=ieee, num_warps=4)
    _grouped_gemm[(blocks, triton.cdiv(I, cfg["BLOCK_N"]))](
        x, w13, act, flat_w, sorted_rows, block_expert, padded, M, I, x.stride(0), w13.stride(0), w13.stride(1),
        act.stride(0), KDIM=H, A_DIV=K, GATE_UP=True, WEIGHTED=False, **cfg, **common)
    parts = torch.empty((M, H), dtype=x.dtype, device=x.device)
    _grouped_gemm[(blocks, triton.cdiv(H, cfg["BLOCK_N"]))](
        act, w2, parts, flat_w, sorted_rows, block_expert, padded, M, H, act.stride(0), w2.stride(0), w2.stride(1),
        parts.stride(0), KDIM=I, A_DIV=1, GATE_UP=False, WEIGHTED=True, **cfg, **common)
    BLOCK_H = min(1024, triton.next_power_of_2(H))
    _combine[(T, triton.cdiv(H, BLOCK_H))](parts, out, H, K=K, BLOCK_H=BLOCK_H, num_warps=4)
    return out


__all__ = ["align", "fused_experts", "route", "tiles"]
