"""Checks of the fused MoE kernels (server/model/fused_moe.py) against the PyTorch reference (model/moe.py),
shared by the interpreter test (CPU) and the GPU test."""
from __future__ import annotations

import torch


def moe_inputs(T: int, E: int, K: int, H: int, I: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    gate = (torch.randn(E, H, generator=g) / H ** 0.5).to(device, dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(device, dtype)
    return x, gate, w13, w2


def check_only_ties_differ(same: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, K: int,
                           dtype: torch.dtype) -> None:
    """same: per token, whether two routers picked the same experts (as sets). Both read the same fp16/bf16
    logits (one cuBLAS call): a token's experts may differ only where its k-th and next expert tie exactly in
    those logits. fp32 must match everywhere (and in the same order: the callers check that)."""
    if same.all():
        return
    assert dtype != torch.float32, (~same).nonzero()
    top = torch.nn.functional.linear(x, gate).float().topk(K + 1, dim=-1).values
    margin = (top[:, K - 1] - top[:, K])[~same]
    assert (margin == 0).all(), margin


def check_fused_moe(dtype: torch.dtype, device: str, tol: float, shapes=None, config=None) -> str:
    """Routing ids equal the reference's (weights within tol); the experts' sum within tol of the reference
    on the same routing, for decode-sized and prefill-sized batches; blocks that are only padding and
    experts no token picked included (T=1 routes to 2 of 8)."""
    from server.model.fused_moe import fused_experts, route
    from server.model.moe import experts_torch, route_torch

    report = []
    for T, E, K, H, I, renorm in shapes or [(1, 8, 2, 64, 48, True), (5, 8, 2, 64, 48, False), (37, 16, 4, 32, 80, True)]:
        x, gate, w13, w2 = moe_inputs(T, E, K, H, I, dtype, device)
        ids, weights = route(x, gate, K, renorm, round_weights=False)
        ref_ids, ref_weights = route_torch(x, gate, K, renorm, round_weights=False)
        # The same experts, in any order: two top-k's may list experts that tie inside the top k in other
        # orders (the H200 in fp16, T=256: 3 of 4 "different" tokens were that, at top-k margins 0.001-0.06).
        if dtype == torch.float32:  # no ties to break apart: the same experts in the same order
            assert torch.equal(ids, ref_ids), (T, ids, ref_ids)
        order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
        s_ids, s_weights = ids.gather(-1, order), weights.gather(-1, order)
        s_ref, s_ref_weights = ref_ids.gather(-1, ref_order), ref_weights.float().gather(-1, ref_order)
        same = (s_ids == s_ref).all(-1)
        check_only_ties_differ(same, x, gate, K, dtype)
        assert torch.allclose(s_weights[same], s_ref_weights[same], atol=1e-5), (weights, ref_weights)
        got = fused_experts(x, w13, w2, ids, weights, config)
        want = experts_torch(x, w13, w2, ids, weights)  # the same routing: the experts' sum alone is compared
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err <= tol, f"T={T} E={E} K={K}: relative error {err:.2e} > {tol}"
        report.append(f"T={T}: {err:.1e}")
    return ", ".join(report)


def check_align(device: str) -> None:
    """Every assignment appears once, in its expert's group; groups padded to whole blocks."""
    from server.model.fused_moe import align

    g = torch.Generator().manual_seed(1)
    E, bm = 8, 16
    ids = torch.randint(0, E, (23, 2), generator=g, dtype=torch.int32).to(device)
    rows, block_expert, padded = align(ids, E, bm)
    rows, block_expert, n = rows.cpu(), block_expert.cpu(), int(padded.item())
    flat = ids.reshape(-1).cpu()
    M = flat.numel()
    assert n % bm == 0 and n <= M + E * (bm - 1)
    real = rows[:n][rows[:n] < M]
    assert sorted(real.tolist()) == list(range(M)) and (rows[n:] == M).all()
    for b in range(n // bm):
        block = rows[b * bm:(b + 1) * bm]
        assert (flat[block[block < M].long()] == block_expert[b]).all()


def check_moe_layer(dtype: torch.dtype, device: str, tol: float, shapes=None) -> str:
    """fused_moe.moe on a sparse layer against moe_torch: the one-program route+align of a decode batch
    (T <= SMALL_TOKENS) and the kernels of a larger one; the routed ids it records equal the reference's."""
    from types import SimpleNamespace

    from server.model.fused_moe import SMALL_TOKENS, moe
    from server.model.moe import moe_torch

    report = []
    for T, E, K, H, I, renorm, rounded in shapes or [(1, 8, 2, 64, 48, True, True), (3, 16, 4, 32, 48, False, False),
                                                     (SMALL_TOKENS, 8, 2, 64, 48, True, False),
                                                     (SMALL_TOKENS + 1, 8, 2, 64, 48, True, True)]:
        x, gate, w13, w2 = moe_inputs(T, E, K, H, I, dtype, device, seed=T)
        layers, buffers = [], []
        for _ in range(2):
            experts = SimpleNamespace(w13_weight=w13, w2_weight=w2)
            # as the capture buffer gives each layer its rows: [tokens, layers, K], this layer's the middle one
            buffers.append(torch.full((T + 3, 3, K), -1, dtype=torch.int32, device=device))
            layers.append(SimpleNamespace(gate=SimpleNamespace(weight=gate), experts=experts, top_k=K,
                                          norm_topk_prob=renorm, round_weights=rounded, routed=buffers[-1][:, 1]))
        got, want = moe(x, layers[0]), moe_torch(x, layers[1])
        assert (buffers[0][:, 0] == -1).all() and (buffers[0][:, 2] == -1).all(), "another layer's ids were written"
        # The same experts per token, in any order (top-k's list experts tied inside the top k in other orders);
        # in fp32, in the same order.
        if dtype == torch.float32:
            assert torch.equal(layers[0].routed, layers[1].routed), (T, layers[0].routed, layers[1].routed)
        got_ids, ref_ids = layers[0].routed.sort(-1).values, layers[1].routed.sort(-1).values
        assert (got_ids[T:] == -1).all() and (ref_ids[T:] == -1).all(), "rows past the batch were written"
        check_only_ties_differ((got_ids[:T] == ref_ids[:T]).all(-1), x, gate, K, dtype)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err <= tol, f"T={T} E={E} K={K}: relative error {err:.2e} > {tol}"
        report.append(f"T={T}: {err:.1e}")
    return ", ".join(report)


def check_moe_invariant(dtype: torch.dtype, device: str, tol: float) -> str:
    """The batch-invariant mode's sparse layer (BatchInvariantTritonOps.moe: fused_moe.moe_invariant) on a batch
    of 130 tokens (past the default path's switch to 64-row blocks at 16 assignments an expert, and past the
    mode's 128-row router tile; several BLOCK_K steps in every GEMM). In fp32 the batch is within tol of
    moe_torch; on CUDA each token's row equals that token alone bitwise, where the default layer's rows need not
    (the interpreter's dot is numpy's, whose rows do not keep their bits across batches: no such claim there)."""
    from types import SimpleNamespace

    from server.model.batch_invariant_kernels import BatchInvariantTritonOps
    from server.model.fused_moe import moe
    from server.model.moe import moe_torch

    T, E, K, H, I = 130, 8, 2, 256, 192
    x, gate, w13, w2 = moe_inputs(T, E, K, H, I, dtype, device, seed=5)
    layer = SimpleNamespace(gate=SimpleNamespace(weight=gate), experts=SimpleNamespace(w13_weight=w13, w2_weight=w2),
                            top_k=K, norm_topk_prob=True, round_weights=False, routed=None)
    batch = BatchInvariantTritonOps.moe(x, layer)
    report = []
    if dtype == torch.float32:
        want = moe_torch(x, layer)
        err = ((batch.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err <= tol, f"relative error {err:.2e} > {tol}"
        report.append(f"{err:.1e} from the reference")
    if device == "cuda":
        plain = moe(x, layer)
        differs = 0
        for t in (0, 7, 64, T - 1):
            alone = BatchInvariantTritonOps.moe(x[t:t + 1], layer)
            assert torch.equal(alone[0], batch[t]), f"token {t}: alone and in the batch differ"
            differs += not torch.equal(moe(x[t:t + 1], layer)[0], plain[t])
        report.append(f"4 of 4 rows alone = in the batch (the default layer: {4 - differs} of 4)")
    return "invariant layer: " + ", ".join(report)
