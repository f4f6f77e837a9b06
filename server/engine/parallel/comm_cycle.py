"""--tp-release-comm-on-sleep on one rank: what a sleep and a wake do to the device communicator.

ParallelPool (pool.py) decides when, for every rank at once: after every rank's pool slept (the first
tags to sleep), release(); after a wake that leaves nothing asleep on any rank, recreate(). Rank 0 runs
them in its own process while each worker runs the same function (worker.py, ops comm_release and
comm_recreate), so the collectives inside meet.

Why: NCCL 2.28.9 keeps ~840 MiB per H200 rank for its communicator, outside the pool, and has no
ncclCommSuspend (vLLM's suspend needs >= 2.29.7); destroying the communicator is the only way to give
that memory back. The decode graphs captured its collectives (they hold the communicator), so they go
first and are captured again once the new one is up. The graphs' buffers and private memory stay in
the pool under `cuda_graph` (backed up by the sleep like any other), so a re-capture reuses the same
addresses and the same pool memory instead of allocating more.

recreate() is all or nothing over the control group (gloo, no device memory): every rank creates its
communicator, then the ranks agree; then every rank re-captures, then they agree again. A rank that
failed makes every rank drop what it made, so the pool can put every rank back to sleep with no
communicator, as before the wake. A rank that fails inside the collective itself (ncclCommInitRank, a
warm-up's all-reduce) before the others reach the agreement cannot be rolled back that way on CUDA: its
peers may wait in NCCL without a limit (the worker monitor ends that wait only if the failed rank's
process exits; a bounded, non-blocking ncclCommInitRankConfig would need NCCL's versioned config struct
built through ctypes, not done).
"""
from __future__ import annotations

import logging
import time

from allocator import PoolError

log = logging.getLogger("sleepserve.engine")


def release(runner, group) -> float:
    """Destroy the decode graphs, then the device communicator. Returns the milliseconds it took."""
    t0 = time.perf_counter()
    graphs = getattr(runner, "graphs", None)
    if graphs is not None:
        graphs.release()
    group.down()
    return (time.perf_counter() - t0) * 1e3


def recreate(runner, group, fail: str | None = None) -> dict[str, float]:
    """A new communicator on every rank and the decode graphs captured on it (every rank at once).
    `fail`: a failure injected by a test once this rank's communicator is up (inject_failure on the
    comm_recreate op). Returns the milliseconds of each part (init_ms: the communicator and the ranks'
    agreement; capture_ms: the graphs); raises PoolError on every rank if any rank failed."""
    t0 = time.perf_counter()
    error: BaseException | None = None
    try:
        if group.comm is not None:  # an earlier release that failed on this rank: never two at once
            release(runner, group)
        group.up()
        if fail is not None:
            raise PoolError(fail)
    except Exception as e:
        error = e
    if not group.agree(error is None):
        group.down()
        raise _failed(error, "re-create the device communicator")
    t1 = time.perf_counter()
    graphs = getattr(runner, "graphs", None)
    try:
        if graphs is not None:
            graphs.recapture()
    except Exception as e:
        error = e
    if not group.agree(error is None):
        if graphs is not None:
            graphs.release()
        group.down()
        raise _failed(error, "re-capture the decode graphs")
    return {"init_ms": (t1 - t0) * 1e3, "capture_ms": (time.perf_counter() - t1) * 1e3}


def _failed(error: BaseException | None, what: str) -> PoolError:
    if error is None:
        return PoolError(f"another rank could not {what}")
    if isinstance(error, PoolError):
        return error
    return PoolError(f"could not {what}: {type(error).__name__}: {error}")


def suspend_support(suspend: str = "auto", release: bool = False) -> str:
    """What a sleep does to the device communicator, for the log: the NCCL in use (SLEEPSERVE_NCCL_SO, else
    torch's), whether it has ncclCommSuspend (>= 2.29.7), and what --tp-comm-suspend and
    --tp-release-comm-on-sleep make of it (pool.py ParallelPool)."""
    from server.weight_transfer.nccl import NcclLibrary

    try:
        nccl = NcclLibrary()
    except OSError as e:
        return f"NCCL could not be loaded ({e})"
    text = f"NCCL {nccl.version}"
    if nccl.can_suspend and suspend != "off":
        return f"{text}: suspended by a sleep, resumed by the wake (ncclCommSuspend)"
    fallback = ("destroyed by a sleep and re-created by the wake (--tp-release-comm-on-sleep)" if release
                else "kept while asleep")
    why = "--tp-comm-suspend off" if nccl.can_suspend else "no ncclCommSuspend (NCCL >= 2.29.7)"
    return f"{text}, {why}: {fallback}"
