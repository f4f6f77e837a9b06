"""The Triton kernel of model/finite.py's fused copy and check (imported only on CUDA)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_and_flag_kernel(src, dst, n, flag, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """dst[i] = src[i] for this program's ITERS blocks; flag |= 1 if any of them is NaN or +-Inf."""
    start = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    bad = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src + offs, mask=mask, other=0)
        tl.store(dst + offs, x, mask=mask)
        xf = x.to(tl.float32)
        bad = bad | ((xf != xf) | (tl.abs(xf) == float("inf"))).to(tl.int32)
    seen = tl.max(bad, 0)
    if seen > 0:
        tl.atomic_max(flag, seen)
