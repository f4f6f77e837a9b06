"""The fused Triton ops, run by Triton's CPU interpreter against the PyTorch reference ops."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

pytest.importorskip("triton")

CHECK = r"""
import torch
from server.model.fused_ops import TritonOps
from tests.model.fused_cases import check_all
print(check_all(TritonOps, torch.float32, "cpu", 1e-6))
print(check_all(TritonOps, torch.float16, "cpu", 2e-3))
"""


def test_fused_ops_match_reference_in_interpreter():
    run_interpreted(CHECK)


MODEL_CHECK = r"""
import tempfile
from pathlib import Path
from testkit.models import model_folder
from server import LLM
from tests.model.fused_cases import whole_model_error
llm = LLM(model=str(model_folder("llama-tiny", Path(tempfile.mkdtemp()))), device="cpu", load_format="dummy",
          kv_cache_memory="32MiB")
attn = llm.engine.model.model.layers[0].self_attn
# The loader laid q|k|v out side by side: the checkpoint's parameters are views of one tensor.
assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
assert attn.k_proj.weight.data_ptr() == attn.qkv_weight[attn.q_proj.weight.shape[0]:].data_ptr()
err = whole_model_error(llm)
assert err < 1e-5, err
err = whole_model_error(llm, prompt_len=1)  # one row: the small-batch matmuls (small_gemm.py)
assert err < 1e-5, err
"""


def test_whole_model_with_fused_ops_matches_the_pytorch_ops():
    run_interpreted(MODEL_CHECK)
