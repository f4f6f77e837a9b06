"""The small-batch matmul (server/model/small_gemm.py), run by Triton's CPU interpreter against the unfused ops."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

pytest.importorskip("triton")

CHECK = r"""
import torch
from tests.model.fused_cases import check_small_gemm
print(check_small_gemm(torch.float32, "cpu", 1e-5))
print(check_small_gemm(torch.float16, "cpu", 2e-3))  # (bfloat16 does not compute in the interpreter)
"""


def test_small_gemm_matches_the_unfused_ops_in_interpreter():
    run_interpreted(CHECK)


@pytest.mark.parametrize("K, norm, silu, block_n, block_k", [
    (2048, True, False, 4, 2048),   # the 1B shape's q|k|v: one whole chunk
    (14336, False, False, 4, 2048),  # the 8B shape's down_proj: seven chunks
    (576, True, True, 2, 1024),     # SmolLM2-135M's gate|up: one masked chunk
])
def test_kernel_compiles_for_sm90_without_a_gpu(K, norm, silu, block_n, block_k):
    """The interpreter runs neither the dependent-launch instructions nor the compiler: the kernel goes through
    Triton's whole pipeline to an sm_90 cubin (ptxas ships with Triton), chained (GDC, launch_pdl) as on the H200."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from server.model.small_gemm import _small_gemm

    sig = {**{p: "*bf16" for p in ("x_ptr", "r_ptr", "nw_ptr", "w_ptr", "b_ptr", "out_ptr", "rout_ptr")},
           "M": "i32", "N": "i32", "eps": "fp32", **{s: "i32" for s in ("stride_x", "stride_r", "stride_ro", "stride_o")}}
    aligned = [i for i, name in enumerate(sig) if name not in ("M", "eps")]
    const = dict(K=K, BLOCK_N=block_n, BLOCK_K=block_k, ROWS=1, NORM=norm, RESIDUAL=norm, SILU=silu, HAS_BIAS=False,
                 GDC=True)
    sig.update({name: "constexpr" for name in const})
    try:
        src = ASTSource(fn=_small_gemm, signature=sig, constexprs=const,
                        attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": True})
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e).lower():
            pytest.skip(f"no ptxas with this Triton: {e}")
        raise
    assert kernel.asm["cubin"] and "griddepcontrol.wait" in kernel.asm["ptx"]
