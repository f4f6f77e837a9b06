"""Structured outputs, step by step: each constrained sequence's grammar advanced by its sampled token,
its next token mask computed while the device runs the forward pass, and the masks applied to the
logits in one batched operation.

A step with constrained sequences, on the engine thread, and on CUDA the device behind it:

    engine:  sample N | postprocess N: advance() | schedule, prepare, launch N+1 | apply(): masks N+1 | sample N+1
    device:                                                        | forward N+1 ............| mask |

`advance` consumes the sampled tokens (llguidance's consume_token_par: parallel, without the GIL).
`apply`, called as soon as the forward is launched, fills the next masks of the rows about to be
sampled into a pinned buffer with fill_next_token_bitmask_par (llguidance's thread pool; its LLExecutor
releases the GIL for the whole computation) while the device computes the logits, then queues their
transfer and application. Only this module touches a sequence's matcher after it is created.

No worker thread computes the masks ahead: one that did cost more (H200, llama-1b, a JSON schema on every
sequence: 7.7% a step at batch 32 against 3.2% for this path), since it needs the GIL to start and finish
each job while the engine thread runs Python.

The masks stay packed (one bit per token, 32x less than a bool mask) until the device: one transfer,
then one expression unpacks them and fills the forbidden logits with -inf for every row at once.
Rows without a grammar are all ones, so they pass through unchanged. MaskTimes records where the
engine thread's time goes, for the bench.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from server.engine.sequence import Sequence

ALL_ALLOWED = -1  # an int32 word with every bit set


def apply_token_bitmask(logits: torch.Tensor, packed: torch.Tensor, bit_values: torch.Tensor | None = None) -> None:
    """Set to -inf, in place, every logit whose bit is 0 in `packed`.

    logits [N, V] on any device; packed [N, ceil(V / 32)] int32 on the host (pinned for CUDA), bit j
    of word w standing for token 32 w + j. One transfer and one batched expression for all rows.
    bit_values: bit_values_on() the logits' device (made here if not given)."""
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":
        # Bit j of word w is bit j of byte 4w + j // 8 on a little-endian host: unpackbits in "little"
        # order yields tokens in order, as 0/1 bytes that are valid bools without a copy.
        allowed = np.unpackbits(packed.numpy().view(np.uint8), axis=-1, count=vocab, bitorder="little")
        logits.masked_fill_(torch.from_numpy(allowed).view(torch.bool).logical_not_(), float("-inf"))
        return
    bits = packed.to(logits.device, non_blocking=True)
    logits.masked_fill_(forbidden_tokens(bits, vocab, bit_values), float("-inf"))


def forbidden_tokens(bits: torch.Tensor, vocab: int, bit_values: torch.Tensor | None = None) -> torch.Tensor:
    """[N, W] packed int32 masks (on any device) -> [N, vocab] bool, True where the bit is 0.

    Unpacked byte by byte: on a little-endian host bit j of word w is bit j % 8 of byte 4 w + j // 8,
    so bit k of byte b is token 8 b + k, and the one intermediate ([N, 4 W, 8] uint8) is the size of
    the bool result (an int32 one, bit by bit per word, would be four times that)."""
    values = bit_values if bit_values is not None else bit_values_on(bits.device)
    return ((bits.view(torch.uint8).unsqueeze(-1) & values) == 0).view(bits.shape[0], -1)[:, :vocab]


def bit_values_on(device: torch.device) -> torch.Tensor:
    """[1 << 0, ..., 1 << 7] as uint8: the bits of a byte."""
    return (torch.ones(8, dtype=torch.uint8) << torch.arange(8, dtype=torch.uint8)).to(device)


@dataclass
class MaskTimes:
    """Where the mask work of the steps goes, in seconds summed since the last reset (a handful of
    clock reads a step: always on, read by bench/structured_mask.py)."""
    steps: int = 0        # apply() calls that masked something
    advance: float = 0.0  # in advance(): consuming the sampled tokens
    pack: float = 0.0     # in apply(): computing the masks into the buffer (fill included)
    launch: float = 0.0   # in apply(): the transfer and the masking expression (launched)
    fill: float = 0.0     # in apply(): llguidance computing the masks (part of pack)


