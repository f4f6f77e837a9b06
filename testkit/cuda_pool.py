"""CUDA helpers shared by tests/gpu/test_pool_gpu.py and the pool benchmarks (bench/pool_table.py,
bench/pool_diag.py): the graph-capture recipe of MemoryPool.graph_pool, free device memory, host RSS."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch


def host_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def free_bytes(index: int | None = None) -> int:
    """Free device memory once the device's queued work is done."""
    torch.cuda.synchronize(index)
    return torch.cuda.mem_get_info(index)[0]


def capture(pool: Any, fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...],
            dtype: torch.dtype = torch.bfloat16) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """A CUDA graph of fn over a random static input of `shape`, with the recipe of
    MemoryPool.graph_pool's docstring (warm up inside pool.use() on a side stream, capture outside
    it into pool.graph_pool()), replayed once. pool=None runs the same kernels the same way without
    a pool (the reference process of testkit/footprint.py). Returns (graph, input, output)."""
    if pool is not None:
        static_input = pool.empty(shape, dtype, "cuda_graph")
    else:
        static_input = torch.empty(shape, dtype=dtype, device="cuda")
    static_input.copy_(torch.randn(shape, device="cuda").to(dtype))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with pool.use("cuda_graph") if pool is not None else nullcontext(), torch.cuda.stream(stream):
            for _ in range(3):
                fn(static_input)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        graph_pool = pool.graph_pool("cuda_graph") if pool is not None else None
        with torch.cuda.graph(graph, pool=graph_pool, stream=stream):
            static_output = fn(static_input)
        graph.replay()
    torch.cuda.synchronize()
    return graph, static_input, static_output
