"""The sparse MLP on CUDA in Triton: routing, token grouping by expert, two grouped GEMMs, the combine.

    route       one program per token: softmax over the router's logits, the top k, renormalized (or not)
    align       the T*k (token, expert) assignments grouped by expert, each group padded to BLOCK_M rows:
                a histogram (atomics), one program's prefix sum (each block's expert, the padded total),
                then a scatter (atomics give each assignment its row in its group)
    (route and align are one program for a decode batch of up to SMALL_TOKENS tokens, _route_align_small:
    at batch 1 a layer's launches, not its bytes, are what a step waits for)
    gate|up     one grouped GEMM: each block of BLOCK_M rows is one expert's; it reads the expert's gate
                and up rows (w13) and writes silu(gate) * up, rounded as Hugging Face's bf16 layer rounds
    down        one grouped GEMM over w2, each row scaled by its routing weight
    combine     one program per token: the sum of its k rows, in order k = 0..k-1 (deterministic)

At batch 1 on Hopper the layer is one chain by dependent launch (launch.py), as the dense layers' kernels are:
the norm before it, the router's matmul (small_gemm), the one-program routing, both grouped GEMMs and the
combine each launch while the kernel before runs and wait for it in-kernel, so the layer's seven launches
cost no gaps between them.

Integers that change with the batch are not specialized on (do_not_specialize), and the one-program path's
register widths come in a few variants by the batch (route_align_widths), each compiled at start-up (warm_up):
the variants a start-up compiles are all serving meets.
Every size is fixed by the number of tokens (T*k assignments, at most T*k + min(E, T*k)*(BLOCK_M - 1) padded
rows): grids cover that worst case (max_blocks_for), blocks past the padded total (a device scalar) return at once, so nothing
waits for the host and a decode CUDA graph captures the whole layer at every batch size. The order of rows
inside a group depends on the atomics, but each row's arithmetic does not: results are deterministic.

The PyTorch reference is model/moe.py (experts_torch); tests/moe_cases.py checks these against it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.model.launch import chain_in, gdc_launch
from server.model.small_gemm import chained, small_gemm, small_rows


@triton.jit(do_not_specialize=["ids_stride"])  # K or layers x K (routed_experts.py): one compile for both
def _route(logits_ptr, ids_ptr, weights_ptr, E, stride, ids_stride, K: tl.constexpr, BLOCK_E: tl.constexpr,
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
    tl.store(ids_ptr + t * ids_stride + kk, top_i, mask=kk < K)
    tl.store(weights_ptr + t * K + kk, top_p, mask=kk < K)


@triton.jit(do_not_specialize=["T", "max_blocks", "ids_stride"])
def _route_align_small(logits_ptr, ids_ptr, weights_ptr, sorted_ptr, block_expert_ptr, padded_ptr, T, E, stride,
                       ids_stride, max_blocks, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_A: tl.constexpr, RENORM: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_B: tl.constexpr, GDC: tl.constexpr):
    """_route for each of T tokens, then the align step, in one program and registers: each assignment's row in
    its group is how many earlier ones (in token order) chose the same expert, so no atomics and no re-read.
    GDC: chained by dependent launch (launch.py), waiting for the router's logits before anything."""
    chain_in(GDC)
    e = tl.arange(0, BLOCK_E)
    kk = tl.arange(0, BLOCK_K)
    a = tl.arange(0, BLOCK_A)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    all_ids = tl.zeros([BLOCK_A], dtype=tl.int32)
    all_rank = tl.zeros([BLOCK_A], dtype=tl.int32)
    t = 0
    while t < T:
        x = tl.load(logits_ptr + t * stride + e, mask=e < E, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        top_p = tl.zeros([BLOCK_K], dtype=tl.float32)
        top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
        for k in tl.static_range(K):
            best = tl.max(p, axis=0)
            idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
            hit = e == idx
            rank = tl.sum(tl.where(hit, counts, 0), axis=0)
            counts += hit.to(tl.int32)
            top_p = tl.where(kk == k, best, top_p)
            top_i = tl.where(kk == k, idx, top_i)
            all_ids = tl.where(a == t * K + k, idx, all_ids)
            all_rank = tl.where(a == t * K + k, rank, all_rank)
            p = tl.where(hit, -1.0, p)
        if RENORM:
            top_p = top_p / tl.sum(tl.where(kk < K, top_p, 0.0), axis=0)
        if ROUND:
            top_p = top_p.to(logits_ptr.dtype.element_ty).to(tl.float32)
        tl.store(ids_ptr + t * ids_stride + kk, top_i, mask=kk < K)
        tl.store(weights_ptr + t * K + kk, top_p, mask=kk < K)
        t += 1
    M = T * K
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(padded_ptr, tl.sum(padded, axis=0))
    # Each group's padding rows, all at once ([experts, BLOCK_M], masked to the padding).
    j = tl.arange(0, BLOCK_M)
    pad_mask = (j[None, :] < (padded - counts)[:, None]) & (e < E)[:, None]
    tl.store(sorted_ptr + (starts + counts)[:, None] + j[None, :], tl.zeros([BLOCK_E, BLOCK_M], tl.int32) + M,
             mask=pad_mask)
    b0 = 0
    while b0 < max_blocks:
        b = b0 + tl.arange(0, BLOCK_B)
        expert = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.minimum(expert, E - 1), mask=b < max_blocks)
        b0 += BLOCK_B
    start_of = tl.sum(tl.where(all_ids[:, None] == e[None, :], starts[None, :], 0), axis=1)
    tl.store(sorted_ptr + start_of + all_rank, a, mask=a < M)


