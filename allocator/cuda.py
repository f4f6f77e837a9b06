"""CUDA backend: torch allocations routed to csrc/sleep_alloc.c, one torch MemPool per tag.

Each tag has its own MemPool over the same pluggable allocator, so torch never puts blocks of
two tags in one segment and a tag's sleep never unmaps another tag's memory. The C library
records each segment under the tag the allocating thread set (pool.use) or, for allocations a
CUDA graph capture routes to a pool, under the tag pool.graph_pool() named.

Sleep: synchronize, copy offloaded tags to pinned backups on our own stream while discarded tags
are unmapped, unmap the offloaded tags, then return torch's own caches (cuBLAS workspaces,
cached blocks) to the driver so device memory really drops to a bare process's footprint.
Wake: re-map offloaded tags and start their copies back, re-map discarded tags meanwhile, wait.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from itertools import count
from typing import Any, Iterator, Sequence

import torch

from . import cumem
from .backup import Copier, PinnedBackup
from .driver import DeviceContext
from .types import PoolError, SleepCost, TagUsage, WakeCost

_serial = count()


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


class CudaBackend:
    name = "cuda-vmm"

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
        self._backups: dict[str, PinnedBackup] = {}
        self._expandable = expandable_segments_requested()
        self._local = threading.local()
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
        if self._expandable:
            self.verify([*offload, *discard])
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
        # Pinned buffers first (seconds on the first cycle, free afterwards): a failure here
        # leaves every byte where it was.
        for tag in offload:
            backup = self._backups.setdefault(tag, PinnedBackup(self._ctx))
            backup.prepare((a.ptr, a.size) for a in self._allocations(tag) if a.mapped)
        copy_start = time.perf_counter()
        offloaded = 0
        try:
            for tag in offload:
                offloaded += self._copier.save(self._backups[tag])
        except PoolError:
            self._copier.wait()
            raise
        # Discarded tags are released while the copies run; cuMemUnmap may wait for the device,
        # in which case this is merely sequential.
        errors: list[str] = []
        discarded = self._unmap(discard, errors)
        self._copier.wait()
        copy_seconds = time.perf_counter() - copy_start
        self._unmap(offload, errors)
        self._release_torch_caches()
        if errors:
            raise PoolError("; ".join(errors))
        return SleepCost(offloaded, discarded, copy_seconds)

    def _unmap(self, tags: Sequence[str], errors: list[str]) -> int:
        released = 0
        for tag in tags:
            try:
                released += self._lib.unmap_tag(self._ns + tag)
            except PoolError as err:
                errors.append(str(err))
        return released

    def _release_torch_caches(self) -> None:
        """Memory torch caches outside the pool: cuBLAS/cuBLASLt workspaces (tens of MiB per
        handle and stream) and free blocks of its default pools."""
        with torch.cuda.device(self.device):
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()

    def wake(self, restore: Sequence[str], remap: Sequence[str]) -> WakeCost:
        woken: list[str] = []
        restored = mapped = 0
        copy_start: float | None = None
        try:
            for tag in restore:
                mapped += self._lib.map_tag(self._ns + tag)
                woken.append(tag)
                backup = self._backups.get(tag)
                if backup is None:
                    raise PoolError(f"tag '{tag}' is offloaded but has no host backup")
                live = {(a.ptr, a.size) for a in self._allocations(tag)}
                copy_start = copy_start or time.perf_counter()
                # Allocations freed while the tag slept are gone from the registry: skip them.
                restored += self._copier.restore(backup, [s for s in backup.layout if (s.ptr, s.size) in live])
            for tag in remap:
                mapped += self._lib.map_tag(self._ns + tag)
                woken.append(tag)
            self._copier.wait()
        except PoolError:
            try:
                self._copier.wait()
            except PoolError:
                pass  # the original error says more
            self._unmap(woken, [])
            raise
        copy_seconds = time.perf_counter() - copy_start if copy_start is not None else 0.0
        return WakeCost(restored, mapped, copy_seconds)

    # ------------------------------------------------------------------ backups and lifetime

    def release_backups(self, tags: Sequence[str]) -> None:
        for tag in tags:
            backup = self._backups.pop(tag, None)
            if backup is not None:
                backup.release()

    def backup_tags(self) -> list[str]:
        return list(self._backups)

    def backup_bytes(self) -> int:
        return sum(b.capacity for b in self._backups.values())

    def close(self) -> None:
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
        errors: list[str] = []
        self._unmap(sorted({a.tag[len(self._ns):] for a in self._lib.list(self._ns)}), errors)
        self.release_backups(list(self._backups))
        self._copier.close()
        # Dropping the MemPools lets torch hand back every segment no live tensor uses; those
        # still referenced stay reserved (unmapped) until their tensors die.
        self._mempools.clear()
        self._release_torch_caches()
        self._ctx.release()
        if errors:
            raise PoolError("close could not release everything: " + "; ".join(errors))
