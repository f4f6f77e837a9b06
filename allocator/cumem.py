"""ctypes binding of csrc/sleep_alloc.c: the allocation registry and its map/unmap operations.

This module only loads our own library; driver work done from Python goes through cuda-python
(allocator/driver.py). The library is built on first use when missing or stale.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .types import PoolError

ABI_VERSION = 4  # must match SA_ABI_VERSION in csrc/sleep_alloc.c
TAG_MAX = 96  # must match SA_TAG_MAX
# The timed driver calls, in the order sa_stats reports them.
STAT_OPS = ("reserve", "create", "map", "access", "unmap", "release", "sync", "address_free")


class _Info(ctypes.Structure):
    _fields_ = [
        ("ptr", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("device", ctypes.c_int32),
        ("mapped", ctypes.c_int32),
        ("tag", ctypes.c_char * TAG_MAX),
    ]


@dataclass(frozen=True)
class Allocation:
    ptr: int
    size: int
    device: int
    mapped: bool
    tag: str


def _strings(items: Sequence[str]) -> "ctypes.Array[ctypes.c_char_p]":
    return (ctypes.c_char_p * len(items))(*(t.encode() for t in items))


def _shown(tag: str) -> str:
    """A registry tag as users know it (without the per-pool "poolN/" prefix)."""
    return tag.partition("/")[2] or tag


def _allocation(info: _Info) -> Allocation:
    return Allocation(int(info.ptr), int(info.size), int(info.device), bool(info.mapped), info.tag.decode())


class CuMemLibrary:
    """The loaded library. Methods raise PoolError carrying the C side's message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during calls: map/unmap can be long
        self._lib = lib
        sig = {
            "sa_abi_version": ([], ctypes.c_int),
            "sa_tag_max": ([], ctypes.c_int),
            "sa_last_error": ([], ctypes.c_char_p),
            "sa_init": ([], ctypes.c_int),
            "sa_set_thread_tag": ([ctypes.c_char_p], ctypes.c_int),
            "sa_thread_tag": ([], ctypes.c_char_p),
            "sa_set_capture_tag": ([ctypes.c_char_p], ctypes.c_int),
            "sa_list": ([ctypes.c_char_p, ctypes.POINTER(_Info), ctypes.c_int64], ctypes.c_int64),
            "sa_lookup": ([ctypes.c_uint64, ctypes.POINTER(_Info)], ctypes.c_int),
            "sa_unmap_tags": ([ctypes.POINTER(ctypes.c_char_p), ctypes.c_int], ctypes.c_int64),
            "sa_map_tags": ([ctypes.POINTER(ctypes.c_char_p), ctypes.c_int], ctypes.c_int64),
            "sa_unmap_ptrs": ([ctypes.POINTER(ctypes.c_uint64), ctypes.c_int64, ctypes.c_int], ctypes.c_int64),
            "sa_map_ptrs": ([ctypes.POINTER(ctypes.c_uint64), ctypes.c_int64], ctypes.c_int64),
            "sa_stats": ([ctypes.POINTER(ctypes.c_uint64), ctypes.c_int], ctypes.c_int),
            "sa_stats_reset_max": ([], None),
            "sa_granularity": ([ctypes.c_int], ctypes.c_int64),
            "sa_reserve": ([ctypes.c_uint64, ctypes.c_int], ctypes.c_uint64),
            "sa_add_piece": ([ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p], ctypes.c_int),
            "sa_free_reservation": ([ctypes.c_uint64], ctypes.c_int),
        }
        for name, (args, res) in sig.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = res
        if lib.sa_abi_version() != ABI_VERSION or lib.sa_tag_max() != TAG_MAX:
            raise PoolError(
                f"{path} is a different build (ABI {lib.sa_abi_version()}, expected {ABI_VERSION}); "
                "rebuild it with `python -m allocator.build`"
            )

    def _error(self, what: str) -> PoolError:
        msg = (self._lib.sa_last_error() or b"").decode(errors="replace")
        return PoolError(f"{what}: {msg}" if msg else what)

    def init(self) -> None:
        """Load libcuda and resolve its entry points (PoolError when there is no driver)."""
        if self._lib.sa_init() != 0:
            raise self._error("the CUDA pool library cannot start")

    def set_thread_tag(self, tag: str | None) -> None:
        if self._lib.sa_set_thread_tag(tag.encode() if tag else None) != 0:
            raise self._error("set_thread_tag")

    def thread_tag(self) -> str | None:
        return (self._lib.sa_thread_tag() or b"").decode() or None

    def set_capture_tag(self, tag: str | None) -> None:
        if self._lib.sa_set_capture_tag(tag.encode() if tag else None) != 0:
            raise self._error("set_capture_tag")

    def list(self, prefix: str = "") -> list[Allocation]:
        """Allocations whose tag starts with prefix (all when empty)."""
        raw_prefix = prefix.encode() if prefix else None
        cap = 256
        while True:
            buf = (_Info * cap)()
            n = self._lib.sa_list(raw_prefix, buf, cap)
            if n <= cap:
                return [_allocation(buf[i]) for i in range(n)]
            cap = int(n) + 64  # the registry grew between the calls; try again

    def lookup(self, addr: int) -> Allocation | None:
        info = _Info()
        return _allocation(info) if self._lib.sa_lookup(addr, ctypes.byref(info)) else None

    def unmap_tags(self, tags: Sequence[str]) -> int:
        """Release the physical memory of every mapped allocation of the tags: one device
        synchronization, then one C loop. Returns the bytes released."""
        if not tags:
            return 0
        n = self._lib.sa_unmap_tags(_strings(tags), len(tags))
        if n < 0:
            raise self._error(f"releasing the memory of tags {[_shown(t) for t in tags]}")
        return int(n)

    def map_tags(self, tags: Sequence[str]) -> int:
        """Re-create and map every unmapped allocation of the tags, all or nothing. Returns the
        bytes mapped."""
        if not tags:
            return 0
        n = self._lib.sa_map_tags(_strings(tags), len(tags))
        if n < 0:
            raise self._error(f"re-creating the memory of tags {[_shown(t) for t in tags]}")
        return int(n)

    def unmap_ptrs(self, ptrs: Sequence[int], synchronize: bool = True) -> int:
        """Release the listed allocations. synchronize=False: the caller guarantees no device
        work uses them any more (e.g. an event after their last copy completed)."""
        if not ptrs:
            return 0
        arr = (ctypes.c_uint64 * len(ptrs))(*ptrs)
        n = self._lib.sa_unmap_ptrs(arr, len(ptrs), 1 if synchronize else 0)
        if n < 0:
            raise self._error(f"releasing {len(ptrs)} allocation(s)")
        return int(n)

    def map_ptrs(self, ptrs: Sequence[int]) -> int:
        """Re-create and map the listed allocations, all or nothing. Returns the bytes mapped."""
        if not ptrs:
            return 0
        arr = (ctypes.c_uint64 * len(ptrs))(*ptrs)
        n = self._lib.sa_map_ptrs(arr, len(ptrs))
        if n < 0:
            raise self._error(f"re-creating {len(ptrs)} allocation(s)")
        return int(n)

    def granularity(self, device: int) -> int:
        """The device's physical-memory granularity (2 MiB on current GPUs)."""
        g = self._lib.sa_granularity(device)
        if g <= 0:
            raise self._error(f"reading the allocation granularity of device {device}")
        return int(g)

    def reserve(self, size: int, device: int) -> int:
        """Virtual addresses only (size: a multiple of the granularity); pieces get physical memory."""
        ptr = self._lib.sa_reserve(size, device)
        if not ptr:
            raise self._error(f"reserving {size / 2**30:.2f} GiB of addresses on device {device}")
        return int(ptr)

    def add_piece(self, ptr: int, size: int, tag: str) -> None:
        """Physical memory for [ptr, ptr+size) inside a reservation, recorded under tag."""
        if self._lib.sa_add_piece(ptr, size, tag.encode()) != 0:
            raise self._error(f"creating {size / 2**20:.1f} MiB at 0x{ptr:x} for tag '{_shown(tag)}'")

    def free_reservation(self, ptr: int) -> None:
        if self._lib.sa_free_reservation(ptr) != 0:
            raise self._error(f"freeing the reservation at 0x{ptr:x}")

    def driver_stats(self, reset_max: bool = False) -> dict[str, tuple[int, int, int, int]]:
        """{call: (calls, nanoseconds, bytes, longest call's nanoseconds)} of the timed driver
        calls: cumulative, except the longest call, which counts since the last reset_max."""
        buf = (ctypes.c_uint64 * (4 * len(STAT_OPS)))()
        self._lib.sa_stats(buf, len(buf))
        if reset_max:
            self._lib.sa_stats_reset_max()
        return {op: tuple(int(buf[4 * i + k]) for k in range(4)) for i, op in enumerate(STAT_OPS)}  # type: ignore[misc]


_lock = threading.Lock()
_library: CuMemLibrary | None = None
_allocator = None


def library() -> CuMemLibrary:
    """The process-wide library, built if needed and started (one registry per process)."""
    global _library
    with _lock:
        if _library is None:
            from .build import BuildError, ensure_library

            try:
                path = ensure_library()
            except BuildError as err:
                raise PoolError(f"the CUDA pool needs its C library: {err}") from err
            lib = CuMemLibrary(path)
            lib.init()
            _library = lib
        return _library


def pluggable_allocator():  # -> torch.cuda.memory.CUDAPluggableAllocator
    """The process-wide torch allocator over sleep_malloc/sleep_free. Kept alive for the whole
    process: MemPools and their segments refer to it."""
    global _allocator
    lib = library()
    with _lock:
        if _allocator is None:
            import torch

            _allocator = torch.cuda.memory.CUDAPluggableAllocator(str(lib.path), "sleep_malloc", "sleep_free")
        return _allocator