@triton.jit(do_not_specialize=["M"])
def _count(ids_ptr, counts_ptr, M, CHUNK: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < M
    e = tl.load(ids_ptr + offs, mask=mask, other=0)
    tl.atomic_add(counts_ptr + e, 1, mask=mask)


@triton.jit(do_not_specialize=["max_blocks"])
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


@triton.jit(do_not_specialize=["M"])
def _scatter(ids_ptr, cursor_ptr, sorted_ptr, M, CHUNK: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < M
    e = tl.load(ids_ptr + offs, mask=mask, other=0)
    row = tl.atomic_add(cursor_ptr + e, 1, mask=mask)
    tl.store(sorted_ptr + row, offs, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _grouped_gemm(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ptr, block_expert_ptr, padded_ptr,
                  M, N, stride_a, stride_be, stride_bn, stride_c, KDIM: tl.constexpr,
                  A_DIV: tl.constexpr, GATE_UP: tl.constexpr, WEIGHTED: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr):
    """C[row] = A[row // A_DIV] @ B[expert]^T for the rows of one block (one expert's). GATE_UP: B's rows
    [n, n + BLOCK_N) are gate and [N + n, ...) up, and C gets silu(gate) * up. WEIGHTED: scaled by the row's
    routing weight. Rows are assignment indices (token * k + slot); M marks padding. GDC: chained by dependent
    launch; every program waits before reading the grouping (which expert, hence which weights: nothing to
    load ahead), so even a grid whose every block is padding ends after the kernel before it."""
    chain_in(GDC)
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
def _combine(parts_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr, GDC: tl.constexpr):
    chain_in(GDC)
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = h < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(parts_ptr + (t * K + k).to(tl.int64) * H + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * H + h, acc.to(out_ptr.dtype.element_ty), mask=mask)


SMALL_TOKENS = 8  # up to this many tokens, routing and grouping are one program (_route_align_small)
# Its warps. At batch 1 that program is on a layer's critical path (6.2 us of a 30B-A3B layer on 4 warps, 0.30 ms
# a step, H100 2026-12-05), and it is reductions over 128 experts, each across warps a trip through shared
# memory: compiled for sm_90 the 4-warp program has 99 barriers, the 1-warp one 4 (its reductions in shuffles;
# 150 registers, no spills). Timed alone on the H200 (bench/moe.py's route_align_us, 2026-12-06): 6.0 us on one
# warp, 6.6 on two, 6.5 on four (~2 was predicted: the barriers were not its cost; route_align_widths's are).
ROUTE_WARPS = 1


def route(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool,
          round_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k] int32, weights [T, k] fp32): the router's matmul (cuBLAS), then one kernel."""
    return route_logits(torch.nn.functional.linear(x, gate), top_k, renormalize, round_weights)


def ids_into(routed: torch.Tensor | None, T: int, top_k: int, device: torch.device) -> torch.Tensor:
    """Where the routing kernels write a step's [T, top_k] int32 expert ids: the first T rows of the layer's
    routed-experts capture buffer when the server records them (SparseMoeBlock.routed: [max tokens, top_k], rows
    of unit column stride and a row stride of their own, routed_experts.py), so the ids land there from the
    routing program itself: no copy kernel a layer. At batch 1 that copy, an ordinary launch between two chained
    ones (launch.py), cost 0.75 ms of a 4.39 ms 30B-A3B step (H100, 12-05)."""
    if routed is None:
        return torch.empty((T, top_k), dtype=torch.int32, device=device)
    into = routed[:T]
    if into.shape != (T, top_k) or into.dtype != torch.int32 or into.stride(1) != 1:
        raise ValueError(f"routed ids go to [{T}, {top_k}] int32 rows, not {tuple(into.shape)} {into.dtype}")
    return into


def route_logits(logits: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool,
                 routed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts and their weights (ids written into the capture rows `routed`: ids_into)."""
    T, E = logits.shape
    ids = ids_into(routed, T, top_k, logits.device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    if T:
        _route[(T,)](logits, ids, weights, E, logits.stride(0), ids.stride(0), K=top_k,
                     BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k), RENORM=renormalize,
                     ROUND=round_weights, num_warps=1)
    return ids, weights


def tiles(M: int, N: int, E: int) -> dict[str, int]:
    """Block sizes by the assignments per expert: up to 16 on average (a decode batch: Qwen3-30B-A3B's 128
    experts at batch 256 get 16 each) take 16-row blocks, little padding, each expert's weights read about once;
    a prefill's take 64-row blocks. Starting points for bench/moe.py to tune on the H200."""
    if M <= 16 * E:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}
    return {"BLOCK_M": 64, "BLOCK_N": 128 if N >= 128 else 64, "BLOCK_K": 64}


def max_blocks_for(M: int, E: int, block_m: int) -> int:
    """The most blocks of block_m rows M assignments over E experts can fill once each expert's group is padded:
    at most min(E, M) groups are not empty and each pads fewer than block_m rows, so
    ceil((M + min(E, M) * (block_m - 1)) / block_m). The grouped GEMMs' grids are this many blocks: at batch 1
    (8 assignments, Qwen3-30B-A3B's 128 experts, 16-row blocks) 8 rather than the 121 of counting every expert,
    so a decode step launches 96 and 256 programs for its two GEMMs, not 1,452 and 3,872 that mostly exit."""
    return triton.cdiv(M + min(E, M) * (block_m - 1), block_m)


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted rows: assignment indices grouped by expert, each group padded with M to block_m rows;
    each block's expert; the padded total, a device scalar). Shapes depend on M only."""
    M = ids.numel()
    dev = ids.device
    max_blocks = max_blocks_for(M, num_experts, block_m)
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


def route_align_widths(T: int, top_k: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(BLOCK_A, BLOCK_B) of _route_align_small for T tokens: its assignments and its blocks, each the power of
    two at or above the batch's (T * top_k; max_blocks_for). Its [assignments, experts] and [blocks, experts] tiles
    are most of its instructions: at batch 1 of Qwen3-30B-A3B (8 and 8 against 64 and 64) the one-warp program
    compiles to 1,881 instructions after its wait instead of 3,773 (sm_90 PTX, 2026-12-06). A few variants up to
    SMALL_TOKENS tokens (four at top 8), all compiled at start-up (warm_up)."""
    M = T * top_k
    return triton.next_power_of_2(M), triton.next_power_of_2(max_blocks_for(M, num_experts, block_m))


def route_align_small(logits: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool, block_m: int,
                      gdc: bool = False, routed: torch.Tensor | None = None, num_warps: int = ROUTE_WARPS):
    """route_logits and align in one launch (a decode batch of up to SMALL_TOKENS tokens): (ids, weights,
    sorted rows, each block's expert, the padded total). gdc: chained by dependent launch (launch.py). routed:
    the capture rows the ids go to (ids_into). num_warps: ROUTE_WARPS; bench/moe.py times 1, 2 and 4."""
    T, E = logits.shape
    M = T * top_k
    dev = logits.device
    ids = ids_into(routed, T, top_k, dev)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    max_blocks = max_blocks_for(M, E, block_m)
    sorted_rows = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    padded = torch.empty(1, dtype=torch.int32, device=dev)
    block_a, block_b = route_align_widths(T, top_k, E, block_m)
    _route_align_small[(1,)](logits, ids, weights, sorted_rows, block_expert, padded, T, E, logits.stride(0),
                             ids.stride(0), max_blocks, K=top_k, BLOCK_E=triton.next_power_of_2(E),
                             BLOCK_K=triton.next_power_of_2(top_k), BLOCK_A=block_a, RENORM=renormalize,
                             ROUND=round_weights, BLOCK_M=block_m, BLOCK_B=block_b, num_warps=num_warps,
                             **gdc_launch(gdc))
    return ids, weights, sorted_rows, block_expert, padded


def moe(x: torch.Tensor, block) -> torch.Tensor:
    """A sparse layer (model/moe.py SparseMoeBlock) on CUDA: the router's matmul, routing and grouping (the ids
    written into the capture buffer when the server records them), the experts. A step of a few rows
    (small_gemm.chained) is one chain by dependent launch from the norm before to the norm after: the router
    through small_gemm, then the one-program routing, the grouped GEMMs and the combine, each launched before
    the one before ends (at batch 1 a layer's launches, not its bytes, are much of what a step waits for)."""
    w13, w2 = block.experts.w13_weight, block.experts.w2_weight
    gdc = chained(x)
    if small_rows(x):
        logits = small_gemm(x, block.gate.weight, gdc=gdc)[0]
    else:
        logits = torch.nn.functional.linear(x, block.gate.weight)
    T, K = x.shape[0], block.top_k
    cfg = tiles(T * K, max(w2.shape[1], w2.shape[2]), w13.shape[0])
    if 0 < T <= SMALL_TOKENS:
        ids, weights, *grouped = route_align_small(logits, K, block.norm_topk_prob, block.round_weights,
                                                   cfg["BLOCK_M"], gdc, block.routed)
    else:
        ids, weights = route_logits(logits, K, block.norm_topk_prob, block.round_weights, block.routed)
        grouped = list(align(ids, w13.shape[0], cfg["BLOCK_M"])) if T else []
    return experts(x, w13, w2, weights, grouped, K, cfg, gdc)


# --batch-invariant's one tile for every number of tokens: tiles() picks BLOCK_K (a row's order of summation)
# and BLOCK_M (16-row blocks, m16 MMAs, up to 16 assignments an expert; 64-row blocks, Hopper's m64 warpgroup
# MMAs, above) from the batch. Here 64 rows a block on one warpgroup at every batch: a decode step's blocks are
# mostly padding, the weights it reads the same.
INVARIANT_TILE = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}


def moe_invariant(x: torch.Tensor, block, project) -> torch.Tensor:
    """The sparse layer of the batch-invariant mode: the router's logits by `project` (the mode's fixed-tile
    matmul), one routing program per token (_route), grouping, and the grouped GEMMs and combine with
    INVARIANT_TILE whatever the batch. A row's place in its expert's blocks follows the atomics, its
    arithmetic does not; a token's k parts are added in slot order (_combine)."""
    w13, w2 = block.experts.w13_weight, block.experts.w2_weight
    ids, weights = route_logits(project(x, block.gate.weight), block.top_k, block.norm_topk_prob,
                                block.round_weights, block.routed)
    return fused_experts(x, w13, w2, ids, weights, INVARIANT_TILE)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, config: dict[str, int] | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k]; x [T, H], w13 [E, 2I, H],
    w2 [E, H, I] (contiguous), ids [T, k] int32, weights [T, k]."""
    K = ids.shape[1]
    cfg = config or tiles(ids.numel(), max(w2.shape[1], w2.shape[2]), w13.shape[0])
    grouped = list(align(ids, w13.shape[0], cfg["BLOCK_M"])) if x.shape[0] else []
    return experts(x, w13, w2, weights, grouped, K, cfg)


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, grouped: list,
            K: int, cfg: dict[str, int], gdc: bool = False) -> torch.Tensor:
    """The two grouped GEMMs and the combine, over assignments already grouped by expert (align). gdc: the
    three chained by dependent launch (launch.py)."""
    T, H = x.shape
    I = w2.shape[2]
    out = torch.empty_like(x)
    if T == 0:
        return out
    M = T * K
    x = x.contiguous()
    sorted_rows, block_expert, padded = grouped
    blocks = block_expert.numel()
    ieee = x.dtype == torch.float32
    act = torch.empty((M, I), dtype=x.dtype, device=x.device)
    flat_w = weights.reshape(-1)
    common = dict(IEEE=ieee, num_warps=4, **gdc_launch(gdc))
    _grouped_gemm[(blocks, triton.cdiv(I, cfg["BLOCK_N"]))](
        x, w13, act, flat_w, sorted_rows, block_expert, padded, M, I, x.stride(0), w13.stride(0), w13.stride(1),
        act.stride(0), KDIM=H, A_DIV=K, GATE_UP=True, WEIGHTED=False, **cfg, **common)
    parts = torch.empty((M, H), dtype=x.dtype, device=x.device)
    _grouped_gemm[(blocks, triton.cdiv(H, cfg["BLOCK_N"]))](
        act, w2, parts, flat_w, sorted_rows, block_expert, padded, M, H, act.stride(0), w2.stride(0), w2.stride(1),
        parts.stride(0), KDIM=I, A_DIV=1, GATE_UP=False, WEIGHTED=True, **cfg, **common)
    BLOCK_H = min(1024, triton.next_power_of_2(H))
    _combine[(T, triton.cdiv(H, BLOCK_H))](parts, out, H, K=K, BLOCK_H=BLOCK_H, num_warps=4, **gdc_launch(gdc))
    return out


def small_path_batches(num_experts: int, top_k: int) -> list[int]:
    """The fewest tokens that meet each variant of the one-program routing (route_align_widths) up to SMALL_TOKENS,
    at the decode tile's block rows (tiles())."""
    block_m = tiles(top_k, 1, num_experts)["BLOCK_M"]
    first: dict[tuple[int, int], int] = {}
    for T in range(1, SMALL_TOKENS + 1):
        first.setdefault(route_align_widths(T, top_k, num_experts, block_m), T)
    return sorted(first.values())


@torch.inference_mode()
def warm_up(model: torch.nn.Module) -> None:
    """Compile, at start-up, every variant of these kernels serving can meet, on the first sparse layer with
    scratch inputs: the one-program path, the separate routing kernels with 16-row tiles, and the 64-row
    tiles of a long prefill (the runner's own warm-up step is too short to reach them, and the memory profile
    runs only without --kv-cache-memory). Through the model's ops: in the batch-invariant mode its one tile,
    and its router's matmul at those rows (not the serial router variant of prefills of several thousand
    tokens, which compiles when one first comes)."""
    from server.model.moe import SparseMoeBlock

    block = next((m for m in model.modules() if isinstance(m, SparseMoeBlock)), None)
    if block is None:
        return
    w13 = block.experts.w13_weight
    E, H, K = w13.shape[0], w13.shape[2], block.top_k
    saved, block.routed = block.routed, None  # the capture buffer may be shorter than the long prefill here
    try:
        for T in (*small_path_batches(E, K), SMALL_TOKENS + 1, 16 * E // K + 1):
            model.ops.moe(torch.zeros((T, H), dtype=w13.dtype, device=w13.device), block)
    finally:
        block.routed = saved


__all__ = ["INVARIANT_TILE", "SMALL_TOKENS", "align", "fused_experts", "moe", "moe_invariant", "route",
           "route_align_small", "tiles", "warm_up"]
