"""The Triton kernel of model/finite.py's fused copy and check (imported only on CUDA)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _copy_blocks(src, dst, start, n, BLOCK: tl.constexpr, ITERS: tl.constexpr, MASKED: tl.constexpr):
    """dst <- src for ITERS blocks of BLOCK elements from `start` (MASKED: those before n only); per lane, 1
    where a value was NaN or +-Inf."""
    bad = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        if MASKED:
            x = tl.load(src + offs, mask=offs < n, other=0)
            tl.store(dst + offs, x, mask=offs < n)
        else:
            x = tl.load(src + offs)
            tl.store(dst + offs, x)
        xf = x.to(tl.float32)
        bad = bad | ((xf != xf) | (tl.abs(xf) == float("inf"))).to(tl.int32)
    return bad


@triton.jit(do_not_specialize=["n_tensors"])
def copy_and_flag_kernel(table, n_tensors, DTYPE: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                         SEARCH_STEPS: tl.constexpr, CHECK: tl.constexpr = True):
    """Copies many tensors of one dtype in one launch and flags each one that holds NaN or +-Inf.

    table: int64 [5, n_tensors + 1], rows: source address, destination address, elements, the first program of
    each tensor (cumulative; its last column is the grid's size), and the address of each tensor's int32 flag. A
    program finds its tensor by a binary search of the fourth row (SEARCH_STEPS >= log2(n_tensors) steps;
    finite.py rounds it up to 4, 8 or 16, so a dtype compiles one or two variants, not one per bucket size),
    copies its ITERS blocks of BLOCK elements and stores 1 in its tensor's flag only when it saw a bad value.
    A plain store, not an atomic: every program that writes writes the same 1, and the flags may be host memory
    mapped into the device (finite.py's host flags), where an atomic would need the bus to support it.

    Addresses read from memory tell the compiler nothing of their alignment: finite.py fuses only tensors whose
    both addresses are 16-byte aligned and says so here (tl.multiple_of), and a program whose blocks all lie
    inside its tensor copies them unmasked, so the loads and stores are 16 bytes a thread; only a tensor's last
    program masks (masked with an arbitrary length, the compiled copy fell to 2 bytes a thread).

    CHECK False: the copy alone (a receive with the check turned off), the flags' row unread."""
    pid = tl.program_id(0)
    width = n_tensors + 1
    lo = pid * 0
    hi = lo + n_tensors
    for _ in range(SEARCH_STEPS):  # keeps table[3, lo] <= pid < table[3, hi]; idle once hi = lo + 1
        mid = (lo + hi) // 2
        go = tl.load(table + 3 * width + mid) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    src = tl.multiple_of(tl.load(table + lo).to(tl.pointer_type(DTYPE)), 16)
    dst = tl.multiple_of(tl.load(table + width + lo).to(tl.pointer_type(DTYPE)), 16)
    n = tl.load(table + 2 * width + lo)
    start = (pid - tl.load(table + 3 * width + lo)) * BLOCK * ITERS
    if start + BLOCK * ITERS <= n:
        bad = _copy_blocks(src, dst, start, n, BLOCK, ITERS, MASKED=False)
    else:
        bad = _copy_blocks(src, dst, start, n, BLOCK, ITERS, MASKED=True)
    if CHECK:
        seen = tl.max(bad, 0)
        if seen > 0:
            tl.store(tl.load(table + 4 * width + lo).to(tl.pointer_type(tl.int32)), seen)
