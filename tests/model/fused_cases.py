"""The fused GPU ops against the PyTorch reference ops, on random inputs (CPU interpreter or GPU)."""
from __future__ import annotations

import torch

from server.model.kv_layout import layer_views
from server.model.llama import RMSNorm
from server.model.ops import TorchOps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any()
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_all(fused, dtype: torch.dtype, device: str, tol: float, seed: int = 0) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    errs: dict[str, float] = {}

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    for rows, cols in ((1, 576), (7, 2048), (33, 4096)):
        x, r, w = rnd(rows, cols), rnd(rows, cols), rnd(cols)
        for res in (None, r):
            out, rout = fused.add_rmsnorm(x, res, w, 1e-5)
            ref, rref = TorchOps.add_rmsnorm(x, res, w, 1e-5)
            errs["add_rmsnorm"] = max(errs.get("add_rmsnorm", 0.0), rel(out, ref), rel(rout, rref))

    T, H, KVH, D, NB, BS = 9, 8, 2, 64, 12, 16
    q, k, v = rnd(T, H, D), rnd(T, KVH, D), rnd(T, KVH, D)
    cos, sin = rnd(T, D), rnd(T, D)
    slots = torch.randperm(NB * BS, generator=g)[:T].to(device)
    # Two block-major caches of 3 layers (kv_layout.py), written through layer 1's strided views:
    # the other layers' bytes must stay untouched.
    fused_kv, torch_kv = (torch.zeros(NB, 3, 2, BS, KVH, D, dtype=dtype, device=device) for _ in range(2))
    q1, k1 = fused.rope_and_cache(q.clone(), k.clone(), v, cos, sin, *layer_views(fused_kv, 1), slots)
    q2, k2 = TorchOps.rope_and_cache(q.clone(), k.clone(), v, cos, sin, *layer_views(torch_kv, 1), slots)
    blocks, offsets = slots // BS, slots % BS  # each token's K/V sits at (its block, its offset in it)
    assert torch.equal(torch_kv[blocks, 1, 0, offsets], k2) and torch.equal(torch_kv[blocks, 1, 1, offsets], v)
    assert torch.count_nonzero(fused_kv[:, ::2]) == 0 and torch.count_nonzero(torch_kv[:, ::2]) == 0
    errs["rope_and_cache"] = max(rel(q1, q2), rel(k1, k2), rel(fused_kv, torch_kv))

    # Qwen3: each head RMS-normed before the rotation, in the same launch (norms).
    norms = RMSNorm(D, 1e-6), RMSNorm(D, 1e-5)
    for norm in norms:
        norm.weight = torch.nn.Parameter(rnd(D), requires_grad=False)
    fused_kv, torch_kv = (torch.zeros(NB, 3, 2, BS, KVH, D, dtype=dtype, device=device) for _ in range(2))
    q1, k1 = fused.rope_and_cache(q.clone(), k.clone(), v, cos, sin, *layer_views(fused_kv, 1), slots, norms)
    q2, k2 = TorchOps.rope_and_cache(q.clone(), k.clone(), v, cos, sin, *layer_views(torch_kv, 1), slots, norms)
    assert torch.equal(torch_kv[blocks, 1, 0, offsets], k2)
    errs["qk_norm_rope_and_cache"] = max(rel(q1, q2), rel(k1, k2), rel(fused_kv, torch_kv))

    gate_up = rnd(5, 2 * 1536)
    errs["silu_mul_packed"] = rel(fused.silu_mul_packed(gate_up), TorchOps.silu_mul_packed(gate_up))
    bad = {k: e for k, e in errs.items() if not e < tol}
    assert not bad, f"{dtype}: relative errors over {tol:.0e}: {bad}"
    return errs


def whole_model_error(llm, prompt_len: int = 50) -> float:
    """Relative error of one prefill's logits computed with the fused ops (TritonOps) against the
    PyTorch ops, on an engine's own model and cache. A prompt of a few tokens takes the small-batch
    path (small_gemm.py)."""
    from server import SamplingParams
    from server.model.fused_ops import TritonOps

    core = llm.engine
    core.add_request(f"fused-check-{prompt_len}", prompt_token_ids=list(range(100, 100 + prompt_len)),
                     params=SamplingParams(max_tokens=1))
    hb = core.runner.prepare(core.scheduler.schedule())
    core.model.ops = TorchOps
    reference = core.runner.logits(hb).double()
    core.model.ops = TritonOps
    fused = core.runner.logits(hb).double()
    return float((fused - reference).norm() / reference.norm())


def check_small_gemm(dtype: torch.dtype, device: str, tol: float, gdc: bool = False, seed: int = 0) -> dict[str, float]:
    """server/model/small_gemm.py against the unfused reference (TorchOps' norm, F.linear, silu_mul_packed):
    residual, norm, bias and SiLU present and absent, at 1-3 rows, K walked in one chunk and in several, the
    last one partial (576 in a chunk of 1024, 320 in chunks of 128), x a strided view of a wider tensor."""
    import torch.nn.functional as F

    from server.model.small_gemm import small_gemm

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    errs: dict[str, float] = {}
    for M, K, N, cap in ((1, 576, 100, 2048), (3, 256, 37, 64), (2, 320, 24, 128)):
        x, r, nw, b = rnd(M, K + 64)[:, 32:K + 32], rnd(M, K), rnd(K) + 1, rnd(2 * N)  # x: rows K + 64 apart
        w, w2 = rnd(N, K, scale=K ** -0.5), rnd(2 * N, K, scale=K ** -0.5)
        # Each of residual, bias and norm present and absent, in four combinations (the interpreter is slow).
        for res, bias, norm in ((None, None, None), (r, b, nw), (r, None, None), (None, b, nw)):
            h, rsum = TorchOps.add_rmsnorm(x, res, nw, 1e-5) if norm is not None else (
                x if res is None else x + res, x if res is None else x + res)
            out, rout = small_gemm(x, w, None if bias is None else bias[:N], residual=res, norm_weight=norm,
                                   eps=1e-5, gdc=gdc, block_k_cap=cap)
            errs["linear"] = max(errs.get("linear", 0.0),
                                 rel(out, F.linear(h, w, None if bias is None else bias[:N])))
            if res is not None:
                assert torch.equal(rout, rsum), "the residual sum is the unfused one, bit for bit"
            out, _ = small_gemm(x, w2, bias, residual=res, norm_weight=norm, eps=1e-5, silu=True, gdc=gdc,
                                block_n=2, block_k_cap=cap)
            errs["silu"] = max(errs.get("silu", 0.0), rel(out, TorchOps.silu_mul_packed(F.linear(h, w2, bias))))
    bad = {k: e for k, e in errs.items() if not e < tol}
    assert not bad, f"{dtype}: relative errors over {tol:.0e}: {bad}"
    return errs
