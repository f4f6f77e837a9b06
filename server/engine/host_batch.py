"""A step's inputs as the host builds them (HostBatch), before one copy takes them to the device, and the
block tables of decodes kept from step to step (DecodeTables)."""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from server.engine.kv_cache import NULL_BLOCK
from server.engine.sequence import Request, Sequence


@dataclass
class HostBatch:
    """A step's inputs as plain lists, before they go to the device (in one copy)."""
    ids: list[int]
    positions: list[int]
    slots: list[int]
    decode_tables: list[list[int]]
    decode_lens: list[int]
    spans: list[tuple[int, int, int, list[int]]]   # (offset, new tokens, context length, block table)
    sample_rows: list[int]                          # rows of the flat batch whose logits are sampled
    sample_seqs: list[Sequence]
    # Prompt log-probs: rows whose logits score the next prompt token, that token, and per request
    # how many of those rows (in order) are its next entries.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_groups: list[tuple[Request, int]] = field(default_factory=list)
    # Async scheduling: the input ids as a device tensor (the previous step's sampled tokens, in row
    # order) instead of `ids`, which then holds placeholders: they never went through the host.
    # ids_rows: which of the previous step's sampled rows they are (a tensor-parallel worker picks the
    # same rows of the tokens rank 0 broadcast to it).
    ids_from: torch.Tensor | None = None
    ids_rows: list[int] | None = None
    # Sequences that asked for their routed experts (routed_experts.py): (sequence, its first row in the
    # batch, that row's position, rows).
    routed: list[tuple[Sequence, int, int, int]] = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        return not self.spans


def continuing(tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """tokens[rows] on the device (rows: ascending, a subset of range(len(tokens))), without waiting for it:
    the index crosses pinned and non-blocking (a blocking copy would wait for the step that writes tokens)."""
    if len(rows) == tokens.shape[0]:
        return tokens
    index = torch.tensor(rows)
    if tokens.device.type == "cuda":
        index = index.pin_memory().to(tokens.device, non_blocking=True)
    return tokens[index]


def pad_tables(tables: list[list[int]], width: int, out: np.ndarray) -> None:
    """Write block tables into out [len(tables), width] (int64), each padded with NULL_BLOCK: the blocks
    of all tables cross into numpy in one conversion and land by one mask, not a copy per row."""
    if not tables:
        return
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
    out[...] = NULL_BLOCK
    out[np.arange(width)[None, :] < lens[:, None]] = flat


class DecodeTables:
    """The padded block tables of the last batch of decodes, kept from step to step: a steady batch (the same
    sequences in the same order) changes a row only when its sequence takes a new block (1 step in 16), so
    a step writes those rows' new blocks instead of every table's blocks. A sequence's table only grows in
    place (append) or is replaced by a new list (admission, preemption, finish: kv_cache.py), so a row is
    current while its table is the same object with the same length; the tables are held, so no id repeats."""

    def __init__(self) -> None:
        self.refs: list[list[int]] = []
        self.lens = np.zeros(0, dtype=np.int64)
        self.array = np.zeros((0, 0), dtype=np.int64)

    def padded(self, tables: list[list[int]], width: int) -> np.ndarray:
        """tables as [len(tables), width] int64, each row padded with NULL_BLOCK (a view: copy it out)."""
        n = len(tables)
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        arr = self.array
        if n == len(self.refs) and width <= arr.shape[1] and all(map(operator.is_, tables, self.refs)):
            for i in np.flatnonzero(lens != self.lens).tolist():
                old, row = int(self.lens[i]), tables[i]
                arr[i, old:len(row)] = row[old:]
        else:
            arr = self.array = np.empty((n, width + 16), dtype=np.int64)  # room for 16 more blocks each
            pad_tables(tables, arr.shape[1], arr)
            self.refs = list(tables)
        self.lens = lens
        return arr[:, :width]


__all__ = ["HostBatch", "DecodeTables", "continuing", "pad_tables"]
