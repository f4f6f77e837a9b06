"""CUDA backend: torch allocations routed to csrc/sleep_alloc.c, one torch MemPool per tag.

Each tag has its own MemPool over the same pluggable allocator, so torch never puts blocks of
two tags in one segment and a tag's sleep never unmaps another tag's memory. The C library
records each segment under the tag the allocating thread set (pool.use) or, for allocations a
CUDA graph capture routes to a pool, under the tag pool.graph_pool() named.

Sleep: synchronize once, copy offloaded tags to pinned backups on our own stream, release the
discarded tags while the copies run and each group of offloaded allocations as soon as its copies
are done, then return torch's own caches (cuBLAS workspaces, cached blocks) and the driver's grown
local memory, so device memory really drops to a bare process's footprint.
Wake: map the discarded tags (but the pieces of chunked tensors the pool maps later, in the
background), then the offloaded ones group by group, each group's copies starting as soon as it is
mapped; wait; restore the local memory.
Chunked tensors (empty_chunked): one reserved range whose pieces are registry entries of their own,
wrapped in a tensor through __cuda_array_interface__; torch never allocates or frees them.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from itertools import count
from typing import Any, Collection, Iterator, Sequence

import torch

from . import cumem
from .backup import Copier, PinnedBackup, groups
from .driver import DeviceContext, DeviceRange
from .timing import Clock
from .types import PoolError, SleepCost, TagUsage, WakeCost

_serial = count()

# How long the driver goes on clearing device memory after cuMemRelease returns, per GiB released.
# H200, driver 580 (2026-12-02): creating 117.4 GiB right after a sleep released it waited 313-337 ms
# in cuMemCreate, and a device copy ran 10% slower for 200-300 ms after a 100 GiB release.
CLEARING_SECONDS_PER_GIB = 2.8e-3


def expandable_segments_requested() -> bool:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in os.environ.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return True
    return False


class _ExpandableSegmentsOff:
    """Turns torch's expandable segments off while any pool.use() is open, process-wide.

    Depending on the torch version, expandable segments either bypass a MemPool's custom
    allocator or refuse it; either way the pool would hold nothing to release. The setting is
    global, so nested and concurrent use() contexts share one counter.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                torch.cuda.memory._set_allocator_settings("expandable_segments:False")
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                torch.cuda.memory._set_allocator_settings("expandable_segments:True")


_expandable_off = _ExpandableSegmentsOff()


class _Clock(Clock):
    """A Clock (allocator/timing.py) that also reports the driver calls' totals over the call: how
    many cuMemCreate / cuMemMap / cuMemUnmap / cuMemRelease / cuCtxSynchronize calls, their summed
    and longest milliseconds, and their bytes (bench/pool_diag.py reads backend.last_timings; the
    pool puts it in every sleep and wake report)."""

    def __init__(self, lib: cumem.CuMemLibrary) -> None:
        self._lib = lib
        self._driver0 = lib.driver_stats(reset_max=True)
        super().__init__()

    def report(self, **extra: Any) -> dict[str, Any]:
        driver = {}
        for op, (calls, ns, nbytes, longest) in self._lib.driver_stats().items():
            calls0, ns0, bytes0, _ = self._driver0[op]
            if calls != calls0:
                driver[op] = {"calls": calls - calls0, "ms": (ns - ns0) / 1e6, "bytes": nbytes - bytes0,
                              "longest_ms": longest / 1e6}
        return super().report(driver=driver, **extra)


