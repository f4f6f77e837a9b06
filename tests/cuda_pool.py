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


def capture(pool: Any, fn: Callable[[torch.Tensor], torch.Tensor],
            static_input: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The recipe of MemoryPool.graph_pool's docstring: warm up inside pool.use() on a side
    stream, capture outside it into pool.graph_pool(). pool=None captures the same kernels the
    same way without a pool (the reference process of tests/footprint.py)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with pool.use("cuda_graph") if pool is not None else nullcontext(), torch.cuda.stream(stream):
        for _ in range(3):
            fn(static_input)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    graph_pool = pool.graph_pool("cuda_graph") if pool is not None else None
    with torch.cuda.graph(graph, pool=graph_pool, stream=stream):
        static_output = fn(static_input)
    torch.cuda.synchronize()
    return graph, static_output
