"""The ranks' groups, both for the server's life: a control group and the device communicator the
model's collectives run on.

A TCP store hosted by rank 0 outlives everything. The control group (torch.distributed's default
group, gloo, CPU tensors) carries the rare agreements (how many KV blocks every rank holds): it holds
no device memory. The device communicator (comm.py: raw NCCL on CUDA, a second gloo group on CPU) holds
memory outside the pool (NCCL: ~880 MiB per H200 rank) and stays up while the ranks sleep, because the
decode graphs captured its collectives (parallel/pool.py says what releasing it cost). CPU runs the
same path as CUDA.
"""
from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from server.engine.parallel.comm import DeviceComm, GlooComm, NcclComm
from server.model.shard import TensorParallel

log = logging.getLogger("sleepserve.engine")

# A collective waits this long for a slow rank (loading 8B on one rank while the others wait in the
# KV-block agreement takes tens of seconds); a dead rank is noticed at once by the worker monitor.
TIMEOUT = timedelta(seconds=600)


class Group:
    def __init__(self, port: int, rank: int, world: int, device: torch.device, tp: TensorParallel,
                 host: str = "127.0.0.1"):
        self.rank, self.world, self.device, self.tp = rank, world, device, tp
        # Rank 0 hosts the store (port 0: the system picks one, the workers get it at start).
        self.store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=TIMEOUT,
                                   wait_for_workers=False)
        self.port = self.store.port
        self.comm: DeviceComm | None = None

    def start(self) -> None:
        """Join the control group and create the device communicator (every rank at once)."""
        dist.init_process_group("gloo", store=dist.PrefixStore("control", self.store), rank=self.rank,
                                world_size=self.world, timeout=TIMEOUT)
        if self.device.type == "cuda":
            self.comm = NcclComm(self.store, "nccl", self.rank, self.world, self.device)
        else:
            self.comm = GlooComm()
        self.tp.comm = self.comm

    def down(self) -> None:
        """Release the device communicator (at close); a collective after this raises."""
        if self.comm is not None:
            self.tp.comm = None
            comm, self.comm = self.comm, None
            comm.close()

    def abort(self) -> None:
        """A rank died (called from its monitor thread): unblock this rank's collectives on it."""
        comm = self.comm
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        self.down()
        if dist.is_initialized():
            dist.destroy_process_group()
