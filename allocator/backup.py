"""Host backups of offloaded tags: storage reused across sleep cycles, and the copies in and out.

CUDA: one pinned host buffer per tag (allocator/hostmem.py), allocated ahead of the first sleep in
the background (MemoryPool.prepare_backups) or by that sleep, and reused afterwards (pinning 8 GiB
with cuMemHostAlloc cost about 2.8 s on an H200 host against 0.16 s to copy it), filled and drained
by chunked asynchronous copies on a stream of our own, which run near the pinned-copy bandwidth.
CPU: one unlinked file per tag (open_unlinked), so the process's resident memory really drops and
nothing is left on disk when the process ends, however it ends.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence, TypeVar

from .types import PoolError

if TYPE_CHECKING:  # the CUDA side imports cuda-python, which CPU-only users need not load
    from .driver import DeviceContext, Event, Stream
    from .hostmem import PinnedBuffer

# Big enough that per-call overhead vanishes (128 calls for 8 GiB), small enough that a 40 GiB
# allocation is not one monolithic copy.
DEFAULT_CHUNK_BYTES = 64 << 20

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Segment:
    ptr: int  # device address of the allocation
    size: int
    offset: int  # where its bytes sit in the backup


def groups(items: Sequence[T], group_bytes: int, size: Callable[[T], int]) -> Iterator[list[T]]:
    """Consecutive runs of whole items of about group_bytes each (one run when 0)."""
    group: list[T] = []
    pending = 0
    for item in items:
        group.append(item)
        pending += size(item)
        if group_bytes and pending >= group_bytes:
            yield group
            group, pending = [], 0
    if group:
        yield group


def plan(allocations: Iterable[tuple[int, int]]) -> list[Segment]:
    """Lay (ptr, size) allocations end to end, in address order."""
    segments, offset = [], 0
    for ptr, size in sorted(allocations):
        segments.append(Segment(ptr, size, offset))
        offset += size
    return segments


class PinnedBackup:
    """One tag's pinned host buffer and the layout of what the last sleep put in it."""

    def __init__(self, ctx: "DeviceContext") -> None:
        self._ctx = ctx
        self.buffer: "PinnedBuffer | None" = None
        self.layout: list[Segment] = []

    @property
    def capacity(self) -> int:
        return self.buffer.nbytes if self.buffer is not None else 0

    @property
    def nbytes(self) -> int:
        return self.capacity

    def reserve(self, needed: int) -> None:
        """Make the buffer hold at least `needed` bytes (seconds for gigabytes the first time; a no-op
        once it is large enough, which is the point: pinning is far slower than copying)."""
        from .hostmem import PinnedBuffer

        if needed <= self.capacity:
            return
        self.release()
        try:
            self.buffer = PinnedBuffer(self._ctx, needed)
        except PoolError as err:
            raise PoolError(
                f"{err}: not enough host memory to back up {needed / 2**30:.2f} GiB; "
                "discard this tag instead of offloading it, or free host memory"
            ) from err

    def prepare(self, allocations: Iterable[tuple[int, int]]) -> list[Segment]:
        """Lay out the allocations, growing the buffer when they no longer fit."""
        layout = plan(allocations)
        self.reserve(layout[-1].offset + layout[-1].size if layout else 0)
        self.layout = layout
        return layout

    def release(self) -> None:
        if self.buffer is not None:
            self.buffer.release()
        self.buffer, self.layout = None, []


# How a wake copies backups back to the device: "kernel" reads the pinned host memory with the GPU's own loads (a
# copy kernel over the mapped backup), "engine" uses the copy engines (cuMemcpyHtoDAsync), "auto" (the default)
# times both once (Copier.calibrate) and keeps the kernel where it reads at least KERNEL_SHARE of the engines'
# rate. Measured on an H200 (the evening of 2026-11-30; docs/measurements.md): right after ~110 GiB were released
# (a sleep that discarded the KV cache, or a trainer's empty_cache), the copy engines move only 27.6 GB/s for the
# ~100 ms the driver spends on the freed memory, while a kernel reads 51.2 GB/s; with nothing released before,
# 55.4 against 51.3 GB/s (0.93): the kernel there. On one H100 host the kernel read a 4 GiB backup at 34.4 GB/s
# against the engines' 55.0 (0.62; its level-1 wakes 0.60-0.61 of raw pinned in three runs, 2026-12-06,
# bench/host_copies.py): the engines there.
WAKE_COPY_ENV = "SLEEPSERVE_WAKE_COPY"
KERNEL_SHARE = 0.9
# Bytes the calibration copies each way (chunks of Copier.chunk_bytes, as a wake copies them), best of 3 rounds.
CALIBRATION_BYTES = 256 << 20


