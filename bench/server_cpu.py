"""The server's own CPU during a benchmark pass, read from /proc (Linux): how many cores the engine process and
its busiest thread (the engine thread, at saturation) kept busy, and the API processes, the busiest of them and
all together. Where HTTP falls short of the in-process engine, it says which process was near its limit: an
engine thread near one core is host-bound, whatever the API processes do.

With pin_engine, the engine process gets one physical core to itself (every hardware thread of it) and the API
processes and this process (so the client processes it starts after) the others: whether the engine thread
slows when the API and the clients share its core's hyperthreads.

    cpu = ServerCpu(engine_pid, api_pids)   # at the pass's start
    ... the pass ...
    cpu.cores()  # over the time since: {"engine_thread": 0.97, "engine": 1.31, "api_max": 0.95, "api": 3.8}
"""
from __future__ import annotations

import os
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_seconds(path: Path) -> float:
    """utime + stime of a /proc stat file, in seconds (0 when the task is gone)."""
    try:
        fields = path.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS  # fields 14 and 15 of proc(5), after pid and comm


def threads(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of a process so far."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return {}
    return {tid: _stat_seconds(Path(f"/proc/{pid}/task/{tid}/stat")) for tid in tids}


def process_seconds(pid: int) -> float:
    return _stat_seconds(Path(f"/proc/{pid}/stat"))


class ServerCpu:
    """CPU seconds of the engine process (and of each of its threads) and of each API process since creation."""

    def __init__(self, engine_pid: int, api_pids: list[int]):
        self.engine_pid, self.api_pids = engine_pid, list(api_pids)
        self._threads = threads(engine_pid)
        self._engine = process_seconds(engine_pid)
        self._apis = [process_seconds(p) for p in self.api_pids]
        self._started = time.monotonic()

    def cores(self) -> dict[str, float]:
        """Cores busy on average since creation (CPU seconds over the same window's wall seconds)."""
        wall = max(time.monotonic() - self._started, 1e-9)
        now = threads(self.engine_pid)
        busiest = max((s - self._threads.get(tid, 0.0) for tid, s in now.items()), default=0.0)
        apis = [process_seconds(p) - s0 for p, s0 in zip(self.api_pids, self._apis)]
        return {"engine_thread": busiest / wall, "engine": (process_seconds(self.engine_pid) - self._engine) / wall,
                "api_max": max(apis, default=0.0) / wall, "api": sum(apis) / wall}


def core_siblings(cpu: int) -> set[int]:
    """The hardware threads sharing `cpu`'s physical core (itself alone where the kernel does not say)."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        text = path.read_text().strip()
    except OSError:
        return {cpu}
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def topology() -> str:
    """'16 CPUs, 2 hardware threads a core' (this machine's, as the kernel reports it)."""
    cpus = sorted(os.sched_getaffinity(0))
    return f"{len(cpus)} CPUs, {len(core_siblings(cpus[-1]))} hardware thread(s) a core"


def _pin(tid: int, cpus: set[int]) -> None:
    try:
        os.sched_setaffinity(tid, cpus)
    except ProcessLookupError:  # the thread ended since it was listed
        pass


def pin_engine(engine_pid: int, api_pids: list[int]) -> dict[str, list[int]]:
    """Every thread of the engine process on the last CPU's physical core, the API processes' threads and the
    calling thread (so the client processes it starts after) on every other CPU. Returns the two CPU sets."""
    cpus = set(os.sched_getaffinity(0))
    engine = core_siblings(max(cpus)) & cpus
    rest = cpus - engine
    if not rest:
        raise RuntimeError(f"one physical core only ({sorted(cpus)}): nothing left beside the engine's")
    for tid in threads(engine_pid):
        _pin(tid, engine)
    for pid in api_pids:
        for tid in threads(pid):
            _pin(tid, rest)
    os.sched_setaffinity(0, rest)  # the client processes started after this inherit it
    return {"engine": sorted(engine), "rest": sorted(rest)}
