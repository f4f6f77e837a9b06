"""The copy a receive makes when nothing checks it: the interface model/finite.py's FiniteCheck fills in.

A receive copies every tensor it writes through one check object (`copy_many`; `copy_packed` for a packed
bucket's tensors; `add` for a tensor written in place; `bad` once every byte landed). The engine injects
FiniteCheck (this package sits below the model and may not import it); a receiver built alone, as in tests,
copies through this one.
"""
from __future__ import annotations

import torch

from server.weight_transfer.protocol import unpack


class UncheckedCopy:
    def copy_many(self, triples: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        for _, dst, src in triples:
            dst.copy_(src, non_blocking=True)

    def copy_packed(self, bucket: torch.Tensor, metas, targets: dict[str, torch.Tensor]) -> list[str]:
        pairs = [(name, tensor) for name, tensor in unpack(bucket, metas) if name in targets]
        self.copy_many([(name, targets[name], tensor) for name, tensor in pairs])
        return [name for name, _ in pairs]

    def add(self, name: str, tensor: torch.Tensor) -> None:
        pass

    def bad(self) -> list[str]:
        return []
