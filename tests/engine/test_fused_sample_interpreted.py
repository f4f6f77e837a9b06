"""The fused sampler's Triton kernel (server/engine/fused_sample.py), run by Triton's CPU interpreter:
greedy rows as torch's argmax, log-probs and ranks as log_softmax's, draws that reach every chunk."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

pytest.importorskip("triton")

CHECK = r"""
from tests.engine.sampling_checks import check_draws_cover, check_greedy_and_table, check_model_dtype_reads_as_float32
# Chunks of 64 columns (the kernel's programs; 8192 on the GPU) so that small rows span several: the
# interpreter runs each program in Python (~60 ms each), so the draws' chi-square runs on the GPU only.
check_greedy_and_table("cpu", rows=4, vocab=200, chunk=64)
check_draws_cover("cpu", draws=60, vocab=130, chunk=64)
check_model_dtype_reads_as_float32("cpu", rows=3, vocab=150, chunk=64)
print("ok")
"""


def test_fused_sampler_in_interpreter():
    assert "ok" in run_interpreted(CHECK)
