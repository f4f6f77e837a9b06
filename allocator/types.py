"""The pool's vocabulary: its error, tag states, the reports it returns, and the backend contract."""

from __future__ import annotations

import re
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Collection, Protocol, Sequence

import torch


class PoolError(RuntimeError):
    """A pool operation failed. The message says what happened and what to do next."""


class TagState(str, Enum):
    AWAKE = "awake"
    OFFLOADED = "offloaded"  # bytes saved to a host backup, physical memory released
    DISCARDED = "discarded"  # physical memory released, content lost


# Tags end up in file names (CPU backups) and in a fixed-size C field (CUDA registry).
TAG_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def check_tag(tag: object) -> str:
    if not isinstance(tag, str) or not TAG_PATTERN.match(tag):
        raise PoolError(
            f"invalid tag {tag!r}: use 1-64 characters from letters, digits and _ . : - "
            "(for example 'weights', 'kv_cache', 'cuda_graph')"
        )
    return tag


@dataclass(frozen=True)
class PoolSleepReport:
    bytes_offloaded: int
    bytes_discarded: int
    seconds: float  # the whole call, from entry to memory released and device synchronized
    # From the first backup copy started to the last one done (CUDA: discarded tags are
    # unmapped meanwhile). 0 when nothing was offloaded.
    copy_seconds: float = 0.0
    # Where the time went (allocator/timing.py): {"total_ms", "phases_ms": {phase: ms}, "gc", and on
    # CUDA "driver": {call: {"calls", "ms", "bytes", "longest_ms"}}, "kv_mapper": the background
    # mapping of the last wake, as this sleep found it}. Phases add up to total_ms.
    timings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PoolWakeReport:
    bytes_restored: int
    bytes_mapped: int  # physical memory re-created, restored tags included
    seconds: float
    copy_seconds: float = 0.0  # from the first restore copy started to the last one done
    timings: dict[str, Any] = field(default_factory=dict)  # as PoolSleepReport.timings


@dataclass(frozen=True)
class TagStats:
    bytes: int  # reserved by the tag's allocations, whether or not they are backed right now
    allocations: int
    state: str


@dataclass(frozen=True)
class PoolStats:
    backend: str
    device: str
    tags: dict[str, TagStats] = field(default_factory=dict)
    host_backup_bytes: int = 0  # pinned host buffers (CUDA) or backup files on disk (CPU)
    device_free: int = 0  # CUDA: cuMemGetInfo; CPU: MemAvailable from /proc/meminfo
    device_total: int = 0
    # Per tag with a chunked tensor (empty_chunked): chunks mapped now of how many, and the last
    # background mapping (MemoryPool: _Chunks.describe).
    chunks: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TagUsage:
    bytes: int
    allocations: int


@dataclass(frozen=True)
class SleepCost:
    bytes_offloaded: int
    bytes_discarded: int
    copy_seconds: float


@dataclass(frozen=True)
class WakeCost:
    bytes_restored: int
    bytes_mapped: int
    copy_seconds: float


class Backup(Protocol):
    """A tag's host copy: kept across cycles (pinning is slow) until the pool releases it."""

    @property
    def nbytes(self) -> int: ...  # host bytes held (pinned buffer, or file on disk)

    def release(self) -> None: ...


class Backend(Protocol):
    """What a memory backend does for MemoryPool, which owns the per-tag state and its rules.

    sleep() and wake() receive only tags that have allocations and are in the right state.
    wake() is all or nothing: on failure it releases again whatever it re-created, then raises
    PoolError. After any failure the pool asks released() to learn what state each tag is in.
    """

    name: str
    device: torch.device
    backups: dict[str, Backup]  # by tag; created by sleep(), released by the pool

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str) -> torch.Tensor: ...

    def use(self, tag: str) -> AbstractContextManager[None]: ...

    def graph_pool(self, tag: str) -> Any: ...

    def usage(self) -> dict[str, TagUsage]: ...

    def tag_of(self, address: int) -> str | None: ...

    def released(self, tag: str) -> bool: ...

    def sleep(self, offload: Sequence[str], discard: Sequence[str]) -> SleepCost: ...

    # Seconds the device goes on working on memory this backend has just released (the CUDA driver
    # clears it), during which creating memory waits for it and slows the kernels running beside it;
    # 0 where nothing does.
    def clearing_seconds(self, nbytes: int) -> float: ...

    # defer: piece addresses (from empty_chunked) of the remapped tags to leave unmapped for now;
    # the pool maps them later with map_pieces(). warm_caches: this wake leaves nothing asleep, so the
    # backend may give back caches outside the pool that sleep returned (CUDA: torch's own allocator).
    def wake(self, restore: Sequence[str], remap: Sequence[str], defer: Collection[int] = (),
             warm_caches: bool = False) -> WakeCost: ...

    granularity: int  # bytes at which physical memory can be split

    # A tensor over one address range whose memory comes in pieces, each (offset, size) its own
    # physical memory (one per chunk). Returns the tensor and the pieces' addresses.
    def empty_chunked(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str,
                      pieces: list[tuple[int, int]]) -> tuple[torch.Tensor, list[int]]: ...

    def map_pieces(self, addresses: Sequence[int]) -> int: ...  # all or nothing

    def check_backup_space(self, nbytes: int) -> None: ...

    # Called from a background thread (MemoryPool.prepare_backups) while the engine serves; the pool
    # waits for it before any sleep, release or close touches the backups.
    def prepare_backup(self, tag: str) -> int: ...

    def backup_room(self) -> int: ...

    def memory_info(self) -> tuple[int, int]: ...

    # The phases of the last sleep() or wake() (allocator/timing.py Clock.report()), read by the pool
    # right after the call.
    last_timings: dict[str, Any]

    def close(self) -> None: ...
