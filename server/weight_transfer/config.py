"""--weight-transfer-config: which transport moves weights into this server without disk.

vLLM's flag takes JSON such as '{"backend": "nccl"}'; the same JSON works here. Backends:
  nccl  trainer on other GPUs (or hosts): packed buckets broadcast over NCCL (CUDA servers)
  ipc   trainer on the same GPU: CUDA IPC handles of flattened buckets (CUDA servers)
  gloo  the nccl protocol on CPU tensors over gloo (CPU servers; what CI tests)
  shm   the ipc protocol with POSIX shared memory (CPU servers; what CI tests)
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields


# vLLM's defaults (packed_tensor.py): 1 GiB buckets, two of them in flight. Kept here, torch-free,
# so the CLI can read the flag without importing torch.
DEFAULT_BUCKET_BYTES = 1 << 30
DEFAULT_NUM_BUFFERS = 2

BACKENDS = ("nccl", "ipc", "gloo", "shm")
_DEVICE_OF = {"nccl": "cuda", "ipc": "cuda", "gloo": "cpu", "shm": "cpu"}
_CPU_TWIN = {"nccl": "gloo", "ipc": "shm", "gloo": "nccl", "shm": "ipc"}


@dataclass(frozen=True)
class WeightTransferConfig:
    backend: str = "nccl"
    packed: bool = True                                   # ipc: flattened buckets (vLLM's IPC config field)
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES  # default when an update does not say
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS
    timeout_s: float = 300.0                              # rendezvous and each bucket's receive

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"weight transfer backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.packed_buffer_size_bytes < 1 or self.packed_num_buffers < 1 or self.timeout_s <= 0:
            raise ValueError("packed_buffer_size_bytes, packed_num_buffers and timeout_s must be positive")

    @property
    def distributed(self) -> bool:
        return self.backend in ("nccl", "gloo")

    def check_device(self, device_type: str) -> None:
        if _DEVICE_OF[self.backend] != device_type:
            raise ValueError(f"weight transfer backend {self.backend!r} needs a {_DEVICE_OF[self.backend]} server; "
                             f"this one runs on {device_type}: use {_CPU_TWIN[self.backend]!r}")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, text: str | dict | None) -> "WeightTransferConfig | None":
        if text is None or text == "":
            return None
        data = text
        if isinstance(text, str):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f'--weight-transfer-config is not JSON ({e.msg}); write e.g. \'{{"backend": "nccl"}}\'') \
                    from None
        if not isinstance(data, dict):
            raise ValueError('--weight-transfer-config must be a JSON object, e.g. {"backend": "ipc"}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--weight-transfer-config: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"--weight-transfer-config: {e}") from None
