"""The compiled fused ops on the GPU against the PyTorch reference, in bf16, fp16 and fp32."""
from __future__ import annotations

import pytest
import torch

from tests.model.fused_cases import check_all

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)])
def test_fused_ops_match_reference(dtype, tol):
    from server.model.fused_ops import TritonOps

    for seed in range(3):
        check_all(TritonOps, dtype, "cuda", tol, seed)
