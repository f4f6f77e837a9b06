"""The fused Triton ops, run by Triton's CPU interpreter against the PyTorch reference ops."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHECK = r"""
import torch
from server.model.fused_ops import TritonOps
from tests.fused_cases import check_all
print(check_all(TritonOps, torch.float32, "cpu", 1e-6))
print(check_all(TritonOps, torch.float16, "cpu", 2e-3))
"""


def test_fused_ops_match_reference_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", CHECK], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
