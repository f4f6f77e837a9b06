"""What vLLM's weight-transfer wire protocol fixes, in one place, for the server and the sender.

- dtype names are torch's attribute names ("bfloat16", not "torch.bfloat16").
- A packed transfer moves tensors as raw bytes, concatenated in the announced order, in buckets:
  a bucket takes tensors until its byte count *exceeds* the bucket size (the tensor that crosses
  the limit is still in it), then the next bucket starts. Sender and receiver both derive the
  split from the announced sizes, so only `packed_buffer_size_bytes` has to agree.
- Each bucket is broadcast from rank 0 (the trainer) as one uint8 tensor; unpacked, each tensor
  is a byte slice of it viewed as its dtype and shape. So when a bucket's tensors already lie one
  after another in one storage (fused q|k|v and gate|up parameters, a trainer's flat buffer), that
  storage's bytes *are* the bucket: `region` gives them, and no pack or unpack copy is needed.
- Unpacked (packed: false), each tensor is one broadcast of its own, in the announced order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
    "half": torch.float16, "float": torch.float32, "double": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[range]:
    """Index ranges of the packed buckets, by vLLM's rule (a bucket ends once it exceeds the size)."""
    buckets: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > bucket_bytes:
            buckets.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        buckets.append(range(start, len(sizes)))
    return buckets


def unpack(bucket: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views of a uint8 bucket as the tensors it carries (no copy unless a start is misaligned)."""
    out, offset = [], 0
    for m in metas:
        out.append((m.name, view_at(bucket, offset, m)))
        offset += m.nbytes
    return out


def view_at(bucket: torch.Tensor, offset: int, meta: TensorMeta) -> torch.Tensor:
    """The tensor `meta` describes at `offset` in a uint8 bucket: a view, or a copy where its start is not
    aligned to its dtype (a view needs it: e.g. float32 after an odd bf16 count)."""
    piece = bucket[offset:offset + meta.nbytes]
    if (bucket.storage_offset() + offset) % meta.dtype.itemsize:
        piece = piece.clone()
    return piece.view(meta.dtype).view(meta.shape)


def pack_into(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> int:
    """Copy tensors' bytes one after another into a uint8 buffer; returns the bytes written."""
    offset = 0
    for t in tensors:
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        buffer[offset:offset + flat.numel()].copy_(flat, non_blocking=True)
        offset += flat.numel()
    return offset


def region(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The uint8 view of the bytes the tensors occupy if they lie back to back, in this order, in one
    storage (so writing the view writes them, reading it reads them); else None."""
    if not tensors or any(t.numel() == 0 or not t.is_contiguous() for t in tensors):
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    end = first.data_ptr()
    for t in tensors:
        if t.device != first.device or t.untyped_storage().data_ptr() != storage.data_ptr() or t.data_ptr() != end:
            return None
        end += t.numel() * t.element_size()
    start = first.data_ptr() - storage.data_ptr()
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (end - first.data_ptr(),), (1,))
