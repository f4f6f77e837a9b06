"""CPU backend: every tensor lives in its own private anonymous mmap arena.

Sleep releases the arena's pages with madvise(MADV_DONTNEED), so the process's RSS really drops,
while the mapping (and so every tensor's address) stays. The mapping must be MAP_PRIVATE: on a
shared mapping MADV_DONTNEED drops only this process's page-table entries, not the memory.
Offloaded tags are first written to an unlinked backup file (backup.open_unlinked: no name on disk,
gone with the process) and read back bit-exact on wake; discarded tags come back as zero pages.

An arena lives as long as some tensor views it (torch.frombuffer keeps the mmap alive): the pool
holds only weak references, so a dropped tensor returns its memory to the OS at once.
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile
import time
import weakref
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Collection, Sequence

import torch

from .backup import FileBackup
from .hostmem import meminfo, protect
from .timing import Clock
from .types import PoolError, SleepCost, TagUsage, WakeCost

PAGE = mmap.PAGESIZE


class _Arena:
    __slots__ = ("ref", "address", "size", "resident", "backup_offset", "pieces", "__weakref__")

    def __init__(self, mm: mmap.mmap, address: int, size: int) -> None:
        self.ref = weakref.ref(mm)
        self.address = address
        self.size = size
        self.resident = True
        self.backup_offset = -1
        # A chunked arena (empty_chunked): piece address -> [size, mapped]. A piece that is not
        # mapped is PROT_NONE, so anything that touches it before the pool maps it faults.
        self.pieces: dict[int, list] | None = None

    def release_pages(self) -> None:
        mm = self.ref()
        if mm is not None:
            mm.madvise(mmap.MADV_DONTNEED)
            for address, piece in (self.pieces or {}).items():
                if piece[1]:
                    protect(address, piece[0], readable=False)
                    piece[1] = False
        self.resident = False

    def map_piece(self, address: int) -> int:
        """Make a piece usable again (zero pages, as after MADV_DONTNEED). Returns its bytes."""
        assert self.pieces is not None
        piece = self.pieces[address]
        if piece[1]:
            return 0
        protect(address, piece[0], readable=True)
        piece[1] = True
        return piece[0]


def default_backup_dir() -> Path:
    return Path(os.environ.get("SLEEPSERVE_BACKUP_DIR") or tempfile.gettempdir())


class HostBackend:
    name = "cpu-mmap"

    def __init__(self, backup_dir: str | os.PathLike[str] | None = None) -> None:
        self.device = torch.device("cpu")
        self._dir = Path(backup_dir) if backup_dir is not None else default_backup_dir()
        self._arenas: dict[str, list[_Arena]] = {}
        self.backups: dict[str, FileBackup] = {}  # released by MemoryPool
        self.last_timings: dict[str, Any] = {}  # the phases of the last sleep or wake (allocator/timing.py)

    def _live(self, tag: str) -> list[tuple[_Arena, mmap.mmap]]:
        """The tag's arenas still viewed by some tensor (dead ones are dropped)."""
        live, kept = [], []
        for arena in self._arenas.get(tag, []):
            mm = arena.ref()
            if mm is not None:
                live.append((arena, mm))
                kept.append(arena)
        self._arenas[tag] = kept
        return live

    # ------------------------------------------------------------------ allocation

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str) -> torch.Tensor:
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)  # nothing to pool
        size = -(-numel * dtype.itemsize // PAGE) * PAGE
        try:
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as err:
            raise PoolError(f"mmap of {size / 2**20:.1f} MiB for tag '{tag}' failed: {err}") from err
        tensor = torch.frombuffer(mm, dtype=dtype, count=numel).view(shape)
        self._arenas.setdefault(tag, []).append(_Arena(mm, tensor.data_ptr(), size))
        return tensor

    granularity = PAGE

    def empty_chunked(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str,
                      pieces: list[tuple[int, int]]) -> tuple[torch.Tensor, list[int]]:
        tensor = self.empty(shape, dtype, tag)
        arena = self._arenas[tag][-1]
        arena.pieces = {arena.address + offset: [size, True] for offset, size in pieces}
        return tensor, [arena.address + offset for offset, _ in pieces]

    def _piece_owner(self, address: int) -> _Arena:
        # A read-only walk: the pool's background mapper calls this beside the engine's thread.
        for arenas in list(self._arenas.values()):
            for arena in list(arenas):
                if arena.pieces is not None and address in arena.pieces and arena.ref() is not None:
                    return arena
        raise PoolError(f"0x{address:x} is not a piece of a chunked tensor of this pool")

    def map_pieces(self, addresses: Sequence[int]) -> int:
        done: list[tuple[_Arena, int]] = []
        total = 0
        try:
            for address in addresses:
                arena = self._piece_owner(address)
                n = arena.map_piece(address)
                if n:
                    done.append((arena, address))
                total += n
        except PoolError:
            for arena, address in done:  # all or nothing
                piece = arena.pieces[address]  # type: ignore[index]
                protect(address, piece[0], readable=False)
                piece[1] = False
            raise
        return total

    def use(self, tag: str) -> Any:
        return nullcontext()  # MemoryPool tracks the default tag of empty()

    def graph_pool(self, tag: str) -> Any:
        raise PoolError("graph_pool() needs the CUDA backend: CUDA graphs do not exist on CPU")

    def usage(self) -> dict[str, TagUsage]:
        out = {}
        for tag in list(self._arenas):
            live = self._live(tag)
            if live:
                out[tag] = TagUsage(sum(a.size for a, _ in live), len(live))
        return out

    def tag_of(self, address: int) -> str | None:
        for tag in list(self._arenas):
            for arena, _ in self._live(tag):
                if arena.address <= address < arena.address + arena.size:
                    return tag
        return None

    def clearing_seconds(self, nbytes: int) -> float:
        return 0.0  # munmap'd pages are the kernel's business: nothing here waits for them

    def released(self, tag: str) -> bool:
        return any(not a.resident or any(not p[1] for p in (a.pieces or {}).values()) for a, _ in self._live(tag))

    # ------------------------------------------------------------------ sleep and wake

    def _backup(self, tag: str) -> FileBackup:
        if tag not in self.backups:
            self.backups[tag] = FileBackup(self._dir)
        return self.backups[tag]

    def sleep(self, offload: Sequence[str], discard: Sequence[str]) -> SleepCost:
        clock = Clock()
        start = clock.start
        offloaded = discarded = 0
        # Every backup is written before any page is released: a full disk fails the call with
        # all memory intact.
        for tag in offload:
            live = self._live(tag)
            offsets = self._backup(tag).write([memoryview(mm) for _, mm in live])
            for (arena, _), offset in zip(live, offsets):
                arena.backup_offset = offset
            offloaded += sum(a.size for a, _ in live)
        copy_seconds = time.perf_counter() - start
        clock.mark("write_backups")
        for tag in [*offload, *discard]:
            for arena, _ in self._live(tag):
                arena.release_pages()
                if tag in discard:
                    discarded += arena.size
        clock.mark("release")
        self.last_timings = clock.report()
        return SleepCost(offloaded, discarded, copy_seconds)

    def wake(self, restore: Sequence[str], remap: Sequence[str], defer: Collection[int] = (),
             warm_caches: bool = False) -> WakeCost:
        clock = Clock()
        start = clock.start
        restored = mapped = 0
        try:
            for tag in restore:
                backup = self._backup(tag)
                for arena, mm in self._live(tag):
                    if not arena.resident:
                        for address in arena.pieces or ():
                            arena.map_piece(address)
                        backup.read_into(memoryview(mm), arena.backup_offset)
                        arena.resident = True
                        restored += arena.size
                        mapped += arena.size
            copy_seconds = time.perf_counter() - start
            clock.mark("read_backups")
            for tag in remap:
                # Released private anonymous pages read back as zeros: nothing to do but count.
                for arena, _ in self._live(tag):
                    if not arena.resident:
                        arena.resident = True
                        if arena.pieces is None:
                            mapped += arena.size
                        for address in arena.pieces or ():
                            if address not in defer:
                                mapped += arena.map_piece(address)
        except PoolError:
            # All or nothing: every tag of this call goes back to sleep, the one that failed
            # half-way included. Their backups are untouched, so a later wake can succeed.
            for tag in [*restore, *remap]:
                for arena, _ in self._live(tag):
                    arena.release_pages()
            raise
        clock.mark("map")
        self.last_timings = clock.report()
        return WakeCost(restored, mapped, copy_seconds)

    # ------------------------------------------------------------------ lifetime

    def check_backup_space(self, nbytes: int) -> None:
        """Fail now, not at the first sleep, when the offload folder cannot hold nbytes."""
        try:
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.statvfs(self._dir)
        except OSError as err:
            raise PoolError(f"the offload folder {self._dir} is not usable: {err}; choose another one "
                            "(--offload-dir or SLEEPSERVE_OFFLOAD_DIR)") from err
        free = st.f_bavail * st.f_frsize
        if free < nbytes:
            raise PoolError(
                f"the offload folder {self._dir} has {free / 2**20:.0f} MiB of free space, less than the "
                f"{nbytes / 2**20:.0f} MiB the weights take while asleep at level 1; free disk space or "
                "choose a bigger folder (--offload-dir or SLEEPSERVE_OFFLOAD_DIR)")

    def prepare_backup(self, tag: str) -> int:
        """Reserve the disk blocks of the tag's backup file before its first sleep."""
        # Read-only walk (no _live(): this runs beside the engine's thread, which may allocate).
        nbytes = sum(a.size for a in list(self._arenas.get(tag, [])) if a.ref() is not None)
        self._backup(tag).reserve(nbytes)
        return nbytes

    def backup_room(self) -> int:
        """Free space in the offload folder: where CPU backups go."""
        try:
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.statvfs(self._dir)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def memory_info(self) -> tuple[int, int]:
        return meminfo()

    def close(self) -> None:
        for tag in list(self._arenas):
            for arena, _ in self._live(tag):
                arena.release_pages()
        self._arenas.clear()
