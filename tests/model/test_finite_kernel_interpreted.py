"""The fused copy-and-check kernel of model/finite.py under Triton's CPU interpreter: it copies every element
and flags NaN, +Inf and -Inf wherever they sit (first, last, past a program's blocks), in each dtype."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

pytest.importorskip("triton")

CHECK = r"""
import torch
from server.model import finite
from server.model.finite_kernel import copy_and_flag_kernel

def flagged(src):
    dst = torch.full_like(src, 7)
    flag = torch.zeros(1, dtype=torch.int32)
    n = src.numel()
    per = finite.COPY_BLOCK * finite.COPY_ITERS
    copy_and_flag_kernel[((n + per - 1) // per,)](src.view(-1), dst.view(-1), n, flag,
                                                  BLOCK=finite.COPY_BLOCK, ITERS=finite.COPY_ITERS)
    d, s = dst.view(-1), src.view(-1)
    assert ((d == s) | (d.isnan() & s.isnan())).all(), "the copy lost bytes"
    return int(flag.item())

n = finite.COPY_BLOCK * finite.COPY_ITERS + 37  # two programs, the second one masked
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    good = torch.randn(n).to(dtype) * 100
    assert flagged(good) == 0, dtype
    for at in (0, n // 2, n - 1):
        for value in (float("nan"), float("inf"), float("-inf")):
            bad = good.clone()
            bad[at] = value
            assert flagged(bad) == 1, (dtype, at, value)
    big = torch.full((n,), torch.finfo(dtype).max, dtype=dtype)  # the largest finite value is finite
    assert flagged(big) == 0, dtype
print("ok")
"""


def test_copy_and_flag_copies_and_flags_in_interpreter():
    assert "ok" in run_interpreted(CHECK)
