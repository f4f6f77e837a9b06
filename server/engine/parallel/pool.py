"""The pool the engine core sees with tensor parallelism: rank 0's MemoryPool, with every sleep and wake
applied on all ranks at once, all or nothing.

The SleepController stays the one owner of the sleep state machine and calls this exactly as it calls
a MemoryPool; each rank's own pool keeps its own tag states (they move together). A rank that fails
rolls back the others: a failed wake puts every rank back to sleep as it was, a failed sleep wakes the
ranks that slept, and the error names the rank. While any tag sleeps the process group is destroyed on
every rank (NCCL's communicator holds ~838 MiB per H200 outside the pool) and re-created by the wake.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

from allocator import MemoryPool, PoolError, PoolStats, SleepReport, WakeReport
from server.engine.parallel.executor import Workers
from server.engine.runner import ModelRunner

log = logging.getLogger("sleepserve.engine")


def _tags(tags: str | Iterable[str] | None) -> list[str]:
    return [tags] if isinstance(tags, str) else list(tags or ())


class ParallelPool:
    def __init__(self, local: MemoryPool, workers: Workers, runner: ModelRunner):
        self.local = local
        self.workers = workers
        self.runner = runner
        self.world = workers.world
        self._graphs_stale = False

    # -- what the engine reads: rank 0's pool answers for all (their tag states move together) ------

    @property
    def device(self):
        return self.local.device

    def tag_state(self, tag: str) -> str:
        return self.local.tag_state(tag)

    def sleeping_tags(self) -> dict[str, str]:
        return self.local.sleeping_tags()

    def stats(self) -> PoolStats:
        return self.local.stats()

    def tag_of(self, tensor) -> str | None:
        return self.local.tag_of(tensor)

    def stats_per_rank(self) -> list[PoolStats]:
        """Each rank's pool (GET /memory, /metrics)."""
        outcomes = self.workers.run("stats", None, self.local.stats)
        for value in outcomes.values():
            if isinstance(value, BaseException):
                raise value
        return [outcomes[rank] for rank in sorted(outcomes)]

    def check_backup_space(self, tags) -> None:
        self.workers.run_all("check_backup_space", _tags(tags), lambda: self.local.check_backup_space(tags))

    # -- sleep and wake on every rank --------------------------------------------------------------

    def sleep(self, offload_tags: str | Iterable[str] = (), discard_tags: str | Iterable[str] = ()) -> SleepReport:
        offload, discard = _tags(offload_tags), _tags(discard_tags)
        before = self.local.sleeping_tags()
        first = not before and bool(offload or discard)
        if first:  # the communicator goes after this sleep: graphs that captured it go first
            self.workers.run_all("drop_graphs", None, self.runner.drop_graphs)
            self._graphs_stale = True
        outcomes = self.workers.run("sleep", (offload, discard),
                                    lambda: self.local.sleep(offload_tags=offload, discard_tags=discard))
        failed = {r: v for r, v in outcomes.items() if isinstance(v, BaseException)}
        if failed:
            # Wake what this call put to sleep on every rank (a failed rank may have released some).
            slept = [t for t in offload + discard if t not in before]
            self._on_ranks(list(outcomes), "wake", slept, lambda: self.local.wake_up(slept))
            self._refresh_graphs()
            raise PoolError(f"sleep failed on {self._name(failed)}; the ranks that had slept were woken again, "
                            "so every rank is as before the call")
        if not before and self.local.sleeping_tags():
            self._group("comm_down")
        reports: list[SleepReport] = list(outcomes.values())
        return SleepReport(sum(r.bytes_offloaded for r in reports), sum(r.bytes_discarded for r in reports),
                           max(r.seconds for r in reports), max(r.copy_seconds for r in reports))

    def wake_up(self, tags: str | Iterable[str] | None = None) -> WakeReport:
        before = self.local.sleeping_tags()
        wanted = None if tags is None else _tags(tags)
        targets = [t for t in (before if wanted is None else wanted) if t in before]
        if not targets:
            return self.local.wake_up(wanted)
        if not self.workers.group.up_now:
            self._group("comm_up", self.workers.group.generation + 1)
        outcomes = self.workers.run("wake", wanted, lambda: self.local.wake_up(wanted))
        failed = {r: v for r, v in outcomes.items() if isinstance(v, BaseException)}
        if failed:
            # Every rank back to sleep as it was: the failed ones rolled their own wake back already.
            ok = [r for r in outcomes if r not in failed]
            offload = [t for t in targets if before[t] == "offloaded"]
            discard = [t for t in targets if before[t] == "discarded"]
            self._on_ranks(ok, "sleep", (offload, discard),
                           lambda: self.local.sleep(offload_tags=offload, discard_tags=discard))
            self._group("comm_down")
            first = next(iter(failed.values()))
            raise PoolError(f"wake_up failed on {self._name(failed)} ({first}); every rank was put back to sleep "
                            f"(tags {sorted(targets)} stay asleep): free the resource named and call wake_up again")
        self._refresh_graphs()
        reports: list[WakeReport] = list(outcomes.values())
        return WakeReport(sum(r.bytes_restored for r in reports), sum(r.bytes_mapped for r in reports),
                          max(r.seconds for r in reports), max(r.copy_seconds for r in reports))

    def _group(self, op: str, generation: int | None = None) -> None:
        """Release (comm_down) or re-create (comm_up) the process group on every rank."""
        group = self.workers.group
        if op == "comm_down":
            self.workers.run_all(op, None, group.down)
        else:
            self.workers.run_all(op, generation, lambda: group.up(generation))  # type: ignore[arg-type]

    def _refresh_graphs(self) -> None:
        """Graphs captured the destroyed group's collectives: capture them again on every rank once
        their tag is awake (CPU and --enforce-eager have none: nothing runs)."""
        if self._graphs_stale and self.local.tag_state("cuda_graph") == "awake":
            self.workers.run_all("recapture", None, self.runner.after_group_recreated)
            self._graphs_stale = False

    def _on_ranks(self, ranks: list[int], op: str, arg: Any, local) -> None:
        """Undo on the ranks that did the step (a rollback that fails too is logged: nothing else to do)."""
        for rank in ranks:
            try:
                if rank == 0:
                    local()
                else:
                    self.workers.send_one(rank, op, arg)
            except Exception:
                log.exception("rolling back %s on rank %d failed", op, rank)

    @staticmethod
    def _name(failed: dict[int, BaseException]) -> str:
        return ", ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))

    # -- testing and lifetime ----------------------------------------------------------------------

    def inject_failure(self, rank: int, op: str, message: str) -> None:
        """Make rank's next `op` (sleep, wake) raise PoolError(message) before it touches memory, as a
        real out-of-memory would: the fault-injection hook of the all-or-nothing tests."""
        if rank == 0:
            raise ValueError("inject failures on a worker rank (1..N-1)")
        self.workers.send_one(rank, "inject_failure", (op, message))

    def close(self) -> None:
        try:
            self.local.close()
        finally:
            self.workers.close()
