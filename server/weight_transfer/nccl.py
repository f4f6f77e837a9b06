"""The few NCCL calls weight transfer needs, through ctypes (as vLLM's pynccl does).

torch's own NCCL process group cannot join a communicator whose unique id came from elsewhere,
and vLLM's trainers create theirs with ncclCommInitRank from a unique id they publish. So the
server calls libnccl directly: init from the id, a warm-up all-reduce (vLLM's trainer does one
right after init, and collectives must match), broadcasts, abort/destroy.
"""
from __future__ import annotations

import ctypes
import glob
import os
import time
from pathlib import Path

import torch

_FLOAT32 = 7
# ncclDataType_t of each torch dtype NCCL moves.
NCCL_DTYPES = {torch.uint8: 1, torch.int8: 0, torch.int32: 2, torch.int64: 4, torch.float16: 6,
                torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
_IN_PROGRESS = 7  # ncclInProgress
# How often wait_for looks at an event: the host notices the last bytes at most this late (a 0.5 ms
# sleep overslept to ~0.55 ms, on the path of every update's answer, on both sides). A look is an
# event query and an async-error query (a few microseconds, the GIL released in between).
POLL_S = 50e-6


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def _library_path() -> str:
    """SLEEPSERVE_NCCL_SO, else the libnccl that torch's CUDA wheels ship, else the system one."""
    override = os.environ.get("SLEEPSERVE_NCCL_SO") or os.environ.get("VLLM_NCCL_SO_PATH")
    if override:
        return override
    try:
        import nvidia.nccl  # type: ignore[import-not-found]
        for root in nvidia.nccl.__path__:
            found = glob.glob(str(Path(root) / "lib" / "libnccl.so*"))
            if found:
                return sorted(found)[0]
    except ImportError:
        pass
    return "libnccl.so.2"


class NcclLibrary:
    def __init__(self) -> None:
        lib = ctypes.CDLL(_library_path())
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [i]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), i, _UniqueId, i]
        lib.ncclBroadcast.argtypes = [vp, vp, sz, i, i, vp, vp]
        lib.ncclAllReduce.argtypes = [vp, vp, sz, i, i, vp, vp]
        lib.ncclAllGather.argtypes = [vp, vp, sz, i, vp, vp]
        lib.ncclCommDestroy.argtypes = [vp]
        lib.ncclCommAbort.argtypes = [vp]
        lib.ncclCommGetAsyncError.argtypes = [vp, ctypes.POINTER(i)]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(i)]
        # ncclCommSuspend / ncclCommResume / ncclCommMemStats: NCCL >= 2.29.7 ("dynamic memory offload"),
        # absent from older libraries (torch 2.11's own is 2.28.9). Looked up, never assumed.
        self.can_suspend = hasattr(lib, "ncclCommSuspend") and hasattr(lib, "ncclCommResume")
        if self.can_suspend:
            lib.ncclCommSuspend.argtypes = [vp, i]
            lib.ncclCommResume.argtypes = [vp]
        if hasattr(lib, "ncclCommMemStats"):
            lib.ncclCommMemStats.argtypes = [vp, i, ctypes.POINTER(ctypes.c_uint64)]
        self.lib = lib

    @property
    def version(self) -> str:
        code = ctypes.c_int(0)
        self.check(self.lib.ncclGetVersion(ctypes.byref(code)))
        v = code.value
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"

    def check(self, result: int) -> None:
        if result != 0:
            raise RuntimeError(f"NCCL error {result}: {self.lib.ncclGetErrorString(result).decode()}")

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)))
        return bytes(uid)

    def init_rank(self, unique_id: bytes, world_size: int, rank: int) -> ctypes.c_void_p:
        """ncclCommInitRank on the current device: this rank's communicator of the clique `unique_id` names."""
        uid = _UniqueId()
        ctypes.memmove(ctypes.byref(uid), unique_id, 128)
        comm = ctypes.c_void_p()
        self.check(self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank))
        return comm


class NcclBroadcaster:
    """One communicator on one device for weight pushes. Broadcasts are enqueued on `stream`; wait_for() polls for
    completion so that a trainer that died mid-send ends in an abort, not a hang."""

    def __init__(self, unique_id: bytes, rank: int, world_size: int, device: torch.device, timeout_s: float):
        self.nccl = NcclLibrary()
        self.lib = self.nccl.lib  # the CDLL: its entry points
        self.rank, self.world_size, self.device, self.timeout_s = rank, world_size, device, timeout_s
        with torch.cuda.device(device):
            self.comm = self.nccl.init_rank(unique_id, world_size, rank)
            self.stream = torch.cuda.Stream(device)
            warmup = torch.zeros(1, device=device)
            self.nccl.check(self.lib.ncclAllReduce(warmup.data_ptr(), warmup.data_ptr(), 1, _FLOAT32, 0,
                                                  self.comm, self.stream.cuda_stream))
            self.wait_for(self._record())

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.cuda.Event:
        # The buffer may come from another stream's allocation: order NCCL's stream after it.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.nccl.check(self.lib.ncclBroadcast(tensor.data_ptr() if self.rank == src else None, tensor.data_ptr(),
                                              tensor.numel(), NCCL_DTYPES[tensor.dtype], src, self.comm,
                                              self.stream.cuda_stream))
        return self._record()

    def wait_for(self, event: torch.cuda.Event) -> None:
        deadline = time.monotonic() + self.timeout_s
        err = ctypes.c_int(0)
        while not event.query():
            self.nccl.check(self.lib.ncclCommGetAsyncError(self.comm, ctypes.byref(err)))
            if err.value not in (0, _IN_PROGRESS):
                self.nccl.check(err.value)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the NCCL transfer did not complete within {self.timeout_s:.0f} s "
                                   "(did the trainer stop sending?)")
            time.sleep(POLL_S)

    def close(self, abort: bool = False) -> None:
        # Always ncclCommAbort: with NCCL 2.28.9 ncclCommDestroy finalizes collectively, so the side that
        # closes first blocks until its peer closes too (measured on the H200 host: a trainer's close()
        # hung while the server kept its communicator for the next update). Abort frees ours alone;
        # every broadcast has completed by then (wait_for), unless `abort` says the transfer broke.
        if self.comm:
            if not abort:
                self.stream.synchronize()
            self.lib.ncclCommAbort(self.comm)
            self.comm = ctypes.c_void_p()
