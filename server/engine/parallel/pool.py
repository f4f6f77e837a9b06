"""The pool the engine core sees with tensor parallelism: rank 0's MemoryPool, with every sleep and wake
applied on all ranks at once, all or nothing.

The SleepController stays the one owner of the sleep state machine and calls this exactly as it calls
a MemoryPool; each rank's own pool keeps its own tag states (they move together). A rank that fails
rolls back the others: a failed wake puts every rank back to sleep as it was, a failed sleep wakes the
ranks that slept, and the error names the rank.

Where the NCCL in use has ncclCommSuspend (>= 2.29.7; suspend_comm, unless --tp-comm-suspend off), the first
tags to sleep suspend every rank's communicator (NCCL unmaps its physical memory and keeps its virtual
addresses) and the wake that leaves nothing asleep resumes it: the decode graphs that captured its
collectives replay as they were, nothing is re-created. Otherwise the device communicator stays up while
the ranks sleep by default (NCCL 2.28.9 keeps ~840 MiB per H200 rank outside the pool): the decode graphs
captured its collectives, so they replay after the wake as they were. With --tp-release-comm-on-sleep
(release_comm) this facade also takes it down on every rank after the first tags sleep, and a wake that
leaves nothing asleep creates a new one and re-captures the graphs on every rank before it returns
(comm_cycle.py); if any rank fails that, every rank goes back to sleep as before the wake. An earlier build
that always did so (H200x2, 8B) woke in 2.5-3.6 s instead of 0.3 s and left ~142 MiB more in use per rank
after each cycle; this one re-captures into the same graph buffers with one warm-up, measured by
`make gpu-check ARGS=tp-release`.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

from allocator import MemoryPool, PoolError, PoolStats, PoolSleepReport, PoolWakeReport
from allocator.timing import Clock
from server.engine.parallel.executor import Workers

log = logging.getLogger("sleepserve.engine")


def _tags(tags: str | Iterable[str] | None) -> list[str]:
    return [tags] if isinstance(tags, str) else list(tags or ())


class ParallelPool:
    def __init__(self, local: MemoryPool, workers: Workers, runner=None, release_comm: bool = False,
                 suspend_comm: bool = False):
        self.local = local
        self.workers = workers
        self.world = workers.world
        self.runner = runner  # rank 0's: its decode graphs go and come back with the communicator
        self.release_comm = release_comm
        self.suspend_comm = suspend_comm  # takes precedence: nothing is re-created or re-captured

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

    def sleep(self, offload_tags: str | Iterable[str] = (), discard_tags: str | Iterable[str] = ()) -> PoolSleepReport:
        offload, discard = _tags(offload_tags), _tags(discard_tags)
        clock = Clock()
        before = self.local.sleeping_tags()
        outcomes = self.workers.run("sleep", (offload, discard),
                                    lambda: self.local.sleep(offload_tags=offload, discard_tags=discard))
        clock.mark("ranks")
        failed = {r: v for r, v in outcomes.items() if isinstance(v, BaseException)}
        if failed:
            # Wake what this call put to sleep on every rank (a failed rank may have released some).
            slept = [t for t in offload + discard if t not in before]
            self._on_ranks(list(outcomes), "wake", slept, lambda: self.local.wake_up(slept))
            raise PoolError(f"sleep failed on {self._name(failed)}; the ranks that had slept were woken again, "
                            "so every rank is as before the call")
        reports: list[PoolSleepReport] = list(outcomes.values())
        comm: dict[str, Any] = {}  # comm_ms: each rank's milliseconds to suspend or drop its communicator
        if not before and self.workers.group.comm is not None:
            if self.suspend_comm:
                comm["comm_ms"] = self._suspend_comm()
                clock.mark("comm_suspend")
            elif self.release_comm:
                comm["comm_ms"] = self._release_comm()
                clock.mark("comm_release")
        return PoolSleepReport(sum(r.bytes_offloaded for r in reports), sum(r.bytes_discarded for r in reports),
                           max(r.seconds for r in reports), max(r.copy_seconds for r in reports),
                           timings=self._timings(clock, outcomes, **comm))

    def wake_up(self, tags: str | Iterable[str] | None = None) -> PoolWakeReport:
        clock = Clock()
        before = self.local.sleeping_tags()
        wanted = None if tags is None else _tags(tags)
        targets = [t for t in (before if wanted is None else wanted) if t in before]
        if not targets:
            return self.local.wake_up(wanted)
        outcomes = self.workers.run("wake", wanted, lambda: self.local.wake_up(wanted))
        clock.mark("ranks")
        failed = {r: v for r, v in outcomes.items() if isinstance(v, BaseException)}
        if failed:
            # Every rank back to sleep as it was: the failed ones rolled their own wake back already.
            self._back_to_sleep([r for r in outcomes if r not in failed], targets, before)
            first = next(iter(failed.values()))
            raise PoolError(f"wake_up failed on {self._name(failed)} ({first}); every rank was put back to sleep "
                            f"(tags {sorted(targets)} stay asleep): free the resource named and call wake_up again")
        comm: dict[str, Any] = {}  # comm_ms: each rank's {init_ms, capture_ms}, or its resume's ms
        if not self.local.sleeping_tags():
            if self.workers.group.comm is None:
                comm["comm_ms"] = self._recreate_comm(targets, before)
                clock.mark("comm_recreate")
            elif self.suspend_comm:
                comm["comm_ms"] = self._resume_comm(targets, before)
                clock.mark("comm_resume")
        reports: list[PoolWakeReport] = list(outcomes.values())
        return PoolWakeReport(sum(r.bytes_restored for r in reports), sum(r.bytes_mapped for r in reports),
                          max(r.seconds for r in reports), max(r.copy_seconds for r in reports),
                          timings=self._timings(clock, outcomes, **comm))

    def _back_to_sleep(self, ranks: list[int], targets: list[str], before: dict[str, str]) -> None:
        """Put `targets` back to sleep on `ranks` as they were before this wake (`before`)."""
        offload = [t for t in targets if before[t] == "offloaded"]
        discard = [t for t in targets if before[t] == "discarded"]
        self._on_ranks(ranks, "sleep", (offload, discard),
                       lambda: self.local.sleep(offload_tags=offload, discard_tags=discard))

    # -- the device communicator: suspended (NCCL >= 2.29.7) or released (--tp-release-comm-on-sleep) --

    def _suspend_comm(self) -> list[float]:
        """Every rank suspends its communicator (after the sleep succeeded everywhere). A rank that fails is
        logged and keeps its communicator's memory while asleep; the wake resumes the ones that suspended."""
        return self._after_sleep("comm_suspend", self.workers.group.suspend, "suspend")

    def _release_comm(self) -> list[float]:
        """Every rank drops its decode graphs and its communicator (after the sleep succeeded everywhere:
        a failed sleep rolls back with the communicator intact). A rank that fails is logged; the next
        wake's re-creation releases what it kept first."""
        from server.engine.parallel.comm_cycle import release

        return self._after_sleep("comm_release", lambda: release(self.runner, self.workers.group), "release")

    def _after_sleep(self, op: str, local, verb: str) -> list[float]:
        """`op` on every rank at once; a rank's failure is logged (its communicator's memory stays in use)."""
        outcomes = self.workers.run(op, None, local)
        for rank, value in sorted(outcomes.items()):
            if isinstance(value, BaseException):
                log.error("rank %d could not %s its device communicator (it stays in use while asleep): %s",
                          rank, verb, value)
        return [v if isinstance(v, float) else -1.0 for _, v in sorted(outcomes.items())]

    def _resume_comm(self, targets: list[str], before: dict[str, str]) -> list[float]:
        """Every suspended rank resumes (the others have nothing to do). Any rank failing: every rank back
        to sleep as before this wake, the ranks that resumed suspended again (the next wake resumes them all)."""
        try:
            return self._before_wake_ends("comm_resume", self.workers.group.resume, targets, before,
                                          "resuming the device communicator", "")
        except PoolError:
            self._suspend_comm()  # a no-op on the ranks still suspended
            raise

    def _recreate_comm(self, targets: list[str], before: dict[str, str]) -> list[dict[str, float]]:
        """A new communicator and re-captured graphs on every rank (a collective: every rank at once, as
        the group's first start). Any rank failing: every rank back to sleep as before this wake."""
        from server.engine.parallel.comm_cycle import recreate

        return self._before_wake_ends("comm_recreate", lambda: recreate(self.runner, self.workers.group), targets,
                                      before, "re-creating the device communicator", ", no communicator")

    def _before_wake_ends(self, op: str, local, targets: list[str], before: dict[str, str], doing: str,
                          left: str) -> list:
        """`op` on every rank at once; any rank failing puts every rank back to sleep and fails the wake."""
        outcomes = self.workers.run(op, None, local)
        failed = {r: v for r, v in outcomes.items() if isinstance(v, BaseException)}
        if failed:
            self._back_to_sleep(list(outcomes), targets, before)
            raise PoolError(f"wake_up failed {doing} on {self._name(failed)}; every rank was put back to sleep "
                            f"(tags {sorted(targets)} stay asleep{left}): free the resource named and call "
                            "wake_up again")
        return [v for _, v in sorted(outcomes.items())]

    @staticmethod
    def _timings(clock: Clock, outcomes: dict[int, Any], **extra: Any) -> dict[str, Any]:
        """This call's phases ("ranks": every rank's pool call, run at once; "comm_suspend", "comm_release",
        "comm_resume" or "comm_recreate"), rank 0's own pool phases, each rank's pool ms (and communicator ms:
        comm_ms)."""
        ranks = {r: v for r, v in sorted(outcomes.items()) if not isinstance(v, BaseException)}
        return clock.report(rank0=getattr(ranks.get(0), "timings", {}),
                            rank_ms=[getattr(v, "seconds", 0.0) * 1e3 for v in ranks.values()], **extra)

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

    def comm_states(self) -> list[dict]:
        """Each rank's device communicator: its generation and backend ("none" while released)."""
        outcomes = self.workers.run("comm_state", None, self.workers.group.state)
        for value in outcomes.values():
            if isinstance(value, BaseException):
                raise value
        return [outcomes[rank] for rank in sorted(outcomes)]

    @staticmethod
    def _name(failed: dict[int, BaseException]) -> str:
        return ", ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))

    # -- testing and lifetime ----------------------------------------------------------------------

    def inject_failure(self, rank: int, op: str, message: str) -> None:
        """Make rank's next `op` (sleep, wake) raise PoolError(message) before it touches memory, as a
        real out-of-memory would; comm_recreate raises once that rank's new communicator is up: the
        fault-injection hook of the all-or-nothing tests."""
        if rank == 0:
            raise ValueError("inject failures on a worker rank (1..N-1)")
        self.workers.send_one(rank, "inject_failure", (op, message))

    def close(self) -> None:
        try:
            self.workers.run_before_down()  # rank 0's decode graphs, while its pool still holds their memory
            self.local.close()
        finally:
            self.workers.close()
