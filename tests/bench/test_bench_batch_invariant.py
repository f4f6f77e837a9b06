"""bench/batch_invariant.py's CPU smoke run (--small): both modes decode on one tiny model, the table and JSON
say each batch's tok/s and ratio (the H200 run is the one whose figures count)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.interpreter import ROOT


def test_small_run_reports_both_modes_and_their_ratio(tmp_path):
    res = subprocess.run([sys.executable, "bench/batch_invariant.py", "--small", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stderr[-3000:]
    printed = json.loads(res.stdout.strip().splitlines()[-1])
    saved = json.loads((tmp_path / "batch_invariant_small.json").read_text())
    assert printed == saved
    assert [(r["model"], r["batch"]) for r in saved["rows"]] == [("llama-micro", 1), ("llama-micro", 4)]
    for r in saved["rows"]:
        assert r["default_tok_s"] > 0 and r["batch_invariant_tok_s"] > 0
        assert r["ratio"] == r["batch_invariant_tok_s"] / r["default_tok_s"]
    assert "| ratio |" in res.stdout


# The GEMM table's FLAT candidates (CUDA-only in the bench) through the Triton interpreter: a shape whose K
# splits on the interpreter's 4 "multiprocessors" (N 128 < 4 x 64 columns, K 512: 2 splits) for qkv, gate_up
# and lm_head; every timing stubbed (CUDA graphs time them on the GPU; the interpreter's times mean nothing), and
# the interpreter's bf16 dot multiplies bit patterns as integers: meaningless values, but the bits still compare.
GEMM_TABLE = r"""
import torch
import bench.batch_invariant as bench
from testkit.models import CONFIGS
CONFIGS["split-probe"] = dict(hidden_size=512, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=32, vocab_size=128, tie_word_embeddings=True)
bench.REPS = 1
bench.graph_ms = lambda fn, device, replays=10, per_replay=1: 1.0
gemms = bench.gemm_rows("split-probe", torch.device("cpu"), [1])
flat = [g for g in gemms if "flat_ms" in g]
assert [g["gemm"] for g in flat] == ["qkv", "gate_up", "lm_head"], [g["gemm"] for g in gemms]
for g in flat:
    assert g["tile"]["SPLIT_K"] == 2 and list(g["flat_ms"]) == ["flat m64", "flat m128"], g
    assert g["flat_same_bits"] == {"flat m64": True, "flat m128": True}, g
print(bench.flat_table(flat))
# At WIDE_ROWS rows the wide candidates too, each with whether it gave row 0 the one-row tile's bits.
from server.model.batch_invariant_kernels import WIDE_ROWS
wide = [g for g in bench.gemm_rows("split-probe", torch.device("cpu"), [WIDE_ROWS]) if "wide_ms" in g]
assert wide and all(set(g["wide_same_bits"]) == set(g["wide_ms"]) for g in wide), wide
assert all(all(g["wide_same_bits"].values()) for g in wide), [g["wide_same_bits"] for g in wide]
print("ok")
"""


def test_gemm_table_times_the_flat_candidates_in_interpreter():
    from tests.interpreter import run_interpreted

    out = run_interpreted(GEMM_TABLE)
    assert out.strip().endswith("ok")
    assert "| mode's ms (ours/cuBLAS) |" in out and "flat m128 1.0000 (1.00x)" in out and "| yes " in out
