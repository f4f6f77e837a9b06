"""The small-batch matmul on the GPU: against the unfused ops, and chained with programmatic dependent launch
inside a CUDA graph (each kernel reads the one before's output: a kernel that read or wrote before its
predecessor finished would show as a wrong result on some replay)."""
from __future__ import annotations

import pytest
import torch

from tests.model.fused_cases import check_small_gemm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("gdc", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)])
def test_small_gemm_matches_the_unfused_ops(dtype, tol, gdc):
    for seed in range(2):
        check_small_gemm(dtype, "cuda", tol, gdc=gdc, seed=seed)


def test_chained_with_dependent_launch_in_a_graph_is_the_eager_chain():
    import torch.nn.functional as F

    from server.model.ops import TorchOps
    from server.model.small_gemm import small_gemm

    torch.manual_seed(0)
    H, Q, I, eps = 2048, 3072, 8192, 1e-5
    dev, dt = "cuda", torch.bfloat16
    layers = [dict(qkv=torch.randn(Q, H, device=dev, dtype=dt) / H ** 0.5, o=torch.randn(H, H, device=dev, dtype=dt) / H ** 0.5,
                   gu=torch.randn(2 * I, H, device=dev, dtype=dt) / H ** 0.5, down=torch.randn(H, I, device=dev, dtype=dt) / I ** 0.5,
                   n1=torch.rand(H, device=dev, dtype=dt) + 0.5, n2=torch.rand(H, device=dev, dtype=dt) + 0.5)
              for _ in range(4)]
    x_in = torch.randn(1, H, device=dev, dtype=dt)
    r_in = torch.randn(1, H, device=dev, dtype=dt)

    def chain(gdc: bool):
        x, r = x_in, r_in
        for w in layers:
            qkv, r = small_gemm(x, w["qkv"], residual=r, norm_weight=w["n1"], eps=eps, gdc=gdc)
            o, _ = small_gemm(qkv[:, :H], w["o"], gdc=gdc)
            act, r = small_gemm(o, w["gu"], residual=r, norm_weight=w["n2"], eps=eps, silu=True, gdc=gdc)
            x, _ = small_gemm(act, w["down"], gdc=gdc)
        return x + r

    def reference():
        x, r = x_in, r_in
        for w in layers:
            h, r = TorchOps.add_rmsnorm(x, r, w["n1"], eps)
            o = F.linear(F.linear(h, w["qkv"])[:, :H], w["o"])
            h, r = TorchOps.add_rmsnorm(o, r, w["n2"], eps)
            x = F.linear(TorchOps.silu_mul_packed(F.linear(h, w["gu"])), w["down"])
        return x + r

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(True)
    for i in range(20):
        x_in.copy_(torch.randn(1, H, device=dev, dtype=dt))
        r_in.copy_(torch.randn(1, H, device=dev, dtype=dt))
        g.replay()
        ref, eager = reference(), chain(False)
        assert torch.equal(out, eager), f"replay {i}: the graph's chain differs from the same kernels run eagerly"
        err = float((out.double() - ref.double()).norm() / ref.double().norm())
        assert err < 2e-2, f"replay {i}: {err}"
