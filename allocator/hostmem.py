"""Host memory for backups: how much the host can spare, and pinned buffers built off the driver's lock.

A pinned buffer is an anonymous private mapping whose pages are faulted in by the kernel (no driver
call), then registered with CUDA in pieces of PIECE_BYTES. cuMemHostAlloc of the same size does the
faulting and the zeroing inside one driver call (8 GiB: ~2.8 s on an H200 host), which is why the
first level-1 sleep used to cost seconds; here the slow part is plain host work that can run in a
background thread, and each registration is short, so it never holds the driver for long while
the engine serves. Copies never cross a piece: each piece is its own registration.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .types import PoolError

if TYPE_CHECKING:
    from .driver import DeviceContext

PIECE_BYTES = 1 << 30  # a multiple of every copy chunk and of the 2 MiB device granularity
HUGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels fault the pages by writing them

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def meminfo() -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes, from /proc/meminfo."""
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemAvailable", "MemTotal"):
                fields[key] = int(rest.split()[0]) * 1024
    return fields.get("MemAvailable", 0), fields.get("MemTotal", 0)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) reads as None


def cgroup_room() -> int | None:
    """Bytes this process's memory cgroup still allows (limit - usage), or None without a limit.
    A container's limit is what an out-of-memory kill enforces, whatever /proc/meminfo says."""
    v2 = Path("/sys/fs/cgroup")
    limit, usage = _read_int(v2 / "memory.max"), _read_int(v2 / "memory.current")
    if limit is None:
        v1 = v2 / "memory"
        limit, usage = _read_int(v1 / "memory.limit_in_bytes"), _read_int(v1 / "memory.usage_in_bytes")
        if limit is not None and limit >= 1 << 60:  # v1 writes "no limit" as a huge number
            limit = None
    if limit is None:
        return None
    return max(0, limit - (usage or 0))


def host_room() -> int:
    """Host memory that could be taken now without swapping or hitting the container's limit."""
    available, _ = meminfo()
    room = cgroup_room()
    return available if room is None else min(available, room)


def protect(address: int, nbytes: int, readable: bool) -> None:
    """mprotect a page-aligned range: PROT_NONE makes any access fault (SIGSEGV), which is how the CPU
    backend proves that nothing reads memory while it is released."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE if readable else 0  # PROT_NONE
    if _libc.mprotect(address, nbytes, prot) != 0:
        err = ctypes.get_errno()
        raise PoolError(f"mprotect(0x{address:x}, {nbytes}) failed: {os.strerror(err)}")


class PinnedBuffer:
    """nbytes of page-locked host memory in registered pieces; release() gives it back."""

    def __init__(self, ctx: "DeviceContext", nbytes: int, piece_bytes: int = PIECE_BYTES) -> None:
        from . import driver

        self._ctx = ctx
        self.piece_bytes = piece_bytes
        self.nbytes = -(-max(nbytes, 1) // HUGE) * HUGE
        addr = _libc.mmap(None, self.nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if addr in (None, _MAP_FAILED):
            raise PoolError(f"mmap of {self.nbytes / 2**30:.2f} GiB of host memory failed: "
                            f"{os.strerror(ctypes.get_errno())}")
        self.ptr = int(addr)
        self._registered: list[int] = []
        self._allocated = False  # True: one cuMemHostAlloc buffer (the fallback below)
        try:
            _libc.madvise(self.ptr, self.nbytes, MADV_HUGEPAGE)  # fewer pages to pin; fine if refused
            for start in range(0, self.nbytes, piece_bytes):
                size = min(piece_bytes, self.nbytes - start)
                self._populate(self.ptr + start, size)
                driver.host_register(ctx, self.ptr + start, size)
                self._registered.append(self.ptr + start)
        except PoolError:
            # Registration refused (a driver or host that does not allow it): one cuMemHostAlloc
            # buffer instead, the way backups were made before; slower to make, same copies.
            self.release()
            self.ptr = driver.host_alloc(ctx, self.nbytes)
            self.piece_bytes, self._allocated = self.nbytes, True
        except BaseException:
            self.release()
            raise

    @staticmethod
    def _populate(address: int, size: int) -> None:
        """Fault the pages in now (ctypes drops the GIL meanwhile), not inside the driver call."""
        if _libc.madvise(address, size, MADV_POPULATE_WRITE) != 0:
            ctypes.memset(address, 0, size)

    def spans(self, offset: int, nbytes: int, chunk_bytes: int) -> Iterator[tuple[int, int, int]]:
        """(host address, offset within the range, length) pieces of [offset, offset + nbytes), at
        most chunk_bytes each and never across a registration."""
        done = 0
        while done < nbytes:
            at = offset + done
            edge = (at // self.piece_bytes + 1) * self.piece_bytes
            n = min(chunk_bytes, nbytes - done, edge - at)
            yield self.ptr + at, done, n
            done += n

    def release(self) -> None:
        from . import driver

        if self._allocated:
            driver.host_free(self._ctx, self.ptr)
            self.ptr, self._allocated = 0, False
            return
        for address in self._registered:
            try:
                driver.host_unregister(self._ctx, address)
            except PoolError:
                pass  # the mapping goes below anyway; a context being torn down unpins by itself
        self._registered = []
        if self.ptr:
            _libc.munmap(self.ptr, self.nbytes)
            self.ptr = 0
