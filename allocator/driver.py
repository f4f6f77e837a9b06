"""Thin, checked helpers over cuda-python's driver bindings (cuda.bindings.driver).

Everything here runs in the device's primary context, the one torch uses, so pointers and
streams are shared with torch. Imported only by the CUDA backend.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from cuda.bindings import driver as cu

from .types import PoolError

SUCCESS = cu.CUresult.CUDA_SUCCESS


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-python (CUresult, *values) tuple; raise PoolError on error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, desc = cu.cuGetErrorString(err)
        name_s = name.decode() if isinstance(name, bytes) else str(err)
        desc_s = desc.decode() if isinstance(desc, bytes) else ""
        raise PoolError(f"{what} failed: {name_s} ({desc_s})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class DeviceContext:
    """The primary context of one device, retained for this object's lifetime."""

    def __init__(self, ordinal: int) -> None:
        check(cu.cuInit(0), "cuInit")
        self.ordinal = ordinal
        self._device = check(cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        self._ctx = check(cu.cuDevicePrimaryCtxRetain(self._device), f"cuDevicePrimaryCtxRetain({ordinal})")
        self._retained = True

    @contextmanager
    def current(self) -> Iterator[None]:
        check(cu.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            cu.cuCtxPopCurrent()

    def mem_info(self) -> tuple[int, int]:
        with self.current():
            free, total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def stack_size(self) -> int:
        """The per-thread stack size (CU_LIMIT_STACK_SIZE). The driver raises it, and with it
        the local memory it keeps for every resident thread of the device, whenever a kernel
        needs more, and never lowers it by itself."""
        with self.current():
            return int(check(cu.cuCtxGetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE), "cuCtxGetLimit(STACK_SIZE)"))

    def set_stack_size(self, nbytes: int) -> None:
        """Setting it re-sizes that local memory at once (after the device finishes its work)."""
        with self.current():
            check(cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE, int(nbytes)),
                  f"cuCtxSetLimit(STACK_SIZE, {int(nbytes)})")

    def release(self) -> None:
        if self._retained:
            self._retained = False
            cu.cuDevicePrimaryCtxRelease(self._device)


class Stream:
    """A non-blocking stream of our own, so backup copies never queue behind torch's work."""

    def __init__(self, ctx: DeviceContext) -> None:
        self._ctx = ctx
        with ctx.current():
            self.handle = check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")

    def synchronize(self) -> None:
        with self._ctx.current():
            check(cu.cuStreamSynchronize(self.handle), "cuStreamSynchronize(copy stream)")

    def destroy(self) -> None:
        if self.handle is not None:
            with self._ctx.current():
                cu.cuStreamDestroy(self.handle)
            self.handle = None


class Event:
    """A timing-free event: marks a point of a stream that the host can wait for."""

    def __init__(self, ctx: DeviceContext) -> None:
        self._ctx = ctx
        with ctx.current():
            self.handle = check(cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate")

    def record(self, stream: Stream) -> None:
        check(cu.cuEventRecord(self.handle, stream.handle), "cuEventRecord")

    def synchronize(self) -> None:
        check(cu.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def destroy(self) -> None:
        if self.handle is not None:
            with self._ctx.current():
                cu.cuEventDestroy(self.handle)
            self.handle = None


class DeviceRange:
    """Bytes at a device address, as torch.as_tensor reads them (no copy; kept alive by the tensor)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}


def device_alloc(ctx: DeviceContext, nbytes: int) -> int:
    """Plain device memory outside the pool (cuMemAlloc): scratch for Copier.calibrate."""
    with ctx.current():
        return int(check(cu.cuMemAlloc(nbytes), f"cuMemAlloc({nbytes / 2**20:.0f} MiB)"))


def device_free(ctx: DeviceContext, ptr: int) -> None:
    with ctx.current():
        check(cu.cuMemFree(cu.CUdeviceptr(ptr)), "cuMemFree")


def host_alloc(ctx: DeviceContext, nbytes: int) -> int:
    """Pinned host memory usable from every context (PORTABLE) and mapped into the device's address
    space (DEVICEMAP), so kernels can read it (Copier's kernel copies)."""
    with ctx.current():
        try:
            ptr = check(cu.cuMemHostAlloc(nbytes, cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP),
                        f"cuMemHostAlloc({nbytes / 2**30:.2f} GiB pinned, mapped)")
        except PoolError:  # not mapped then: the wake copies it by the copy engines
            ptr = check(cu.cuMemHostAlloc(nbytes, cu.CU_MEMHOSTALLOC_PORTABLE),
                        f"cuMemHostAlloc({nbytes / 2**30:.2f} GiB pinned)")
    return int(ptr)


def host_free(ctx: DeviceContext, ptr: int) -> None:
    with ctx.current():
        check(cu.cuMemFreeHost(ptr), "cuMemFreeHost")


def host_register(ctx: DeviceContext, ptr: int, nbytes: int) -> None:
    """Page-lock existing host memory for every context (PORTABLE), mapped into the device's address
    space (DEVICEMAP) so kernels can read it."""
    with ctx.current():
        try:
            check(cu.cuMemHostRegister(ptr, nbytes, cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP),
                  f"cuMemHostRegister({nbytes / 2**30:.2f} GiB, mapped)")
        except PoolError:  # not mapped then: the wake copies it by the copy engines
            check(cu.cuMemHostRegister(ptr, nbytes, cu.CU_MEMHOSTREGISTER_PORTABLE),
                  f"cuMemHostRegister({nbytes / 2**30:.2f} GiB)")


def host_device_pointer(ctx: DeviceContext, ptr: int) -> int:
    """The device address of pinned, mapped host memory (the same address where addressing is unified)."""
    with ctx.current():
        return int(check(cu.cuMemHostGetDevicePointer(ptr, 0), "cuMemHostGetDevicePointer"))


def host_unregister(ctx: DeviceContext, ptr: int) -> None:
    with ctx.current():
        check(cu.cuMemHostUnregister(ptr), "cuMemHostUnregister")


def copy_to_host_async(host: int, device: int, nbytes: int, stream: Stream) -> None:
    check(cu.cuMemcpyDtoHAsync(host, cu.CUdeviceptr(device), nbytes, stream.handle),
          f"cuMemcpyDtoHAsync({nbytes} bytes from 0x{device:x})")


def copy_to_device_async(device: int, host: int, nbytes: int, stream: Stream) -> None:
    check(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(device), host, nbytes, stream.handle),
          f"cuMemcpyHtoDAsync({nbytes} bytes to 0x{device:x})")
