"""Sampling and the sampled token's log-prob in one pass over each row of logits (CUDA, Triton).

The torch path (sampler.sample_on_device) makes about a dozen passes over [rows, vocab] float32 at
temperature 1 with logprobs=0, as RL rollouts ask: softmax, the noise, the division, argmax, then
log_softmax, nan_to_num, clamp, gather and a comparison for the rank. At 256 rows of a 128k vocabulary
each pass is 131 MB. Here two launches read the logits once for the draw and the log-sum-exp, and once
more for the rank (the count of larger logits) when log-probs are asked for: _race_chunks, one program per
chunk of a row, then _rank_chunks, which combines each row's chunks and counts.

The draw is the Gumbel-max trick, the same race as the torch path's argmax(p / E) with E ~ Exp(1):
argmax(logit / T - log(-log U)) with U uniform from Philox, keyed by a seed drawn from torch's default
generator each call (so torch.manual_seed makes runs repeat). (Like the torch path's, the noise's largest
values come from U near 1, in float32 steps of 2^-24.) Greedy rows (temperature 0) take
the argmax, the first of equal maxima as torch's argmax does. The log-prob is of the model's distribution
(the logits as given, before temperature), as the torch path and vLLM report it.

Not here (the torch path serves them): top-k, top-p, min-p, rows with their own seed, top log-probs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.random import philox, uint_to_uniform_float

from server.wire.outputs import LOGPROB_FLOOR
# Each row is cut into chunks of CHUNK columns, one program each (16 for a 128k vocabulary), so a few rows
# still spread over the device: the draw's random numbers and logarithms, not the bytes, bound a row.
# A chunk is 4 tiles of 4 quarters: one Philox call gives the 4 quarters' numbers.
CHUNK = 8192


@triton.jit
def _quarter(base, cols, u, vocab, greedy, inv_temp, m, s, best, best_col, WANT_TABLE: tl.constexpr):
    """Fold one quarter-tile of a row into each lane's running max and sum (log-sum-exp) and race. Lane-wise:
    a reduction across the program's warps per quarter cost more than the arithmetic (H200, 2026-12-02);
    _race_chunks reduces the lanes once at the end."""
    inside = cols < vocab
    x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
    if WANT_TABLE:
        # One exponential a column: exp(-|x - m|) rescales the sum when x is the new max, else is x's term.
        d = tl.exp(-tl.abs(x - m))
        s = tl.where(x == float("-inf"), s, tl.where(x > m, s * d + 1.0, s + d))
        m = tl.maximum(m, x)
    # + Gumbel noise; u = 0 (odds 2^-31) would make it -inf, and a row's one allowed token (a grammar's)
    # could then lose to a forbidden one
    score = tl.where(greedy, x, x * inv_temp - tl.log(-tl.log(tl.maximum(u, 1.0e-30))))
    score = tl.where(inside, score, float("-inf"))
    better = score > best  # strictly: a lane meets its columns in order, so it keeps the first of equal maxima
    return m, s, tl.where(better, score, best), tl.where(better, cols, best_col)


# The seed changes every call: specialised (Triton's default for integers: == 1, divisible by 16) it would
# compile new variants mid-serving.
@triton.jit(do_not_specialize=["seed"])
def _race_chunks(logits_ptr, stride_row, temps_ptr, seed, parts_ptr, table_ptr,
                 VOCAB: tl.constexpr, CHUNKS: tl.constexpr, WANT_TABLE: tl.constexpr, Q: tl.constexpr):
    """Program (row, chunk): the chunk's max and sum of exp (for the log-sum-exp) and its race winner, into
    parts[row, chunk] = (max, sum, best score, best column)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_row
    temp = tl.load(temps_ptr + row)
    greedy = temp == 0.0
    inv_temp = 1.0 / tl.where(greedy, 1.0, temp)
    q = tl.arange(0, Q)
    m = tl.full([Q], float("-inf"), tl.float32)
    s = tl.zeros([Q], tl.float32)
    best = tl.full([Q], float("-inf"), tl.float32)
    best_col = tl.zeros([Q], tl.int32)
    for tile in range(4):
        first = chunk * (16 * Q) + tile * (4 * Q)
        # Philox keyed by the call's 64-bit seed, counting (column / 4, row): no two rows or calls share noise.
        counter = (first // 4 + q).to(tl.uint32)
        r0, r1, r2, r3 = philox(seed, counter, counter * 0 + row.to(tl.uint32), counter * 0, counter * 0)
        u0, u1 = uint_to_uniform_float(r0), uint_to_uniform_float(r1)
        u2, u3 = uint_to_uniform_float(r2), uint_to_uniform_float(r3)
        m, s, best, best_col = _quarter(base, first + q, u0, VOCAB, greedy, inv_temp, m, s, best, best_col, WANT_TABLE)
        m, s, best, best_col = _quarter(base, first + Q + q, u1, VOCAB, greedy, inv_temp, m, s, best, best_col,
                                        WANT_TABLE)
        m, s, best, best_col = _quarter(base, first + 2 * Q + q, u2, VOCAB, greedy, inv_temp, m, s, best, best_col,
                                        WANT_TABLE)
        m, s, best, best_col = _quarter(base, first + 3 * Q + q, u3, VOCAB, greedy, inv_temp, m, s, best, best_col,
                                        WANT_TABLE)
    top = tl.max(best, 0)
    col = tl.min(tl.where(best == top, best_col, 2147483647), 0)  # the first of equal maxima, as torch's argmax
    if WANT_TABLE:
        chunk_max = tl.max(m, 0)
        shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)  # a chunk of -inf: no NaN
        total = tl.sum(s * tl.exp(m - shift), 0)
    else:
        chunk_max = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((), tl.float32)
    out = parts_ptr + (row * CHUNKS + chunk) * 4
    tl.store(out, chunk_max)
    tl.store(out + 1, total)
    tl.store(out + 2, top)
    tl.store(out + 3, col.to(tl.float32))  # exact: a column is below 2^24
    if WANT_TABLE and chunk == 0:
        tl.store(table_ptr + row * 3 + 2, 1.0)  # the rank: 1 + what _rank_chunks counts


