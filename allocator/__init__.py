"""The sleepable memory pool: tensors whose memory sleeps and wakes per tag at fixed addresses.

    from allocator import create_pool
    pool = create_pool("cuda")                 # or "cpu", "cuda:1", torch.device(...)
    pool.adopt(model, "weights")
    kv = pool.empty((blocks, block_bytes), torch.uint8, "kv_cache")
    pool.sleep(offload_tags=["weights"], discard_tags=["kv_cache"])
    pool.wake_up()

See MemoryPool for the full interface and docs/architecture.md for the invariants it keeps.
"""

from __future__ import annotations

import os

import torch

from .pool import MemoryPool
from .types import PoolError, PoolStats, PoolSleepReport, TagStats, PoolWakeReport

__all__ = [
    "MemoryPool",
    "PoolError",
    "PoolStats",
    "PoolSleepReport",
    "TagStats",
    "PoolWakeReport",
    "create_pool",
]


def create_pool(
    device: str | torch.device = "cpu",
    backup_dir: str | os.PathLike[str] | None = None,
    keep_backups: bool | None = None,
) -> MemoryPool:
    """A new pool on `device` ("cpu", "cuda", "cuda:N" or a torch.device).

    backup_dir: CPU only, the folder for offloaded tags' backup files (default
        $SLEEPSERVE_BACKUP_DIR, else the system temp folder). CUDA backs up to pinned host memory.
    keep_backups: keep host backups after wake so the next sleep reuses them; False frees them as
        soon as a wake has restored them. Default: True on CUDA (pinning 8 GiB costs ~2.8 s), False
        on CPU (the backup is a file: nothing stays on disk while awake).
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise PoolError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from err
    if dev.type == "cpu":
        from .host import HostBackend

        return MemoryPool(HostBackend(backup_dir), bool(keep_backups))
    if dev.type == "cuda":
        from .cuda import CudaBackend

        return MemoryPool(CudaBackend(dev), keep_backups is None or keep_backups)
    raise PoolError(f"no pool backend for device type '{dev.type}': use 'cpu' or 'cuda'")
