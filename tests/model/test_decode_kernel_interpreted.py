"""The Triton paged-decode kernel, run by Triton's CPU interpreter against the PyTorch reference.
(The interpreter mishandles bf16 matmuls, so bf16 is checked on the GPU: tests/gpu.)"""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

pytest.importorskip("triton")

CHECK = r"""
from server.model.decode_kernel import triton_decode_attention
from testkit.kernel_cases import random_case, relative_error, worst_interpreted_errors
def error_of(case, dtype, seed):
    B, H, KVH, D, BS, L = case
    return relative_error(triton_decode_attention, random_case(B, H, KVH, D, BS, L, dtype, "cpu", seed=seed), D ** -0.5)
print(worst_interpreted_errors(error_of, [(5, 8, 2, 64, 16, 100), (3, 9, 3, 64, 16, 70), (4, 4, 4, 32, 8, 33),
                                          (2, 16, 2, 128, 32, 130)]))
"""

# The context split over programs (small batches): up to 6 splits of 128 tokens each at 700 tokens, combined
# by the last to finish; the first sequence of each case has 1 token (one split).
SPLIT_CHECK = r"""
import torch
from testkit.kernel_cases import random_case, relative_error, split_decode, worst_interpreted_errors
counts = torch.zeros(16, dtype=torch.int32)
def error_of(case, dtype, seed):
    B, H, KVH, D, BS, L = case
    return relative_error(split_decode(counts), random_case(B, H, KVH, D, BS, L, dtype, "cpu", seed=seed), D ** -0.5)
print(worst_interpreted_errors(error_of, [(2, 8, 2, 64, 16, 700), (2, 9, 3, 64, 32, 300)]))
"""


def test_kernel_matches_reference_in_interpreter():
    run_interpreted(CHECK)


def test_split_context_matches_reference_in_interpreter():
    run_interpreted(SPLIT_CHECK)
