"""Unpickling of what trainers send as pickles, restricted to the few globals those pickles need.

vLLM's HTTP IPC path sends CUDA IPC handles as base64 pickles (`ipc_handles_pickled`), and its
NCCL rendezvous passes the unique id through the TCP store as a pickle. vLLM itself refuses the
first unless VLLM_ALLOW_INSECURE_SERIALIZATION=1, because a pickle can run any code. Here a pickle
may only name the torch types a tensor handle is made of and the rebuild function for CUDA
tensors; anything else is refused, so no flag is needed and no code runs.
"""
from __future__ import annotations

import base64
import binascii
import ctypes
import io
import pickle
from typing import Any

import torch


class UnsafePickleError(ValueError):
    """The pickle names something outside the allowed set, or is not a pickle at all."""


class NcclUniqueId(ctypes.Structure):
    """Layout of NCCL's ncclUniqueId (128 opaque bytes). Older vLLM versions pickle their own
    ctypes class of this layout; it is read back as this one."""
    _fields_ = [("internal", ctypes.c_byte * 128)]


def _rebuild_cuda_tensor(*args: Any) -> Any:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    return rebuild_cuda_tensor(*args)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Tensor"): torch.Tensor,
    ("torch._tensor", "Tensor"): torch.Tensor,
    ("torch", "Size"): torch.Size,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("builtins", "slice"): slice,
    ("_ctypes", "_unpickle"): getattr(__import__("_ctypes"), "_unpickle"),
    ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId"): NcclUniqueId,
}
_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _DTYPES:
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        raise UnsafePickleError(f"the pickle refers to {module}.{name}, which a weight handle never needs")


def loads(data: bytes) -> Any:
    try:
        return _Restricted(io.BytesIO(data)).load()
    except UnsafePickleError:
        raise
    except Exception as e:  # truncated or garbled bytes
        raise UnsafePickleError(f"not a readable pickle: {type(e).__name__}: {e}") from None


def loads_b64(text: str) -> Any:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise UnsafePickleError(f"not valid base64: {e}") from None
    return loads(data)


def dumps_b64(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode("ascii")
