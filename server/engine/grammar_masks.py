"""Structured outputs, step by step: each constrained sequence's grammar advanced by its sampled token,
its next token mask computed while the device runs the forward pass, and the masks applied to the
logits in one batched operation.

A step with constrained sequences, on the engine thread and the mask worker:

    engine:  sample N | postprocess N: advance() ........ | schedule, prepare, forward N+1 | apply()
    worker:           |               masks for N+1 (llguidance, no GIL) ...|              (waited for)

`advance` consumes the sampled tokens (llguidance's consume_token_par: parallel, without the GIL) and
hands the sequences to the worker, which fills their next masks into a pinned buffer with
fill_next_token_bitmask_par (llguidance's thread pool; the GIL is released for the whole computation,
llguidance's LLExecutor detaches from Python). By the time the next step samples, the masks are
usually there; `apply` waits only for what is missing. Only this module touches a sequence's matcher
after it is created, so the worker never shares one with the engine thread.

The masks stay packed (one bit per token, 32x less than a bool mask) until the device: one transfer,
then one expression unpacks them and fills the forbidden logits with -inf for every row at once.
Rows without a grammar are all ones, so they pass through unchanged.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
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
    bit_values: bit_values() on the logits' device (made here if not given)."""
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
    """[N, W] packed int32 masks (on any device) -> [N, vocab] bool, True where the bit is 0."""
    values = bit_values if bit_values is not None else bit_values_on(bits.device)
    return ((bits.unsqueeze(-1) & values) == 0).view(bits.shape[0], -1)[:, :vocab]


def bit_values_on(device: torch.device) -> torch.Tensor:
    """[1 << 0, ..., 1 << 31] as int32 (1 << 31 is the sign bit, as it should be)."""
    return (torch.ones(32, dtype=torch.int32) << torch.arange(32, dtype=torch.int32)).to(device)


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


class _Job:
    """The next-token masks of some sequences, computed on the worker into the rows of one buffer."""

    def __init__(self, seqs: list["Sequence"], buffer: _Buffer, done: Future) -> None:
        self.seq_ids = [s.seq_id for s in seqs]
        self.row_of = {sid: i for i, sid in enumerate(self.seq_ids)}
        self.buffer = buffer
        self.done = done


class GrammarMasks:
    """The token masks of the constrained sequences in flight, for one engine. Called from the engine
    thread only; the worker it owns runs llguidance's mask computation."""

    NUM_BUFFERS = 3  # the job's rows, a reordered copy, and one the device may still be reading

    def __init__(self, vocab_size: int, device: torch.device, bit_values: torch.Tensor | None = None) -> None:
        """bit_values: bit_values_on(device), kept where the owner keeps its device memory (the pool)."""
        self.words = (vocab_size + 31) // 32
        self._pin = device.type == "cuda"
        self._bit_values = bit_values
        self._buffers: list[_Buffer | None] = [None] * self.NUM_BUFFERS
        self._cursor = 0
        self._job: _Job | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._llg_executor = None

    def advance(self, sampled: list[tuple["Sequence", int]]) -> set[int]:
        """Consume each constrained sequence's sampled token, then start computing its next mask on
        the worker. Returns the seq_ids whose grammar is complete (it admits no further token)."""
        pairs = [(s, t) for s, t in sampled if s.matcher is not None]
        if not pairs:
            return set()
        self._wait()  # the last job may still hold matchers (when a step sampled none of its rows)
        self._llg().consume_token_par([(s.matcher, t) for s, t in pairs])
        complete, going = set(), []
        for s, _ in pairs:
            if s.matcher.is_stopped() and not s.matcher.is_error():
                complete.add(s.seq_id)
            else:  # a matcher in error (a token its grammar forbids) masks everything but end-of-sequence
                going.append(s)
        if going:
            buffer = self._buffer(len(going))
            work = [(s.matcher, i) for i, s in enumerate(going)]
            self._job = _Job(going, buffer, self._pool().submit(self._fill_rows, work, buffer, len(going)))
        return complete

    def apply(self, logits: torch.Tensor, seqs: list["Sequence"]) -> None:
        """Mask the logits [len(seqs), V] of the sequences that have a grammar (rows in seqs' order)."""
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not constrained:
            return
        packed, buffer = self._packed(seqs, constrained)
        apply_token_bitmask(logits, packed, self._bit_values)
        buffer.read_by_device()

    def close(self) -> None:
        try:
            self._wait()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None

    def _packed(self, seqs: list["Sequence"], constrained: list[int]) -> tuple[torch.Tensor, _Buffer]:
        """The packed masks of `seqs` in order: the worker's rows as they are when they are exactly
        these sequences in this order (a decode batch's steady state), else gathered and completed here."""
        self._wait()
        job = self._job
        if job is not None and len(constrained) == len(seqs) and job.seq_ids == [s.seq_id for s in seqs]:
            return job.buffer.data[:len(seqs)], job.buffer
        buffer = self._buffer(len(seqs))
        out = buffer.rows(len(seqs))
        out.fill_(ALL_ALLOWED)
        src, dst, missing = [], [], []
        for i in constrained:
            row = job.row_of.get(seqs[i].seq_id) if job is not None else None
            if row is None:
                missing.append(i)
            else:  # still valid: a matcher changes only in advance(), which replaces the job
                src.append(row)
                dst.append(i)
        if src:
            out.numpy()[dst] = job.buffer.data.numpy()[src]  # type: ignore[union-attr]
        if missing:  # sampled for the first time (or first since a preemption): computed now
            self._fill([(seqs[i].matcher, i) for i in missing], out)
        return out, buffer

    def _fill_rows(self, work: list, buffer: _Buffer, n: int) -> None:
        self._fill(work, buffer.rows(n))

    def _fill(self, work: list, out: torch.Tensor) -> None:
        """llguidance writes each (matcher, row)'s mask into out[row], in parallel, without the GIL."""
        import llguidance.torch as llt

        llt.fill_next_token_bitmask_par(self._llg(), work, out)

    def _wait(self) -> None:
        job = self._job
        if job is None:
            return
        try:
            job.done.result()
        except BaseException:
            self._job = None  # raised once, on the engine thread; the next step starts clean
            raise

    def _buffer(self, rows: int) -> _Buffer:
        """The next buffer of the ring that is not the current job's (its rows may still be read)."""
        busy = self._job.buffer if self._job is not None else None
        for _ in range(self.NUM_BUFFERS):
            self._cursor = (self._cursor + 1) % self.NUM_BUFFERS
            b = self._buffers[self._cursor]
            if b is busy and b is not None:
                continue
            if b is None or b.data.shape[0] < rows:
                if b is not None:
                    b.rows(0)  # let the device finish reading the one it replaces
                b = self._buffers[self._cursor] = _Buffer(max(rows, 64), self.words, self._pin)
            return b
        raise AssertionError("unreachable: NUM_BUFFERS > 1")

    def _pool(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="sleepserve-grammar")
        return self._worker

    def _llg(self):
        if self._llg_executor is None:  # made on the engine thread, before the worker first runs
            import llguidance

            self._llg_executor = llguidance.LLExecutor()
        return self._llg_executor
