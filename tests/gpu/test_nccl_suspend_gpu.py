"""ncclCommSuspend / ncclCommResume through the server's own communicator (server/engine/parallel/comm.py) on
one GPU: a one-rank NCCL communicator, an all-reduce captured in a CUDA graph, suspended and resumed; the
graph replays after the resume and computes what it computed before, and NCCL reports the memory suspended.
Runs where the NCCL in use has the calls (SLEEPSERVE_NCCL_SO naming a libnccl >= 2.29.7; make gpu-check
ARGS=nccl-suspend brings one); torch's own 2.28.9 has not, and the test then skips saying so. The TP=2 memory
it gives back per rank is bench/tp_release.py's (the same stage on the two-GPU host)."""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu


def _one_rank_comm():
    import torch.distributed as dist

    from server.engine.parallel.comm import NcclGroupComm

    return NcclGroupComm(dist.HashStore(), "suspend-test", 0, 1, torch.device("cuda", 0))


def _captured_double_and_reduce(comm, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    """A graph that doubles x and all-reduces it on the communicator (one rank: the sum is x itself)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as the decode graphs do
        comm.all_reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.mul_(2)
        comm.all_reduce(x)
    return graph


def test_a_suspended_communicator_resumes_and_its_captured_graph_replays():
    comm = _one_rank_comm()
    if not comm.suspendable:
        pytest.skip(f"NCCL {comm.nccl.version} has no ncclCommSuspend (>= 2.29.7): set SLEEPSERVE_NCCL_SO")
    x = torch.ones(1 << 22, device="cuda")
    graph = _captured_double_and_reduce(comm, x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 2))
    awake_stats, awake_free = comm.memory(), torch.cuda.mem_get_info()[0]
    report = {"nccl": comm.nccl.version, "awake": awake_stats}
    for cycle in range(3):
        comm.suspend()
        asleep_stats, asleep_free = comm.memory(), torch.cuda.mem_get_info()[0]
        assert comm.suspended and asleep_stats["suspended"] == 1, asleep_stats
        comm.resume()
        assert not comm.suspended and comm.memory()["suspended"] == 0
        x.fill_(3)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, torch.full_like(x, 6)), f"cycle {cycle}: the graph computed other values after resume"
        report[f"cycle{cycle}"] = {"asleep": asleep_stats, "device_memory_freed": asleep_free - awake_free}
    # Eager collectives work after the cycles too.
    y = torch.arange(8, device="cuda", dtype=torch.float32)
    comm.all_reduce(y)
    torch.cuda.synchronize()
    assert torch.equal(y, torch.arange(8, device="cuda", dtype=torch.float32))
    # What one rank gave back, for the log (make gpu-check runs this with -s); a one-rank clique's size is not
    # asserted: the TP=2 figure is bench/tp_release.py's.
    print("nccl suspend, one rank:", json.dumps(report))
    comm.close()
