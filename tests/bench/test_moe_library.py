"""bench/moe.py's library comparison computes the layer ours computes: PyTorch's grouped GEMM over the assignments
sorted by expert (torch._grouped_mm, with a CPU fallback in this torch) against the reference, on a routing where
some experts get several tokens and some none."""
from __future__ import annotations

import torch

from bench.moe import library_experts
from server.model.moe import experts_torch, route_torch
from tests.model.moe_cases import moe_inputs


def test_the_library_layer_equals_the_reference():
    x, gate, w13, w2 = moe_inputs(9, 8, 2, 64, 48, torch.bfloat16, "cpu")
    ids, weights = route_torch(x, gate, 2, True, round_weights=False)
    assert len(set(ids.reshape(-1).tolist())) < 8  # an expert without tokens: an empty group
    got, want = library_experts(x, w13, w2, ids, weights), experts_torch(x, w13, w2, ids, weights)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < 2e-2, err