class _Buffer:
    """A host buffer of packed masks, pinned for CUDA, with the event of the last copy out of it: it is
    rewritten only once the device has read it."""

    def __init__(self, rows: int, words: int, pin: bool) -> None:
        self.data = torch.empty((rows, words), dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None
        self._pending = False

    def read_by_device(self) -> None:
        """Called once a copy out of this buffer is queued on the current stream."""
        if self._copied is not None:
            self._copied.record()
            self._pending = True

    def rows(self, n: int) -> torch.Tensor:
        """The first n rows, to be written (once the device has read them)."""
        if self._pending:
            self._copied.synchronize()  # type: ignore[union-attr]
            self._pending = False
        return self.data[:n]


class GrammarMasks:
    """The token masks of the constrained sequences in flight, for one engine. Called from the engine
    thread only: each step's masks are computed in apply() while the device runs the forward."""

    def __init__(self, vocab_size: int, device: torch.device, bit_values: torch.Tensor | None = None) -> None:
        """bit_values: bit_values_on(device), kept where the owner keeps its device memory (the pool)."""
        self.words = (vocab_size + 31) // 32
        self._pin = device.type == "cuda"
        self.bit_values = bit_values
        # One buffer is enough: the device reads it after apply() returns, but _Buffer.rows() waits for
        # that copy before the next apply() rewrites it, and that wait never blocks in the engine, since
        # sample() reads the sampled tokens back to the host, after the device has masked the logits.
        self._buffer: _Buffer | None = None
        self._llg_executor = None
        self.times = MaskTimes()

    def advance(self, sampled: list[tuple]) -> set[int]:
        """Consume each constrained sequence's sampled token: `sampled` holds (sequence, token, ...) tuples.
        Returns the seq_ids whose grammar is complete (it admits no further token)."""
        pairs = [(x[0], x[1]) for x in sampled if x[0].matcher is not None]
        if not pairs:
            return set()
        t0 = time.perf_counter()
        self._llg().consume_token_par([(s.matcher, t) for s, t in pairs])
        # A matcher in error (a token its grammar forbids) is not complete: it masks everything but
        # end-of-sequence.
        complete = {s.seq_id for s, _ in pairs if s.matcher.is_stopped() and not s.matcher.is_error()}
        self.times.advance += time.perf_counter() - t0
        return complete

    def apply(self, logits: torch.Tensor, seqs: list["Sequence"]) -> None:
        """Mask the logits [len(seqs), V] of the sequences that have a grammar (rows in seqs' order)."""
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not constrained:
            return
        packed, buffer = self._computed(seqs, constrained)
        t0 = time.perf_counter()
        apply_token_bitmask(logits, packed, self.bit_values)
        buffer.read_by_device()
        t = self.times
        t.launch += time.perf_counter() - t0
        t.steps += 1

    def _computed(self, seqs: list["Sequence"], constrained: list[int]) -> tuple[torch.Tensor, _Buffer]:
        """The packed masks of `seqs` in order, computed now (llguidance releases the GIL; on CUDA the
        forward, launched before this, runs meanwhile). Rows without a grammar are all ones."""
        t0 = time.perf_counter()
        buffer = self._buffer_for(len(seqs))
        out = buffer.rows(len(seqs))
        if len(constrained) < len(seqs):
            out.fill_(ALL_ALLOWED)
        self._fill([(seqs[i].matcher, i) for i in constrained], out)
        self.times.pack += time.perf_counter() - t0
        return out, buffer

    def _fill(self, work: list, out: torch.Tensor) -> None:
        """llguidance writes each (matcher, row)'s mask into out[row], in parallel, without the GIL."""
        import llguidance.torch as llt

        t0 = time.perf_counter()
        llt.fill_next_token_bitmask_par(self._llg(), work, out)
        self.times.fill += time.perf_counter() - t0

    def _buffer_for(self, rows: int) -> _Buffer:
        """The buffer, replaced by a larger one when it has fewer than `rows` rows."""
        b = self._buffer
        if b is None or b.data.shape[0] < rows:
            if b is not None:
                b.rows(0)  # let the device finish reading the one it replaces
            b = self._buffer = _Buffer(max(rows, 64), self.words, self._pin)
        return b

    def _llg(self):
        if self._llg_executor is None:
            import llguidance

            self._llg_executor = llguidance.LLExecutor()
        return self._llg_executor