def wake_copy_mode() -> str:
    mode = os.environ.get(WAKE_COPY_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "kernel", "engine"):
        raise PoolError(f"{WAKE_COPY_ENV}={mode!r}: use 'auto', 'kernel' or 'engine'")
    return mode


def kernel_reads_fast_enough(kernel_gbps: float, engines_gbps: float) -> bool:
    """Whether a wake should copy by the kernel, from the two rates calibrate() measured: the kernel is immune to
    the engines' slowdown after a big release, so it is kept unless it reads clearly slower (KERNEL_SHARE)."""
    return kernel_gbps >= KERNEL_SHARE * engines_gbps


class Copier:
    """Chunked asynchronous copies between device allocations and pinned backups, on one stream
    of our own: device to host by the copy engines, host to device by a kernel or the copy engines
    (wake_copy_mode(); under "auto" whichever calibrate() chose)."""

    def __init__(self, ctx: "DeviceContext", chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self._ctx = ctx
        self.chunk_bytes = chunk_bytes
        self._stream: "Stream | None" = None
        self._events: list["Event"] = []  # reused by save_marked() across cycles
        mode = wake_copy_mode()
        # True: the copy kernel; False: the copy engines; None: not chosen yet (auto), the kernel until calibrate()
        self.kernel_restore: bool | None = None if mode == "auto" else mode == "kernel"
        self.calibration: dict | None = None  # what calibrate() measured and chose
        self._torch_stream = None  # torch's handle on self._stream, for the copy kernel
        self.kernel_copies = 0  # restores done by the copy kernel (tests, diagnostics)

    def _get_stream(self) -> "Stream":
        if self._stream is None:
            from .driver import Stream

            self._stream = Stream(self._ctx)
        return self._stream

    def _event(self, i: int) -> "Event":
        from .driver import Event

        while len(self._events) <= i:
            self._events.append(Event(self._ctx))
        return self._events[i]

    def _chunks(self, backup: PinnedBackup, seg: Segment) -> Iterable[tuple[int, int, int]]:
        """(device address, host address, bytes) of each copy of a segment."""
        assert backup.buffer is not None, "a backup is copied only after prepare()"
        for host, start, n in backup.buffer.spans(seg.offset, seg.size, self.chunk_bytes):
            yield seg.ptr + start, host, n

    def save_marked(self, backups: Sequence[PinnedBackup],
                    group_bytes: int) -> list[tuple["Event", list[Segment]]]:
        """Enqueue device-to-host copies of every backup's layout, and after each group of
        whole allocations of about group_bytes (0: a single group) record an event. Returns
        [(event, segments whose copies are complete once it fires)] in stream order, so a caller
        can release each group's device memory while later groups still copy."""
        from . import driver

        stream = self._get_stream()
        marks: list[tuple["Event", list[Segment]]] = []
        pairs = [(backup, seg) for backup in backups for seg in backup.layout]
        with self._ctx.current():
            for i, group in enumerate(groups(pairs, group_bytes, lambda pair: pair[1].size)):
                for backup, seg in group:
                    for dev, host, n in self._chunks(backup, seg):
                        driver.copy_to_host_async(host, dev, n, stream)
                event = self._event(i)
                event.record(stream)
                marks.append((event, [seg for _, seg in group]))
        return marks

    def restore(self, backup: PinnedBackup, segments: Sequence[Segment]) -> int:
        """Enqueue host-to-device copies of the given segments of backup.layout."""
        from . import driver

        stream, total = self._get_stream(), 0
        with self._ctx.current():
            for seg in segments:
                for dev, host, n in self._chunks(backup, seg):
                    if not (self.kernel_restore is not False and self._kernel_copy(dev, host, n)):
                        driver.copy_to_device_async(dev, host, n, stream)
                    total += n
        return total

    def _kernel_copy(self, dev: int, host: int, nbytes: int) -> bool:
        """Enqueue a copy kernel that reads the mapped pinned host range into the device range, on our
        stream; False when this range cannot take one (the caller copies by the copy engines)."""
        import torch

        from . import driver

        try:
            src = driver.host_device_pointer(self._ctx, host)
        except PoolError:
            return False  # not mapped (a backup pinned without DEVICEMAP)
        # 8-byte words when everything is aligned (every allocation is; the ends of a chunk are).
        dtype = torch.int64 if (dev | src | nbytes) % 8 == 0 else torch.uint8
        device = torch.device("cuda", self._ctx.ordinal)
        try:
            out = torch.as_tensor(driver.DeviceRange(dev, nbytes), device=device).view(dtype)
            inp = torch.as_tensor(driver.DeviceRange(src, nbytes), device=device).view(dtype)
        except (RuntimeError, TypeError, ValueError):
            return False  # torch would not wrap the mapped host range: the copy engines do it
        if out.data_ptr() != dev or inp.data_ptr() != src:
            return False  # torch copied a range instead of wrapping it: the copy engines do it
        try:
            if self._torch_stream is None:
                self._torch_stream = torch.cuda.ExternalStream(int(self._get_stream().handle), device=device)
            with torch.cuda.device(device), torch.cuda.stream(self._torch_stream):
                # x | 0 is x, bit for bit; an elementwise kernel, where copy_ would be a copy-engine memcpy.
                torch.bitwise_or(inp, 0, out=out)
        except RuntimeError as err:  # a launch failure: the wake rolls back on PoolError
            raise PoolError(f"the wake's copy kernel failed: {err}") from err
        self.kernel_copies += 1
        return True

    def calibrate(self, backup: PinnedBackup, nbytes: int = CALIBRATION_BYTES) -> None:
        """Choose how wakes copy host to device, once, while nothing has been released yet: copy nbytes of the
        backup into scratch device memory by the copy kernel and by the copy engines, best of 3 each, and keep the
        kernel only where it reads at least KERNEL_SHARE of the engines' rate. Called where a backup is first
        reserved: in the background after start-up (prepare_backup), or by a first sleep that found none (which
        spends seconds pinning it anyway). Does nothing once chosen (or forced by SLEEPSERVE_WAKE_COPY), and
        leaves the choice open (the kernel meanwhile) on a backup smaller than nbytes, whose copies would
        measure the calls more than the bytes. Never raises: where it cannot measure (no room for the scratch
        memory, a failed copy) the kernel stays; a backup the kernel cannot read (not mapped) takes the engines,
        as its wakes would anyway."""
        from . import driver

        if self.kernel_restore is not None or backup.buffer is None or backup.buffer.nbytes < nbytes:
            return
        self.kernel_restore = True  # unless measured otherwise below
        n = min(nbytes, backup.buffer.piece_bytes)  # within one registration
        kernel_copies = self.kernel_copies
        try:
            stream = self._get_stream()
            scratch = driver.device_alloc(self._ctx, n)
        except PoolError as err:
            log.warning("wake copies by the kernel: no room to time the two ways: %s", err)
            return
        spans = [(scratch + at, backup.buffer.ptr + at, min(self.chunk_bytes, n - at))
                 for at in range(0, n, self.chunk_bytes)]

        def seconds(by_kernel: bool) -> float:
            best = float("inf")
            for _ in range(3):
                stream.synchronize()
                t0 = time.perf_counter()
                for dev, host, size in spans:
                    if not by_kernel:
                        driver.copy_to_device_async(dev, host, size, stream)
                    elif not self._kernel_copy(dev, host, size):
                        return float("inf")  # not mapped
                stream.synchronize()
                best = min(best, time.perf_counter() - t0)
            return best

        try:
            try:
                with self._ctx.current():
                    engines_gbps, kernel_gbps = n / seconds(False) / 1e9, n / seconds(True) / 1e9
            finally:
                self.kernel_copies = kernel_copies  # the count says what wakes did
                try:
                    stream.synchronize()
                finally:
                    driver.device_free(self._ctx, scratch)
        except PoolError as err:
            log.warning("wake copies by the kernel: timing the two ways failed: %s", err)
            return
        self.kernel_restore = kernel_reads_fast_enough(kernel_gbps, engines_gbps)
        self.calibration = {"kernel_gbps": kernel_gbps, "engines_gbps": engines_gbps,
                            "wake_copies_by": "kernel" if self.kernel_restore else "engines"}
        log.info("wake copies by the %s: host to device %.1f GB/s by a kernel, %.1f by the copy engines",
                 self.calibration["wake_copies_by"], kernel_gbps, engines_gbps)

    def wait(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def close(self) -> None:
        self._torch_stream = None
        for event in self._events:
            event.destroy()
        self._events = []
        if self._stream is not None:
            self._stream.destroy()
            self._stream = None


def open_unlinked(folder: Path) -> int:
    """A new read-write file with no name anywhere: nothing else can open it, and it vanishes with
    the process, kill -9 included (a named file used to outlive it: 542 MB left per crash).

    It is made in a fresh private folder (mkdtemp: mode 0700, a random name) inside `folder`, as an
    O_TMPFILE (never linked; O_EXCL forbids linking it later), or where the file system lacks
    O_TMPFILE, created O_EXCL|O_NOFOLLOW with mode 0600 and unlinked at once; the private folder is
    removed right away. A planted symlink is never followed and a temp cleaner finds nothing to delete."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    private = tempfile.mkdtemp(prefix=".sleepserve-", dir=folder)
    try:
        try:
            return os.open(private, os.O_TMPFILE | os.O_RDWR | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except (OSError, AttributeError):  # no O_TMPFILE on this file system (or platform)
            name = os.path.join(private, "backup")
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.unlink(name)
            return fd
    finally:
        os.rmdir(private)


class FileBackup:
    """One tag's backup: an unlinked file (open_unlinked), rewritten in place on every sleep and
    closed by release(), which frees its disk space."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._fd: int | None = None
        self.nbytes = 0

    @property
    def fd(self) -> int | None:
        return self._fd

    def reserve(self, nbytes: int) -> None:
        """Allocate the file's disk blocks ahead of the first sleep (posix_fallocate), so that sleep
        rewrites blocks that exist instead of growing a file. File systems without fallocate skip it."""
        try:
            if self._fd is None:
                self._fd = open_unlinked(self.folder)
            os.posix_fallocate(self._fd, 0, max(nbytes, 1))
        except OSError as err:
            if err.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return
            raise PoolError(f"reserving {nbytes / 2**20:.1f} MiB for a backup in {self.folder} failed: {err}; "
                            "free disk space or choose another offload folder (--offload-dir)") from err
        self.nbytes = max(self.nbytes, nbytes)

    def write(self, buffers: Sequence[memoryview]) -> list[int]:
        """Write the buffers end to end; returns the offset of each."""
        offsets, total = [], 0
        for buf in buffers:
            offsets.append(total)
            total += buf.nbytes
        try:
            if self._fd is None:
                self._fd = open_unlinked(self.folder)
            os.ftruncate(self._fd, total)
            for buf, offset in zip(buffers, offsets):
                done = 0
                while done < buf.nbytes:
                    done += os.pwrite(self._fd, buf[done:], offset + done)
        except OSError as err:
            raise PoolError(
                f"writing a backup of {total / 2**20:.1f} MiB in {self.folder} failed: {err}; "
                "free disk space or choose another offload folder (--offload-dir)"
            ) from err
        self.nbytes = total
        return offsets

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill buf from the file at offset, entirely or not at all (PoolError)."""
        if self._fd is None:
            raise PoolError("this tag has no backup to restore from")
        try:
            done = 0
            while done < buf.nbytes:
                n = os.preadv(self._fd, [buf[done:]], offset + done)
                if n == 0:
                    raise PoolError(
                        f"the backup ends {buf.nbytes - done} bytes early (truncated while the tag "
                        "slept?); the tag's content cannot be restored from it"
                    )
                done += n
        except OSError as err:
            raise PoolError(f"reading the backup failed: {err}") from err

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.nbytes = 0
