"""The weight-transfer group: rank 0 is the trainer, the server joins at rank_offset.

Both backends sit on the same rendezvous store and expose the same two calls (broadcast, wait_for),
so the packed-bucket code above them is the same on CPU (gloo) and CUDA (NCCL).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from server.weight_transfer import rendezvous


class TransferGroup(Protocol):
    rank: int
    world_size: int
    # The CUDA stream the transfers run on (NCCL), or None for a synchronous group (gloo): the
    # packed-bucket code orders its copies against it with events instead of host waits.
    stream: Any

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Start a broadcast; returns a token for wait_for (it may already be complete)."""
    def wait_for(self, token: Any) -> None: ...
    def close(self, abort: bool = False) -> None: ...


class GlooGroup:
    """CPU tensors over gloo; a broadcast returns when its bytes are there (or raises when the
    peer's connection drops: a killed trainer is noticed at once)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size = rank, world_size
        self.stream = None
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("sleepserve/gloo/", store), rank, world_size,
                                        timedelta(seconds=timeout_s))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()
        return None

    def wait_for(self, token: Any) -> None:
        pass

    def close(self, abort: bool = False) -> None:
        self.pg = None  # type: ignore[assignment]


def open_group(backend: str, store: dist.Store, rank: int, world_size: int, device: torch.device,
               timeout_s: float) -> TransferGroup:
    """Join (or, as rank 0, create) the group on an already connected store."""
    if backend == "gloo":
        return GlooGroup(store, rank, world_size, timeout_s)
    from server.weight_transfer.nccl import NcclBroadcaster, NcclLibrary

    if rank == 0:
        rendezvous.publish_unique_id(store, NcclLibrary().unique_id())
    unique_id = rendezvous.read_unique_id(store)
    return NcclBroadcaster(unique_id, rank, world_size, device, timeout_s)