@triton.jit
def _rank_chunks(logits_ptr, stride_row, parts_ptr, tokens_ptr, table_ptr, floor,
                 VOCAB: tl.constexpr, CHUNKS: tl.constexpr, PADDED_CHUNKS: tl.constexpr, WANT_TABLE: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Program (row, chunk): every program of a row combines the row's parts (a few dozen numbers) into its
    token and log-sum-exp; the chunk's count of larger logits is added to the rank; chunk 0 writes the
    token and its log-prob."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_row
    j = tl.arange(0, PADDED_CHUNKS)
    parts = parts_ptr + (row * CHUNKS + j) * 4
    there = j < CHUNKS
    best = tl.load(parts + 2, mask=there, other=float("-inf"))
    top = tl.max(best, 0)
    winner = tl.min(tl.where(best == top, j, PADDED_CHUNKS), 0)  # the first chunk: the first column
    token = tl.sum(tl.where(j == winner, tl.load(parts + 3, mask=there, other=0.0), 0.0), 0).to(tl.int32)
    if chunk == 0:
        tl.store(tokens_ptr + row, token.to(tl.int64))
    if WANT_TABLE:
        chosen = tl.load(base + token).to(tl.float32)
        if chunk == 0:
            pm = tl.load(parts, mask=there, other=float("-inf"))
            ps = tl.load(parts + 1, mask=there, other=0.0)
            m = tl.max(pm, 0)
            shift = tl.where(m == float("-inf"), 0.0, m)
            total = tl.sum(ps * tl.exp(pm - shift), 0)
            logprob = chosen - m - tl.log(total)
            logprob = tl.where(logprob == logprob, logprob, floor)  # NaN
            logprob = tl.minimum(tl.maximum(logprob, floor), 0.0)
            tl.store(table_ptr + row * 3, token.to(tl.float64))
            tl.store(table_ptr + row * 3 + 1, logprob.to(tl.float64))
        larger = tl.zeros((), tl.int32)
        for tile in range(4):
            cols = chunk * (4 * BLOCK) + tile * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
            larger += tl.sum((x > chosen).to(tl.int32), 0)
        tl.atomic_add(table_ptr + row * 3 + 2, larger.to(tl.float64))


def fused_sample(logits: torch.Tensor, temps: torch.Tensor, want_table: bool, chunk: int = CHUNK
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [N, V] (rows contiguous) in float32 or the model's dtype, read as float32 (a CUDA graph's
    bfloat16 logits need no conversion first: at 256 rows of a 128k vocabulary that pass took 95 us a step),
    temps [N] float32 on the same device (0: greedy).
    Returns the tokens [N] int64 and, with want_table, the log-prob table [N, 3] float64 laid out as
    sampler._logprob_table's with k = 0: token id, its log-prob, its rank (1 + how many logits are larger).
    chunk: columns per program, a power of two of at least 64 (tests take small ones to cross chunks on
    small rows)."""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(vocab, chunk)
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    table = torch.empty((n, 3), dtype=torch.float64, device=logits.device) if want_table else tokens
    if n:
        parts = torch.empty((n, chunks, 4), dtype=torch.float32, device=logits.device)
        # Drawn from torch's generator (torch.manual_seed repeats the draws), at least 2^62: always passed as
        # a 64-bit integer, one kernel variant.
        seed = int(torch.randint(0, 2 ** 62, (1,)).item()) | (1 << 62)
        _race_chunks[(n, chunks)](logits, logits.stride(0), temps, seed, parts, table,
                                  VOCAB=vocab, CHUNKS=chunks, WANT_TABLE=want_table, Q=chunk // 16, num_warps=4)
        _rank_chunks[(n, chunks if want_table else 1)](
            logits, logits.stride(0), parts, tokens, table, LOGPROB_FLOOR, VOCAB=vocab, CHUNKS=chunks,
            PADDED_CHUNKS=max(2, triton.next_power_of_2(chunks)), WANT_TABLE=want_table, BLOCK=chunk // 4,
            num_warps=4)
    return tokens, (table if want_table else None)


def warm_up(vocab: int, device: torch.device, model_dtype: torch.dtype) -> None:
    """Compile every variant (with and without the log-prob table; float32 logits, as an eager step gives
    them, and the model's dtype, as a CUDA graph does) at start-up: a compile met mid-serving stalls the
    engine for about a second."""
    temps = torch.tensor([0.0, 1.0], device=device)
    for dtype in {torch.float32, model_dtype}:
        logits = torch.zeros((2, vocab), dtype=dtype, device=device)
        for want_table in (False, True):
            fused_sample(logits, temps, want_table)
