"""The device communicator the model's collectives run on, one per rank, for the server's life
(group.py owns it).

CUDA: a raw NCCL communicator called through ctypes (server/weight_transfer/nccl.py), enqueued on the
current stream. Not torch's ProcessGroupNCCL: its per-collective host bookkeeping advances once when a
CUDA graph captures a collective and never on replay, and destroy_process_group can hang once graphs
captured its collectives; a raw communicator has no host state per call, is captured like any kernel,
and ncclCommAbort frees it alone. CPU: a gloo group of torch.distributed (CI runs TP=2 on it).
"""
from __future__ import annotations

import ctypes
from typing import Protocol

import torch
import torch.distributed as dist

from server.weight_transfer.nccl import NCCL_DTYPES


class DeviceComm(Protocol):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]: ...

    def broadcast(self, x: torch.Tensor) -> torch.Tensor: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...

    # Whether suspend() / resume() give the communicator's device memory back while it stays (NCCL >= 2.29.7).
    suspendable: bool


class GlooComm:
    """A gloo group beside the control group: the model's collectives never share a group with the
    control group's agreements, as on CUDA, where they run on NCCL."""

    name = "gloo"
    suspendable = False

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self.world = dist.get_world_size()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (in place; x contiguous)."""
        dist.broadcast(x, src=0, group=self.group)
        return x

    def close(self) -> None:
        dist.destroy_process_group(self.group)

    def abort(self) -> None:
        """Nothing to do: a gloo collective fails by itself once a peer's sockets close."""


_SUM = 0
NCCL_SUSPEND_MEM = 0x01  # nccl.h: release the communicator's dynamic device allocations
MEM_SUSPENDABLE, MEM_SUSPENDED, MEM_PERSISTENT, MEM_TOTAL = 0, 1, 2, 3  # nccl.h ncclCommMemStat_t


class NcclGroupComm:
    """The ranks' NCCL communicator, from a unique id that rank 0 publishes in the group's store."""

    name = "nccl"

    def __init__(self, store: dist.Store, key: str, rank: int, world: int, device: torch.device):
        from server.weight_transfer.nccl import NcclLibrary

        self.nccl = NcclLibrary()
        self.lib = self.nccl.lib
        self.suspendable = self.nccl.can_suspend
        self.suspended = False
        self.rank, self.world, self.device = rank, world, device
        if rank == 0:
            store.set(key, self.nccl.unique_id())
        with torch.cuda.device(device):
            self.comm = self.nccl.init_rank(store.get(key), world, rank)
            probe = torch.ones(1, device=device)
            self.all_reduce(probe)
            torch.cuda.synchronize(device)

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _usable(self) -> None:
        """A collective on a suspended communicator would reach memory NCCL gave back: refused here (a graph's
        replay does not pass through Python; the pool never replays while the communicator is suspended)."""
        if self.suspended:
            raise RuntimeError("a collective on a suspended NCCL communicator (it is resumed by the wake)")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._usable()
        self.nccl.check(self.lib.ncclAllReduce(x.data_ptr(), x.data_ptr(), x.numel(), NCCL_DTYPES[x.dtype], _SUM,
                                              self.comm, self._stream()))
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        self._usable()
        x = x.contiguous()
        out = torch.empty((self.world, *x.shape), dtype=x.dtype, device=x.device)
        self.nccl.check(self.lib.ncclAllGather(x.data_ptr(), out.data_ptr(), x.numel(), NCCL_DTYPES[x.dtype],
                                              self.comm, self._stream()))
        return list(out.unbind(0))

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (in place, x contiguous), on the current stream."""
        self._usable()
        self.nccl.check(self.lib.ncclBroadcast(x.data_ptr(), x.data_ptr(), x.numel(), NCCL_DTYPES[x.dtype], 0,
                                              self.comm, self._stream()))
        return x

    def suspend(self) -> None:
        """Give the communicator's device memory back while keeping the communicator (NCCL unmaps its
        physical memory and keeps the virtual addresses, so CUDA graphs that captured its collectives replay
        after resume()). Every collective has completed first; none may run until resume()."""
        torch.cuda.synchronize(self.device)
        self.nccl.check(self.lib.ncclCommSuspend(self.comm, NCCL_SUSPEND_MEM))
        self.suspended = True

    def resume(self) -> None:
        self.nccl.check(self.lib.ncclCommResume(self.comm))
        self.suspended = False

    def memory(self) -> dict[str, int]:
        """NCCL's own account of its device memory (bytes; suspended: 0 or 1), where the library keeps one."""
        if not hasattr(self.lib, "ncclCommMemStats"):
            return {}
        out = {}
        for name, stat in (("suspendable", MEM_SUSPENDABLE), ("suspended", MEM_SUSPENDED),
                           ("persistent", MEM_PERSISTENT), ("total", MEM_TOTAL)):
            value = ctypes.c_uint64(0)
            self.nccl.check(self.lib.ncclCommMemStats(self.comm, stat, ctypes.byref(value)))
            out[name] = value.value
        return out

    def close(self) -> None:
        # ncclCommAbort frees this rank's communicator without a collective finalize (ncclCommDestroy in
        # NCCL 2.28.9 waits for every peer); every collective has completed (synchronize) by then.
        if self.comm:
            torch.cuda.synchronize(self.device)
            self.lib.ncclCommAbort(self.comm)
            self.comm = ctypes.c_void_p()

    def abort(self) -> None:
        """From any thread, when a peer died: a collective waiting for it never completes, so a thread
        blocked on it (a synchronize) waits forever; ncclCommAbort ends the communicator's kernels and
        the next call on this communicator fails (a null communicator), so the failure surfaces."""
        comm, self.comm = self.comm, ctypes.c_void_p()
        if comm:
            self.lib.ncclCommAbort(comm)
