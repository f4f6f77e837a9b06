"""The one-launch Triton prefill kernel, run by Triton's CPU interpreter against the PyTorch path
(one SDPA per span) in float64. (The interpreter mishandles bf16 matmuls: bf16 is checked on the GPU,
tests/gpu/test_prefill_kernel_gpu.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from server.model.attention import prefill_tile_rows, prefill_tile_tokens, prefill_tiles
from tests.interpreter import run_interpreted

pytest.importorskip("triton")

# Spans are (new tokens, cached prefix tokens). Per case: a prompt of one token, spans longer than a
# tile (64 rows: 64 // group tokens) and than a key tile (64 keys), prefixes shorter and longer than a
# key tile (the kernel reads those unmasked), prefixes that end inside a block, a span exactly one
# tile long, GQA groups of 1, 2, 3 and 4 (3: tile rows that are not a power of two), block sizes 8/16.
CHECK = r"""
from server.model.prefill_kernel import triton_prefill_attention
from testkit.kernel_cases import prefill_error, random_prefill_case, worst_interpreted_errors
cases = [
    ([(1, 0), (5, 0), (70, 0), (64, 0)], 4, 4, 64, 16),           # group 1: tiles of 64 tokens
    ([(1, 37), (70, 0), (33, 100), (2, 7), (32, 129)], 8, 2, 64, 16),  # group 2: 32 tokens
    ([(20, 50), (9, 0), (22, 3)], 9, 3, 64, 8),                   # group 3: 21 tokens, 63 of 64 rows
    ([(17, 0), (1, 130), (40, 64)], 16, 4, 64, 16),               # group 4: 16 tokens
    ([(40, 0), (3, 70)], 8, 2, 128, 16),                          # head_dim 128: 128 rows, 32 tokens
]
def error_of(case, dtype, seed):
    spans, H, KVH, D, BS = case
    return prefill_error(triton_prefill_attention, random_prefill_case(spans, H, KVH, D, BS, dtype, "cpu", seed=seed),
                         D ** -0.5)
print(worst_interpreted_errors(error_of, cases))
"""


def test_kernel_matches_reference_in_interpreter():
    run_interpreted(CHECK)


# The CPU engine with only its prefill attention swapped for the kernel (the rest PyTorch): chunked
# prefills, prompt log-probs, greedy tokens, prefix-cached spans (testkit/kernel_cases.py).
ENGINE_CHECK = r"""
import tempfile
from pathlib import Path
from server import LLM
from server.model.ops import TorchOps
from server.model.prefill_kernel import triton_prefill_attention
from testkit.kernel_cases import engine_prefill_check
from testkit.models import model_folder

planned = []

def kernel(q, k, v, k_cache, v_cache, ctx, scale, out):
    # The runner's plan, built before the first layer, its arrays 16-byte aligned (one compiled variant)
    plan = ctx.prefill_plan
    planned.append(plan is not None and plan.tiles.data_ptr() % 16 == 0 and plan.tables.data_ptr() % 16 == 0)
    triton_prefill_attention(q, k, v, k_cache, v_cache, ctx, scale, out)

class KernelPrefill(TorchOps):
    prefill_attention = staticmethod(kernel)

llm = LLM(model=str(model_folder("llama-tiny", Path(tempfile.mkdtemp()))), device="cpu", load_format="dummy",
          kv_cache_memory="32MiB", max_num_batched_tokens=40)
print(engine_prefill_check(llm, TorchOps, KernelPrefill, 1e-4))
assert planned and all(planned), planned
"""


def test_engine_with_the_kernel_matches_the_pytorch_path_in_interpreter():
    run_interpreted(ENGINE_CHECK)


def test_tile_plan_covers_every_token_once():
    """The host's tile plan: each span's tokens cut into tiles of at most tile_tokens, in order, each
    with its position and its span's table offset (tables laid end to end)."""
    spans = [(3, 1, 1, [7]), (4, 70, 70, [1, 2, 3, 4, 5]), (74, 5, 45, [9, 8, 6])]
    tt = prefill_tile_tokens(4)
    assert tt == 16
    tiles = prefill_tiles(spans, tt)
    expected = [(3, 1, 0, 0)] + [(4 + 16 * j, min(16, 70 - 16 * j), 16 * j, 1) for j in range(5)] + [(74, 5, 40, 6)]
    assert tiles.tolist() == [list(t) for t in expected]
    assert tiles.dtype == np.int64
    assert prefill_tiles([(0, 1, 1, [3])], prefill_tile_tokens(128)).tolist() == [[0, 1, 0, 0]]


@pytest.mark.parametrize("dtype, group, head_dim, block_size", [
    ("bf16", 4, 64, 16), ("bf16", 7, 128, 32), ("fp16", 1, 64, 16), ("fp32", 4, 64, 16)])
def test_kernel_compiles_for_sm90_without_a_gpu(dtype, group, head_dim, block_size):
    """The interpreter is lenient about types and shapes; the compiler is not. The kernel goes through
    Triton's whole pipeline to an sm_90 cubin (ptxas ships with Triton) as the launch would make it:
    the wrapper's block and warp choice, strides specialized as divisible by 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from server.model.prefill_kernel import BLOCK_N, _paged_prefill, launch_shape

    tile_tokens = prefill_tile_tokens(group, prefill_tile_rows(head_dim))
    size = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    block_m, num_warps = launch_shape(tile_tokens, group, head_dim, size)
    sig = {**{p: f"*{dtype}" for p in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}, "tiles_ptr": "*i64",
           "tables_ptr": "*i64", "qk_scale": "fp32",
           **{s: "i32" for s in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ks",
                                 "stride_kh", "stride_tile")}}
    aligned = [i for i, name in enumerate(sig) if name not in ("qk_scale", "stride_tile")]
    const = dict(GROUP=group, TILE_TOKENS=tile_tokens, BLOCK_M=block_m, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim,
                 BLOCK_SIZE=block_size, IEEE=dtype == "fp32")
    sig.update({name: "constexpr" for name in const})
    try:
        src = ASTSource(fn=_paged_prefill, signature=sig, constexprs=const,
                        attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 2})
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e).lower():
            pytest.skip(f"no ptxas with this Triton: {e}")
        raise
    assert kernel.asm["cubin"] and kernel.metadata.num_warps == num_warps


def test_prefill_bench_runs_in_interpreter(tmp_path):
    """bench/prefill.py (the gpu-check stage `prefill`) end to end at its CPU sizes, the kernel interpreted:
    both prefill paths timed, the engine's passes complete (it asserts every output token came)."""
    import json
    import os
    import subprocess
    import sys

    from tests.interpreter import ROOT

    res = subprocess.run([sys.executable, "bench/prefill.py", "--device", "cpu", "--out", str(tmp_path)], cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "prefill-cpu.json").read_text())
    assert all(r["relative_error"] < 1e-5 and r["kernel_ms"] > 0 for r in result["attention"])
    assert {(r["concurrency"], r["path"]) for r in result["engine"]} == {
        (c, p) for c in (2, 4) for p in ("span by span", "kernel")}
    assert "in-process tok/s at 4 / at 2" in res.stdout
