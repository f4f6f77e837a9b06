"""Buckets shared by handle instead of sent: CUDA IPC (trainer on the same GPU) and, on CPU,
POSIX shared memory. The server maps a bucket, copies out of it, and lets go of it.

CUDA handles are what torch's reduce_tensor makes of a CUDA tensor: vLLM sends them as
{gpu_uuid: rebuild_cuda_tensor args} (packed: one for the whole bucket; unpacked: one per tensor).
vLLM's trainer exports one bucket buffer once and sends the same handle with every chunk, and
torch pairs one export with one import: so the importer keeps the last mapping and drops it when
a different handle arrives or the update finishes (vLLM's PackedBufferImporter does the same).

Shared-memory handles are {"shm": name}: a segment in /dev/shm that the trainer created
(multiprocessing.shared_memory) and owns; the server maps it read-only-in-effect and unmaps it
before answering.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

SHM_DIR = Path("/dev/shm")
_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class HandleError(ValueError):
    """A handle that cannot be opened here (wrong GPU, unknown segment, bad shape)."""


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class CudaImporter:
    """Opens CUDA IPC handles, keeping the last one mapped (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._key: Any = None
        self._tensor: torch.Tensor | None = None

    def open(self, handle: dict) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = self.check(handle)
        args[6] = self.device.index if self.device.index is not None else torch.cuda.current_device()
        key = tuple(args)
        if key != self._key:
            self.close()
            self._tensor = rebuild_cuda_tensor(*args)
            self._key = key
        assert self._tensor is not None
        return self._tensor

    def check(self, handle: Any) -> list:
        """The rebuild arguments for this GPU out of {gpu_uuid: args}, or HandleError."""
        uuid = device_uuid(self.device)
        if not isinstance(handle, dict) or uuid not in handle:
            have = list(handle) if isinstance(handle, dict) else type(handle).__name__
            raise HandleError(f"no IPC handle for this server's GPU {uuid} (got {have}); the ipc backend needs "
                              "the trainer on the same GPU: use nccl across GPUs")
        args = handle[uuid]
        if isinstance(args, tuple) and len(args) == 2 and callable(args[0]):
            args = args[1]  # older vLLM: (rebuild function, args)
        args = list(args)
        if len(args) < 7:
            raise HandleError("the IPC handle does not carry torch's rebuild_cuda_tensor arguments")
        return args

    def close(self) -> None:
        self._tensor, self._key = None, None


def open_shm(handle: Any, nbytes: int) -> torch.Tensor:
    """A uint8 view of the first nbytes of a trainer's shared-memory segment."""
    return torch.from_file(str(shm_path(handle, nbytes)), shared=False, size=nbytes, dtype=torch.uint8)


def shm_path(handle: Any, nbytes: int) -> Path:
    """The segment's file, checked: a plain name, present, at least nbytes long."""
    name = handle.get("shm") if isinstance(handle, dict) else None
    if not isinstance(name, str) or not _SHM_NAME.match(name):
        raise HandleError('a shared-memory handle is {"shm": "<segment name>"} (letters, digits, _ . -)')
    path = SHM_DIR / name
    try:
        size = path.stat().st_size
    except OSError:
        raise HandleError(f"no shared-memory segment {name!r} on this host; the shm backend needs the trainer "
                          "on the same machine") from None
    if size < nbytes:
        raise HandleError(f"shared-memory segment {name!r} holds {size} bytes, fewer than the {nbytes} announced")
    return path


class ShmBucket:
    """The trainer's side: one reusable segment, exported by name."""

    def __init__(self, nbytes: int):
        from multiprocessing import shared_memory

        self.shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        self.tensor = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=nbytes)
        self.handle = {"shm": self.shm.name.lstrip("/")}

    def close(self) -> None:
        del self.tensor
        self.shm.close()
        self.shm.unlink()


class CudaBucket:
    """The trainer's side on CUDA: one reusable device buffer, exported once (as vLLM does)."""

    def __init__(self, nbytes: int, device: torch.device):
        from torch.multiprocessing.reductions import reduce_tensor

        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _, args = reduce_tensor(self.tensor)
        self.handle = {device_uuid(device): args}

    def close(self) -> None:
        del self.tensor
        torch.cuda.ipc_collect()
