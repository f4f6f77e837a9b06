"""The small-batch matmul (server/model/small_gemm.py), run by Triton's CPU interpreter against the unfused ops."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

pytest.importorskip("triton")

CHECK = r"""
import torch
from tests.fused_cases import check_small_gemm
print(check_small_gemm(torch.float32, "cpu", 1e-5))
print(check_small_gemm(torch.float16, "cpu", 2e-3))  # (bfloat16 does not compute in the interpreter)
"""


def test_small_gemm_matches_the_unfused_ops_in_interpreter():
    run_interpreted(CHECK)
