"""A step's inputs on the wire to the workers: the plain lists of a HostBatch, without the sequences
(only rank 0 samples). One pickle of a few int lists per step (tens of microseconds at batch 64)."""
from __future__ import annotations

from server.engine.runner import HostBatch


def pack_step(hb: HostBatch) -> tuple:
    return (hb.ids, hb.positions, hb.slots, hb.decode_tables, hb.decode_lens, hb.spans, hb.sample_rows,
            hb.prompt_rows)


def unpack_step(packed: tuple) -> HostBatch:
    ids, positions, slots, tables, lens, spans, sample_rows, prompt_rows = packed
    return HostBatch(ids, positions, slots, tables, lens, spans, sample_rows, [], prompt_rows=prompt_rows)
