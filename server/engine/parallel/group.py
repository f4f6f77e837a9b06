"""The process group of the tensor-parallel ranks, which can be released and re-created.

A TCP store hosted by rank 0 outlives the groups; each generation of the group rendezvous under its
own prefix, so a group destroyed for a sleep (NCCL's buffers are ~838 MiB per rank on an H200, not
pool memory) is re-created on wake by the same code on every rank. gloo on CPU takes the same path.
"""
from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("sleepserve.engine")

# A collective waits this long for a slow rank (loading 8B on one rank while the others wait in the
# KV-block agreement takes tens of seconds); a dead rank is noticed at once by the worker monitor.
TIMEOUT = timedelta(seconds=600)


class Group:
    def __init__(self, port: int, rank: int, world: int, device: torch.device, host: str = "127.0.0.1"):
        self.rank, self.world, self.device = rank, world, device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        # Rank 0 hosts the store (port 0: the system picks one, the workers get it at spawn).
        self.store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=TIMEOUT,
                                   wait_for_workers=False)
        self.port = self.store.port
        self.generation = -1
        self.up_now = False

    def up(self, generation: int) -> None:
        """Join generation `generation` of the group (every rank calls it) and run one collective, so
        the communicator exists now (NCCL creates it lazily) and not inside a CUDA-graph capture."""
        kwargs = {"device_id": self.device} if self.backend == "nccl" else {}
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"tp{generation}", self.store),
                                rank=self.rank, world_size=self.world, timeout=TIMEOUT, **kwargs)
        probe = torch.ones(1, device=self.device)
        dist.all_reduce(probe)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.generation, self.up_now = generation, True

    def down(self) -> None:
        """Destroy the group: NCCL frees its communicator's buffers (what stays is measured in the README)."""
        if self.up_now:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dist.destroy_process_group()
            self.up_now = False