class CudaBackend:
    name = "cuda-vmm"

    # Sleep releases the discarded tags while the backup copies run, and each group of about
    # group_bytes of an offloaded tag as soon as its copies are done; wake maps the discarded tags
    # first, then the offloaded ones group by group, each group's copies starting as soon as it is
    # mapped. Every other order measured slower on an H200 (docs/results/pool-findings.md).
    group_bytes = 512 << 20

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise PoolError("CUDA is not available here (torch.cuda.is_available() is False); use create_pool('cpu')")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if not 0 <= index < torch.cuda.device_count():
            raise PoolError(f"no CUDA device {index}: this process sees {torch.cuda.device_count()}")
        self.device = torch.device("cuda", index)
        torch.cuda.init()
        self._lib = cumem.library()
        self._allocator = cumem.pluggable_allocator()
        self._ns = f"pool{next(_serial)}/"  # C-side tag prefix: pools in one process never mix
        self._ctx = DeviceContext(index)
        self._copier = Copier(self._ctx)
        self._mempools: dict[str, Any] = {}
        self.backups: dict[str, PinnedBackup] = {}  # released by MemoryPool
        self._reservations: list[int] = []  # ranges of empty_chunked(), freed by close()
        self._reserved_bytes: dict[int, int] = {}  # their sizes: pieces inside are not torch's segments
        # What the last sleep's release of torch's own cache gave back to the driver (cached activation
        # blocks, cuBLAS workspaces; not segments live tensors keep): the last wake gives it back while its
        # copies run.
        self._torch_cache_bytes = 0
        self._expandable = expandable_segments_requested()
        self._local = threading.local()
        self.last_timings: dict[str, Any] = {}
        # The per-thread stack size a fresh context has (1 KiB unless the process already asked
        # for more): what sleep lowers it to; wake puts back what the kernels had grown it to.
        self._stack_base = min(self._ctx.stack_size(), 1024)
        self._stack_restore: int | None = None
        missing = [f for f in ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool",
                               "_cuda_releasePool") if not hasattr(torch._C, f)]
        if missing:
            raise PoolError(f"this torch ({torch.__version__}) lacks {missing}: the CUDA pool needs torch >= 2.8")
        if self._expandable and not hasattr(torch.cuda.memory, "_set_allocator_settings"):
            raise PoolError(
                "PYTORCH_CUDA_ALLOC_CONF enables expandable_segments and this torch cannot turn them "
                "off inside the pool, whose memory would then not be freed by sleep; unset it"
            )

    # ------------------------------------------------------------------ allocation

    def _mempool(self, tag: str) -> Any:
        pool = self._mempools.get(tag)
        if pool is None:
            pool = self._mempools[tag] = torch.cuda.MemPool(self._allocator._allocator)
        return pool

    @contextmanager
    def use(self, tag: str) -> Iterator[None]:
        with torch.cuda.device(self.device):
            if torch.cuda.is_current_stream_capturing():
                raise PoolError(
                    "pool.use() inside a CUDA graph capture: the capture's pool would win and the "
                    "memory would be recorded under the wrong tag; capture with "
                    "pool=pool.graph_pool(tag) instead"
                )
        stack = self._routes()
        if stack and stack[-1] == tag:  # torch refuses to route one pool twice; nothing to do
            yield
            return
        previous_c_tag = self._lib.thread_tag()
        if self._expandable:
            _expandable_off.enter()
        # At most one of our pools is routed per thread at any time: torch versions disagree on
        # whether the innermost or the outermost routing wins, and the C tag must match it.
        if stack:
            self._unroute(stack[-1])
        try:
            self._route(tag)
        except BaseException:
            if stack:
                self._route(stack[-1])
            if self._expandable:
                _expandable_off.exit()
            raise
        stack.append(tag)
        self._lib.set_thread_tag(self._ns + tag)
        try:
            # The current device too, so plain "cuda" allocations inside land in this pool.
            with torch.cuda.device(self.device):
                yield
        finally:
            stack.pop()
            self._unroute(tag)
            if stack:
                self._route(stack[-1])
            self._lib.set_thread_tag(previous_c_tag)
            if self._expandable:
                _expandable_off.exit()

    def _routes(self) -> list[str]:
        stack = getattr(self._local, "routes", None)
        if stack is None:
            stack = self._local.routes = []
        return stack

    def _route(self, tag: str) -> None:
        """Send this thread's allocations on our device to the tag's MemPool (what
        torch.cuda.use_mem_pool does on entry)."""
        torch._C._cuda_beginAllocateCurrentThreadToPool(self.device.index, self._mempool(tag).id)

    def _unroute(self, tag: str) -> None:
        pool_id = self._mempool(tag).id
        torch._C._cuda_endAllocateToPool(self.device.index, pool_id)
        torch._C._cuda_releasePool(self.device.index, pool_id)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str) -> torch.Tensor:
        with self.use(tag):
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self.check_in_pool(tensor, tag)
        return tensor

    def check_in_pool(self, tensor: torch.Tensor, tag: str) -> None:
        """Raise unless the tensor's memory is in this pool under tag: memory that silently
        lands elsewhere is memory a sleep would not free."""
        if tensor.numel() == 0:
            return
        found = self._lib.lookup(tensor.data_ptr())
        if found is None or found.tag != self._ns + tag:
            where = f"in tag '{found.tag.removeprefix(self._ns)}'" if found else "outside the pool"
            raise PoolError(
                f"torch placed a tensor of tag '{tag}' {where} (at 0x{tensor.data_ptr():x}); "
                f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r} or "
                "another allocator setting overrides the pool: remove it"
            )

    @property
    def granularity(self) -> int:
        return self._lib.granularity(self.device.index)

    def empty_chunked(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str,
                      pieces: list[tuple[int, int]]) -> tuple[torch.Tensor, list[int]]:
        """One reserved range (not torch's: torch would free it), each piece its own physical
        memory and registry entry, wrapped in a tensor through __cuda_array_interface__."""
        nbytes = math.prod(shape) * dtype.itemsize
        ptr = self._lib.reserve(nbytes, self.device.index)
        try:
            for offset, size in pieces:
                self._lib.add_piece(ptr + offset, size, self._ns + tag)
            raw = torch.as_tensor(DeviceRange(ptr, nbytes), device=self.device)
            tensor = raw.view(dtype).view(shape)
        except Exception as err:
            self._lib.free_reservation(ptr)  # the pieces made so far go with it
            if isinstance(err, PoolError):
                raise
            raise PoolError(f"wrapping a chunked range in a tensor failed: {err}") from err
        self._reservations.append(ptr)
        self._reserved_bytes[ptr] = nbytes
        return tensor, [ptr + offset for offset, _ in pieces]

    def map_pieces(self, addresses: Sequence[int]) -> int:
        return self._lib.map_ptrs(list(addresses))

    def graph_pool(self, tag: str) -> Any:
        self._lib.set_capture_tag(self._ns + tag)
        return self._mempool(tag).id

    # ------------------------------------------------------------------ inspection

    def _allocations(self, tag: str) -> list[cumem.Allocation]:
        full = self._ns + tag
        return [a for a in self._lib.list(full) if a.tag == full]

    def usage(self) -> dict[str, TagUsage]:
        sizes: dict[str, list[int]] = defaultdict(list)
        for a in self._lib.list(self._ns):
            sizes[a.tag[len(self._ns):]].append(a.size)
        return {tag: TagUsage(sum(s), len(s)) for tag, s in sizes.items()}

    def tag_of(self, address: int) -> str | None:
        found = self._lib.lookup(address)
        if found is None or not found.tag.startswith(self._ns):
            return None
        return found.tag[len(self._ns):]

    def released(self, tag: str) -> bool:
        return any(not a.mapped for a in self._allocations(tag))

    def clearing_seconds(self, nbytes: int) -> float:
        return nbytes / (1 << 30) * CLEARING_SECONDS_PER_GIB

    def memory_info(self) -> tuple[int, int]:
        return self._ctx.mem_info()

    # ------------------------------------------------------------------ sleep and wake

    def verify(self, tags: Sequence[str]) -> None:
        """Raise unless every segment torch keeps in the tags' MemPools is ours: torch settings
        such as expandable segments could route memory around the allocator, and a sleep would
        then silently free nothing."""
        for tag in tags:
            pool = self._mempools.get(tag)
            if pool is None:
                continue
            strays = [s for s in pool.snapshot() if self.tag_of(int(s["address"])) != tag]
            if strays:
                raise PoolError(
                    f"{len(strays)} segment(s) of tag '{tag}' ({sum(int(s['total_size']) for s in strays) / 2**20:.1f} MiB) "
                    f"are not pool memory and would not be freed by sleep; "
                    f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r} routes "
                    "allocations around the pool: unset expandable_segments"
                )

    def sleep(self, offload: Sequence[str], discard: Sequence[str]) -> SleepCost:
        clock = _Clock(self._lib)
        if self._expandable:
            self.verify([*offload, *discard])
        # The one device-wide synchronization: from here on, the only device work touching the
        # slept tags is our own copies, whose completion events say when each allocation is
        # free to release; the pool's lock keeps new work off these tags until we return.
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
        clock.mark("synchronize")
        # Pinned buffers first (seconds on the first cycle, free afterwards): a failure here
        # leaves every byte where it was.
        backups = []
        for tag in offload:
            backup = self.backups.setdefault(tag, PinnedBackup(self._ctx))
            backup.prepare((a.ptr, a.size) for a in self._allocations(tag) if a.mapped)
            self._copier.calibrate(backup)  # once, before anything is released (Copier.calibrate)
            backups.append(backup)
        clock.mark("prepare")
        errors: list[str] = []
        copy_start = time.perf_counter()
        try:
            marks = self._copier.save_marked(backups, self.group_bytes)
        except PoolError:
            self._copier.wait()
            raise
        offloaded = sum(seg.size for _, segs in marks for seg in segs)
        clock.mark("enqueue")
        # Released while the copies run (they never touch these tags), without a device
        # synchronization: that would wait for every copy and serialize the two (level 1 of
        # 8 + 40 GiB: 212 ms so, 164 ms overlapped).
        discarded = self._unmap(discard, errors, synchronize=False)
        clock.mark("discard")
        # Each group's memory goes as soon as its copies are done, so what is left to release
        # after the last copy is one group, not the whole tag.
        waited = 0.0
        for event, segs in marks:
            t = time.perf_counter()
            event.synchronize()
            waited += time.perf_counter() - t
            try:
                self._lib.unmap_ptrs([seg.ptr for seg in segs], synchronize=False)
            except PoolError as err:
                errors.append(str(err))
        t = time.perf_counter()
        self._copier.wait()
        waited += time.perf_counter() - t
        copy_seconds = time.perf_counter() - copy_start
        # From the discard's end to the last copy done: "copies_wait" waiting for copy events,
        # "unmap_groups" releasing each group as its copies finish.
        clock.mark_split("copies_wait", waited, "unmap_groups")
        self._unmap(offload, errors)  # whatever is still mapped (a group whose release failed)
        clock.mark("unmap_rest")
        # What the release gives back to the driver, not all torch holds: live tensors outside the pool
        # stay, and counting them made every wake's warm segment grow by their size: the pool's 50-cycle
        # GPU test, run after others that left tensors alive, lost 4 MiB a cycle into torch's cache.
        held = self._torch_cache_size()
        self._release_torch_caches()
        released = max(0, held - self._torch_cache_size())
        self._torch_cache_bytes = max(self._torch_cache_bytes, released)
        clock.mark("torch_caches")
        self._shrink_local_memory()
        clock.mark("local_memory")
        self.last_timings = clock.report()
        if errors:
            raise PoolError("; ".join(errors))
        return SleepCost(offloaded, discarded, copy_seconds)

    def _unmap(self, tags: Sequence[str], errors: list[str], synchronize: bool = True) -> int:
        if not tags:
            return 0
        try:
            if synchronize:
                return self._lib.unmap_tags([self._ns + t for t in tags])
            ptrs = [a.ptr for t in tags for a in self._allocations(t) if a.mapped]
            return self._lib.unmap_ptrs(ptrs, synchronize=False)
        except PoolError as err:
            errors.append(str(err))
            return 0

    def _release_torch_caches(self) -> None:
        """Memory torch caches outside the pool: cuBLAS/cuBLASLt workspaces (tens of MiB per
        handle and stream) and free blocks of its default pools."""
        with torch.cuda.device(self.device):
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()

    def _torch_cache_size(self) -> int:
        """Bytes torch's caching allocator holds on our device outside the pool (its default pool:
        activations, cuBLAS workspaces, cached free blocks): everything it reserved minus the segments
        it got from the pool's allocator (every registry entry but the pieces of chunked tensors).
        0 when unknown; never more than torch held."""
        if self._expandable:
            return 0
        try:
            reserved = torch.cuda.memory_reserved(self.device)
        except RuntimeError:
            return 0
        ranges = [(p, p + n) for p, n in self._reserved_bytes.items()]
        ours = sum(a.size for a in self._lib.list("") if a.device == self.device.index
                   and not any(lo <= a.ptr < hi for lo, hi in ranges))
        return max(0, reserved - ours)

    def _warm_torch_cache(self) -> int:
        """Give torch's caching allocator back, as one cached segment, what the sleep's release of its
        cache returned to the driver, so the first request after a wake finds its activation and cuBLAS
        workspace memory cached instead of paying a cudaMalloc for each (+13 to +31 ms measured on
        the first forward after a wake). Called by the wake that leaves nothing asleep, while its
        copies run; an optimization only: a failure (e.g. the memory is taken) changes nothing.
        Returns the bytes given back."""
        nbytes, self._torch_cache_bytes = self._torch_cache_bytes, 0
        # Below 16 MiB it is not worth a call, and torch would round a request of 1-10 MiB up to a
        # 20 MiB segment (more than it held); above, every segment size is a multiple of 2 MiB, so
        # one request of the sum is served by exactly one segment of that size.
        if nbytes < (16 << 20):
            return 0
        try:
            with torch.cuda.device(self.device):
                # Allocated on the default stream (the engine's eager work) and freed at once: torch
                # keeps the segment cached and splits it for later allocations.
                torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except RuntimeError:  # torch.OutOfMemoryError included
            return 0
        return nbytes

    def _shrink_local_memory(self) -> None:
        """Give back the local memory the driver grew for kernels that needed a larger stack:
        it keeps stack_size bytes for every thread the device can hold (hundreds of MiB on an
        H200) and never shrinks it by itself. Wake restores the size, so graphs and kernels
        find what they had."""
        try:
            current = self._ctx.stack_size()
            if current > self._stack_base:
                self._ctx.set_stack_size(self._stack_base)
                self._stack_restore = max(self._stack_restore or 0, current)
        except PoolError:
            pass  # an optimization of the footprint only; the pool's memory is already free

    def _restore_local_memory(self) -> None:
        if self._stack_restore is not None:
            self._ctx.set_stack_size(self._stack_restore)
            self._stack_restore = None

    def wake(self, restore: Sequence[str], remap: Sequence[str], defer: Collection[int] = (),
             warm_caches: bool = False) -> WakeCost:
        clock = _Clock(self._lib)
        tags = [*restore, *remap]
        restored = mapped = warmed = 0
        copy_start: float | None = None
        missing = [t for t in restore if t not in self.backups]
        if missing:
            raise PoolError(f"tags {missing} are offloaded but have no host backup")
        try:
            # Discarded tags first (nothing to copy into them): re-creating memory the sleep
            # just released is what varies most (5 to 70 ms for 48 GiB on an H200), and an
            # out-of-memory failure then costs no copy.
            # Pieces in defer (chunks of a chunked tensor after its first) are mapped later by the
            # pool, in the background.
            mapped = self._lib.map_ptrs([a.ptr for t in remap for a in self._allocations(t)
                                         if not a.mapped and a.ptr not in defer])
            clock.mark("map_discarded")
            for tag in restore:
                backup = self.backups[tag]
                # Allocations freed while the tag slept are gone from the registry: skip them.
                live = {(a.ptr, a.size) for a in self._allocations(tag)}
                segments = [s for s in backup.layout if (s.ptr, s.size) in live]
                copy_start = copy_start or time.perf_counter()
                # Map a group, start its copies, map the next while they run: the copies start
                # after one group's mapping instead of the whole tag's.
                for group in groups(segments, self.group_bytes, lambda seg: seg.size):
                    mapped += self._lib.map_ptrs([s.ptr for s in group])
                    restored += self._copier.restore(backup, group)
                clock.mark("map_and_enqueue")
            # Whatever of the restored tags had no backup (unmapped before the sleep), while the
            # copies run.
            mapped += self._lib.map_tags([self._ns + t for t in restore])
            clock.mark("map_rest")
            if warm_caches:
                warmed = self._warm_torch_cache()
                clock.mark("warm_torch_cache")
            self._copier.wait()
            clock.mark("copies_wait")
            self._restore_local_memory()
            clock.mark("local_memory")
        except PoolError:
            try:
                self._copier.wait()
            except PoolError:
                pass  # the original error says more
            self._unmap(tags, [])  # all of them slept when the call began: undo what it mapped
            if warmed:  # and what it gave torch: the next wake gives it again
                self._release_torch_caches()
                self._torch_cache_bytes = warmed
            raise
        copy_seconds = time.perf_counter() - copy_start if copy_start is not None else 0.0
        self.last_timings = clock.report()
        return WakeCost(restored, mapped, copy_seconds)

    # ------------------------------------------------------------------ lifetime

    def check_backup_space(self, nbytes: int) -> None:
        """Backups are pinned host memory, allocated at the first sleep: nothing to check on disk."""

    def prepare_backup(self, tag: str) -> int:
        """Pin the tag's host backup now (in a background thread), sized for its memory today, so
        the first sleep only copies. The backup joins self.backups once whole."""
        nbytes = sum(a.size for a in self._allocations(tag) if a.mapped)
        backup = self.backups.get(tag) or PinnedBackup(self._ctx)
        backup.reserve(nbytes)
        self.backups[tag] = backup
        self._copier.calibrate(backup)  # how wakes will copy, chosen once (Copier.calibrate)
        return nbytes

    def backup_room(self) -> int:
        from .hostmem import host_room

        return host_room()

    def close(self) -> None:
        """After MemoryPool released the backups."""
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
        errors: list[str] = []
        self._unmap(sorted({a.tag[len(self._ns):] for a in self._lib.list(self._ns)}), errors)
        self._copier.close()
        for ptr in self._reservations:
            try:
                self._lib.free_reservation(ptr)
            except PoolError as err:
                errors.append(str(err))
        self._reservations = []
        self._reserved_bytes = {}
        # Dropping the MemPools lets torch hand back every segment no live tensor uses; those
        # still referenced stay reserved (unmapped) until their tensors die.
        self._mempools.clear()
        self._release_torch_caches()
        self._ctx.release()
        if errors:
            raise PoolError("close could not release everything: " + "; ".join(errors))
