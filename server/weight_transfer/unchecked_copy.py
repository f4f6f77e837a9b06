"""The copy a receive makes when nothing checks it: the interface model/finite.py's FiniteCheck fills in.

A receive copies every tensor it writes through one check object (`copy_many`; `add` for a tensor written
in place; `bad` once every byte landed). The engine injects FiniteCheck (this package sits below the model
and may not import it); a receiver built alone, as in tests, copies through this one.
"""
from __future__ import annotations

import torch


class UncheckedCopy:
    def copy_many(self, triples: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        for _, dst, src in triples:
            dst.copy_(src, non_blocking=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        pass

    def bad(self) -> list[str]:
        return []
