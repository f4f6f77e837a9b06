"""The copy a receive makes when nothing checks it: the interface model/finite.py's FiniteCheck fills in.

A receive copies every tensor it writes through one check object (`copy_many`; `copy_packed` for a packed
bucket's tensors; `add` for a tensor written in place; `bad` once every byte landed). The engine injects
FiniteCheck (this package sits below the model and may not import it); a receiver built alone, as in tests,
copies through this one.
"""
from __future__ import annotations

import torch


class UncheckedCopy:
    def copy_many(self, triples: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        for _, dst, src in triples:
            dst.copy_(src, non_blocking=True)

    def copy_packed(self, bucket: torch.Tensor, metas, targets: dict[str, torch.Tensor], view) -> list[str]:
        """The packed bucket's tensors into targets, each through its view(bucket, offset, meta)."""
        written, offset = [], 0
        for m in metas:
            if m.name in targets:
                targets[m.name].copy_(view(bucket, offset, m), non_blocking=True)
                written.append(m.name)
            offset += m.nbytes
        return written

    def add(self, name: str, tensor: torch.Tensor) -> None:
        pass

    def bad(self) -> list[str]:
        return []
