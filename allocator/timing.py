"""Where a sleep or a wake spends its time: named wall-clock phases and the Python garbage collector.

A Clock is started at the top of a call and marked after each step (`clock.mark("unmap")`): a phase
is the time since the previous mark, so the phases add up to the call. It costs a perf_counter read
per mark and adds no device synchronization. The collector's pauses are counted process-wide through
gc.callbacks (installed once), because a full collection of a process that loaded torch, a model and
a tokenizer stops every Python thread for tens of milliseconds: a pause that lands inside a sleep
shows up as a slow sleep with no slow step, so every report says how many collections ran and how
long they took.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

_gc_lock = threading.Lock()
_gc_installed = False
# Collections finished (by generation) and their total seconds; _gc_start is when the one running
# began (collections never nest: the collector holds the GIL).
_gc_count = [0, 0, 0]
_gc_seconds = 0.0
_gc_start: float | None = None


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    global _gc_seconds, _gc_start
    if phase == "start":
        _gc_start = time.perf_counter()
    elif _gc_start is not None:
        _gc_seconds += time.perf_counter() - _gc_start
        _gc_start = None
        generation = int(info.get("generation", 2))
        _gc_count[min(max(generation, 0), 2)] += 1


def gc_totals() -> tuple[tuple[int, int, int], float]:
    """(collections per generation, seconds spent collecting) since the first call in this process."""
    global _gc_installed
    if not _gc_installed:
        with _gc_lock:
            if not _gc_installed:
                gc.callbacks.append(_on_gc)
                _gc_installed = True
    return (_gc_count[0], _gc_count[1], _gc_count[2]), _gc_seconds


def gc_since(start: tuple[tuple[int, int, int], float]) -> dict[str, Any]:
    """The collections since `start` (a gc_totals() value): how many per generation and how long.
    (Not gc.get_freeze_count(): it walks every frozen object, 25 ms for 500k on a loaded host.)"""
    counts, seconds = gc_totals()
    return {"collections": [c - c0 for c, c0 in zip(counts, start[0])], "ms": (seconds - start[1]) * 1e3}


class Clock:
    """Wall-clock phases of one call, in the order they first ran, and the collector's share."""

    def __init__(self) -> None:
        self._gc0 = gc_totals()
        self.start = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> float:
        """Close the phase that ran since the previous mark (phases marked twice add up); returns its seconds."""
        now = time.perf_counter()
        spent = now - self._last
        self.phases[phase] = self.phases.get(phase, 0.0) + spent
        self._last = now
        return spent

    def add(self, phase: str, seconds: float) -> None:
        """Count seconds measured elsewhere (another clock's phase) under a phase of this one; the
        caller keeps the sum equal to the call (MemoryPool folds its backend's phases in so)."""
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def mark_split(self, part: str, part_seconds: float, rest: str) -> None:
        """Close the phase since the previous mark as two: `part`, measured inside it (e.g. the
        waits of a loop), and `rest`, the remainder."""
        now = time.perf_counter()
        spent, self._last = now - self._last, now
        part_seconds = min(max(part_seconds, 0.0), spent)
        self.phases[part] = self.phases.get(part, 0.0) + part_seconds
        self.phases[rest] = self.phases.get(rest, 0.0) + spent - part_seconds

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def report(self, **extra: Any) -> dict[str, Any]:
        """{"total_ms", "phases_ms", "gc", **extra}: JSON-ready (floats and ints only)."""
        return {"total_ms": (self._last - self.start) * 1e3,
                "phases_ms": {k: v * 1e3 for k, v in self.phases.items()},
                "gc": gc_since(self._gc0), **extra}
