"""The fused MoE kernels (server/model/fused_moe.py) under Triton's CPU interpreter, against the PyTorch
reference: routing, the align step, both grouped GEMMs and the combine."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

pytest.importorskip("triton")

CHECK = r"""
import torch
from tests.model.moe_cases import check_align, check_fused_moe, check_moe_invariant, check_moe_layer
check_align("cpu")
print(check_moe_invariant(torch.float32, "cpu", 1e-5))
print(check_moe_layer(torch.float32, "cpu", 1e-5))
print(check_fused_moe(torch.float32, "cpu", 1e-5))
# the prefill tiles (64-row blocks) on a batch that spans several blocks per expert
print(check_fused_moe(torch.float32, "cpu", 1e-5, shapes=[(70, 4, 2, 32, 48, True)],
                      config={"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32}))
print(check_fused_moe(torch.float16, "cpu", 2e-2, shapes=[(9, 8, 2, 64, 48, True)]))
"""


def test_fused_moe_matches_the_reference_in_interpreter():
    print(run_interpreted(CHECK))


@pytest.mark.parametrize("gate_up, tile, gdc", [(True, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128), True),
                                                (False, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128), True),
                                                (False, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64), False),
                                                (True, "INVARIANT_TILE", False)])
def test_grouped_gemm_compiles_for_sm90_without_a_gpu(gate_up, tile, gdc):
    """The interpreter does not run Triton's compiler: the GEMM (the Qwen3-30B-A3B shapes, bf16) goes through its
    whole pipeline to an sm_90 cubin, as on the H200; so do the routing and align kernels and the combine. The
    decode tile as a batch-1 step chains it (GDC): it, the one-program routing and the combine each let the next
    kernel launch and wait for the one before before touching memory; unchained, neither instruction."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from server.model.fused_moe import INVARIANT_TILE, _combine, _grouped_gemm, _offsets, _route, _route_align_small
    from tests.interpreter import waits_before_memory

    tile = INVARIANT_TILE if tile == "INVARIANT_TILE" else tile  # the batch-invariant mode's one tile

    def build(fn, sig, const):
        sig = {**sig, **{name: "constexpr" for name in const}}
        try:
            return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        except RuntimeError as e:
            if "ptxas" in str(e) and "not found" in str(e).lower():
                pytest.skip(f"no ptxas with this Triton: {e}")
            raise

    ptr = {p: "*bf16" for p in ("a_ptr", "b_ptr", "c_ptr")}
    ints = {p: "i32" for p in ("M", "N", "stride_a", "stride_be", "stride_bn", "stride_c")}
    sig = {**ptr, "weights_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "padded_ptr": "*i32",
           **ints}
    const = dict(KDIM=2048 if gate_up else 768, A_DIV=8 if gate_up else 1, GATE_UP=gate_up, WEIGHTED=not gate_up,
                 IEEE=False, GDC=gdc, **tile)
    gemm = build(_grouped_gemm, sig, const)
    assert gemm.asm["cubin"]
    route = build(_route, {"logits_ptr": "*bf16", "ids_ptr": "*i32", "weights_ptr": "*fp32", "E": "i32",
                           "stride": "i32", "ids_stride": "i32"}, dict(K=8, BLOCK_E=128, BLOCK_K=8, RENORM=True, ROUND=True))
    offsets = build(_offsets, {"counts_ptr": "*i32", "cursor_ptr": "*i32", "block_expert_ptr": "*i32",
                               "padded_ptr": "*i32", "E": "i32", "max_blocks": "i32"},
                    dict(BLOCK_M=16, BLOCK_E=128, BLOCK_B=64))
    small = build(_route_align_small, {"logits_ptr": "*bf16", "ids_ptr": "*i32", "weights_ptr": "*fp32",
                                       "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "padded_ptr": "*i32",
                                       "T": "i32", "E": "i32", "stride": "i32", "ids_stride": "i32",
                                       "max_blocks": "i32"},
                  dict(K=8, BLOCK_E=128, BLOCK_K=8, BLOCK_A=64, RENORM=True, ROUND=True, BLOCK_M=16, BLOCK_B=64,
                       GDC=gdc))
    combine = build(_combine, {"parts_ptr": "*bf16", "out_ptr": "*bf16", "H": "i32"},
                    dict(K=8, BLOCK_H=1024, GDC=gdc))
    assert route.asm["cubin"] and offsets.asm["cubin"] and small.asm["cubin"] and combine.asm["cubin"]
    for chained in (gemm, small, combine):
        ptx = chained.asm["ptx"]
        assert waits_before_memory(ptx) if gdc else "griddepcontrol" not in ptx


@pytest.mark.parametrize("warps, tokens", [(1, 1), (2, 1), (1, 8)])
def test_one_program_routing_compiles_for_sm90_on_fewer_warps_without_a_gpu(warps, tokens):
    """_route_align_small at the Qwen3-30B-A3B shape (128 experts, top 8) on 1 and 2 warps, the candidates
    bench/moe.py times against its 4, at batch 1's widths and at SMALL_TOKENS' (route_align_widths), through the
    compiler to an sm_90 cubin, without spills."""
    from server.model.fused_moe import _route_align_small, route_align_widths
    from tests.interpreter import compile_for_sm90, ptxas_usage

    block_a, block_b = route_align_widths(tokens, 8, 128, 16)
    kernel = compile_for_sm90(_route_align_small, {"logits_ptr": "*bf16", "ids_ptr": "*i32", "weights_ptr": "*fp32",
                                                   "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
                                                   "padded_ptr": "*i32", "T": "i32", "E": "i32", "stride": "i32",
                                                   "ids_stride": "i32", "max_blocks": "i32"},
                              dict(K=8, BLOCK_E=128, BLOCK_K=8, BLOCK_A=block_a, RENORM=True, ROUND=True, BLOCK_M=16,
                                   BLOCK_B=block_b, GDC=True), num_warps=warps)
    registers, spills = ptxas_usage(kernel)
    assert spills == 0, (registers, spills)
