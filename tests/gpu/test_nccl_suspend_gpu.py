"""ncclCommSuspend / ncclCommResume through the server's own communicator (server/engine/parallel/comm.py).
One GPU: a one-rank communicator (its all-reduce moves nothing, so this checks the calls and NCCL's own state:
suspended while suspended, a captured graph that replays after the resume, a collective refused meanwhile).
Two GPUs: two ranks with a sum that crosses them captured in a graph; each rank's device memory goes up by
what the suspend gives back, and the graph's sums after the resume are right. Runs where the NCCL in use has
the calls (SLEEPSERVE_NCCL_SO naming a libnccl >= 2.29.7; make gpu-check ARGS=nccl-suspend brings one);
torch's own 2.28.9 has not, and the tests then skip saying so. The TP=2 server's memory asleep per rank is
bench/tp_release.py's (the same stage on the two-GPU host)."""
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


def test_one_rank_suspends_resumes_and_its_captured_graph_replays():
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
        with pytest.raises(RuntimeError, match="suspended"):
            comm.all_reduce(x)
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


def _two_ranks(rank: int, port: int, results) -> None:
    """One rank of test_two_ranks_give_memory_back_and_their_graph_sums_across_them (a spawned process)."""
    from datetime import timedelta

    import torch.distributed as dist

    from server.engine.parallel.comm import NcclGroupComm

    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
        comm = NcclGroupComm(store, "suspend-two", rank, 2, device)
        if not comm.suspendable:
            results.put((rank, "skip", comm.nccl.version))
            return
        x = torch.full((1 << 22,), float(rank + 1), device=device)
        y = torch.empty_like(x)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            y.copy_(x)
            comm.all_reduce(y)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y.copy_(x)
            comm.all_reduce(y)
        graph.replay()
        torch.cuda.synchronize(device)
        assert torch.equal(y, torch.full_like(y, 3.0)), "the sum across the two ranks before the suspend"
        awake_free, awake = torch.cuda.mem_get_info(device)[0], comm.memory()
        comm.suspend()
        asleep_free, asleep = torch.cuda.mem_get_info(device)[0], comm.memory()
        comm.resume()
        x.fill_(10.0 * (rank + 1))
        graph.replay()
        torch.cuda.synchronize(device)
        assert torch.equal(y, torch.full_like(y, 30.0)), "the graph's sum after the resume"
        results.put((rank, "ok", {"nccl": comm.nccl.version, "freed": asleep_free - awake_free, "awake": awake,
                                  "asleep": asleep}))
        comm.close()
    except BaseException as e:  # the parent reports it
        results.put((rank, "error", f"{type(e).__name__}: {e}"))


def test_two_ranks_give_memory_back_and_their_graph_sums_across_them():
    import socket

    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_two_ranks, args=(r, port, results)) for r in range(2)]
    for p in ranks:
        p.start()
    got = dict((rank, (kind, value)) for rank, kind, value in (results.get(timeout=300) for _ in ranks))
    for p in ranks:
        p.join(60)
    if any(kind == "skip" for kind, _ in got.values()):
        pytest.skip(f"NCCL {got[0][1]} has no ncclCommSuspend (>= 2.29.7): set SLEEPSERVE_NCCL_SO")
    assert all(kind == "ok" for kind, _ in got.values()), got
    print("nccl suspend, two ranks:", json.dumps({r: v for r, (_, v) in got.items()}))
    for rank, (_, report) in got.items():
        assert report["asleep"]["suspended"] == 1 and report["asleep"]["suspendable"] > 0, (rank, report)
        assert report["freed"] > 0, f"rank {rank}: the suspend gave no device memory back: {report}"
