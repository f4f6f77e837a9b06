"""Random paged-decode cases shared by the CPU (Triton interpreter) and GPU kernel tests."""
from __future__ import annotations

import random

import torch

from server.model.attention import decode_attention_torch
from server.model.kv_layout import layer_views

LAYERS = 3


def random_case(batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int, max_len: int,
                dtype: torch.dtype, device: str, seed: int):
    """Caches with scattered pages (strided views of a block-major cache), block tables in random order, lengths that are often not a
    multiple of the block size, and an output poisoned with NaN so unwritten rows show."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randint(1, max_len) for _ in range(batch)]
    lens[0] = 1
    lens[-1] = max_len
    pages = [-(-n // block_size) for n in lens]
    num_blocks = sum(pages) + 8
    width = max(pages) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    for b, n in enumerate(pages):
        tables[b, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    # The engine's block-major layout (kv_layout.py): K and V are one middle layer's strided views.
    kv = torch.randn((num_blocks, LAYERS, 2, block_size, kv_heads, head_dim), generator=gen).to(dtype)
    k, v = layer_views(kv.to(device), LAYERS // 2)
    assert not k.is_contiguous() and k.stride(0) == LAYERS * 2 * block_size * kv_heads * head_dim
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    return [q.to(device), k, v, tables.to(device), ctx.to(device)]


def relative_error(kernel, case, scale: float) -> float:
    q, k, v, tables, lens = case
    ref = decode_attention_torch(q.double(), k.double(), v.double(), tables, lens, scale)
    out = kernel(q, k, v, tables, lens, scale)
    assert not torch.isnan(out).any(), "the kernel left rows unwritten or produced NaN"
    return float((out.double() - ref).norm() / ref.norm())
