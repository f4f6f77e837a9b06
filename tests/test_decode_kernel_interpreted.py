"""The Triton paged-decode kernel, run by Triton's CPU interpreter against the PyTorch reference.
(The interpreter mishandles bf16 matmuls, so bf16 is checked on the GPU: tests/gpu.)"""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

pytest.importorskip("triton")

CHECK = r"""
import torch
from server.model.decode_kernel import triton_decode_attention
from tests.kernel_cases import random_case, relative_error
worst = {}
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
    for i, (B, H, KVH, D, BS, L) in enumerate([(5, 8, 2, 64, 16, 100), (3, 9, 3, 64, 16, 70),
                                               (4, 4, 4, 32, 8, 33), (2, 16, 2, 128, 32, 130)]):
        err = relative_error(triton_decode_attention, random_case(B, H, KVH, D, BS, L, dtype, "cpu", seed=i),
                             D ** -0.5)
        assert err < tol, f"{dtype} case {i}: relative error {err:.2e} over {tol:.0e}"
        worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err)
print(worst)
"""


def test_kernel_matches_reference_in_interpreter():
    run_interpreted(CHECK)
