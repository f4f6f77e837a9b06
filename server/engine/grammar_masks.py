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

overlap=True computes the masks ahead instead, on a worker thread that advance() starts, during
postprocess, schedule and prepare. On the H200 that was slower (batch 32: 25% cost, against 14% for
masks computed in the sampler with tokens consumed one by one): the worker needs the GIL to start a
job and again to finish it, and the engine thread holds it through that Python work, so the job starts
late (a CPU simulation with 1 ms of engine Python: 0.1-0.5 ms median, 4-8 ms at worst: the 5 ms
switch interval) and ends when apply() waits, which only adds two thread handoffs per step (at batch
1 advance() took 0.17-0.21 ms with the worker against 0.02-0.03 ms without); its thread pool also
runs beside the engine thread instead of while it waits. It stays selectable so bench/structured_mask.py
--worker measures both on the same GPU.

The masks stay packed (one bit per token, 32x less than a bool mask) until the device: one transfer,
then one expression unpacks them and fills the forbidden logits with -inf for every row at once.
Rows without a grammar are all ones, so they pass through unchanged. MaskTimes records where the
engine thread's time goes, for the bench.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
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
    advance: float = 0.0  # engine thread, in advance(): consuming the sampled tokens, starting the next masks
    wait: float = 0.0     # engine thread, in apply(): blocked on masks the worker has not finished
    pack: float = 0.0     # engine thread, in apply(): gathering rows, computing masks not computed ahead
    launch: float = 0.0   # engine thread, in apply(): the transfer and the masking expression (launched)
    fill: float = 0.0     # computing masks, on whichever thread does it
    steady: int = 0       # steps that used the worker's rows as they were


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
    thread only. overlap=False (the default): each step's masks are computed in apply(), on the engine
    thread, while the device runs the forward. overlap=True: they are computed ahead, on a worker
    thread started by advance() (measured slower on the H200: see the module docstring)."""

    NUM_BUFFERS = 3  # the job's rows, a reordered copy, and one the device may still be reading

    def __init__(self, vocab_size: int, device: torch.device, bit_values: torch.Tensor | None = None,
                 overlap: bool = False) -> None:
        """bit_values: bit_values_on(device), kept where the owner keeps its device memory (the pool)."""
        self.words = (vocab_size + 31) // 32
        self.overlap = overlap
        self._pin = device.type == "cuda"
        self.bit_values = bit_values
        self._buffers: list[_Buffer | None] = [None] * self.NUM_BUFFERS
        self._cursor = 0
        self._job: _Job | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._llg_executor = None
        self.times = MaskTimes()

    def advance(self, sampled: list[tuple["Sequence", int]]) -> set[int]:
        """Consume each constrained sequence's sampled token (and with overlap, start computing its
        next mask on the worker). Returns the seq_ids whose grammar is complete (it admits no
        further token)."""
        pairs = [(s, t) for s, t in sampled if s.matcher is not None]
        if not pairs:
            return set()
        t0 = time.perf_counter()
        self._wait()  # the last job may still hold matchers (when a step sampled none of its rows)
        t1 = time.perf_counter()
        self._llg().consume_token_par([(s.matcher, t) for s, t in pairs])
        complete, going = set(), []
        for s, _ in pairs:
            if s.matcher.is_stopped() and not s.matcher.is_error():
                complete.add(s.seq_id)
            else:  # a matcher in error (a token its grammar forbids) masks everything but end-of-sequence
                going.append(s)
        if going and self.overlap:
            buffer = self._buffer(len(going))
            work = [(s.matcher, i) for i, s in enumerate(going)]
            self._job = _Job(going, buffer, self._pool().submit(self._fill_rows, work, buffer, len(going)))
        t = self.times
        t.wait += t1 - t0
        t.advance += time.perf_counter() - t1
        return complete

    def apply(self, logits: torch.Tensor, seqs: list["Sequence"]) -> None:
        """Mask the logits [len(seqs), V] of the sequences that have a grammar (rows in seqs' order)."""
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not constrained:
            return
        if self.overlap:
            packed, buffer = self._packed(seqs, constrained)
        else:
            packed, buffer = self._computed(seqs, constrained)
        t0 = time.perf_counter()
        apply_token_bitmask(logits, packed, self.bit_values)
        buffer.read_by_device()
        t = self.times
        t.launch += time.perf_counter() - t0
        t.steps += 1

    def set_overlap(self, overlap: bool) -> None:
        """Switch between computing the masks in apply() and ahead on the worker (bench/structured_mask.py
        measures both); any job under way is finished and dropped first."""
        self._wait()
        self._job = None
        self.overlap = overlap

    def close(self) -> None:
        try:
            self._wait()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None

    def _computed(self, seqs: list["Sequence"], constrained: list[int]) -> tuple[torch.Tensor, _Buffer]:
        """The packed masks of `seqs` in order, computed now (llguidance releases the GIL; on CUDA the
        forward, launched before this, runs meanwhile). Rows without a grammar are all ones."""
        t0 = time.perf_counter()
        buffer = self._buffer(len(seqs))
        out = buffer.rows(len(seqs))
        if len(constrained) < len(seqs):
            out.fill_(ALL_ALLOWED)
        self._fill([(seqs[i].matcher, i) for i in constrained], out)
        self.times.pack += time.perf_counter() - t0
        return out, buffer

    def _packed(self, seqs: list["Sequence"], constrained: list[int]) -> tuple[torch.Tensor, _Buffer]:
        """With overlap: the packed masks of `seqs` in order: the worker's rows as they are when they
        are exactly these sequences in this order (a decode batch's steady state), else gathered and
        completed here."""
        t0 = time.perf_counter()
        self._wait()
        t1 = time.perf_counter()
        self.times.wait += t1 - t0
        job = self._job
        if job is not None and len(constrained) == len(seqs) and job.seq_ids == [s.seq_id for s in seqs]:
            self.times.steady += 1
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
        self.times.pack += time.perf_counter() - t1
        return out, buffer

    def _fill_rows(self, work: list, buffer: _Buffer, n: int) -> None:
        self._fill(work, buffer.rows(n))

    def _fill(self, work: list, out: torch.Tensor) -> None:
        """llguidance writes each (matcher, row)'s mask into out[row], in parallel, without the GIL."""
        import llguidance.torch as llt

        t0 = time.perf_counter()
        llt.fill_next_token_bitmask_par(self._llg(), work, out)
        self.times.fill += time.perf_counter() - t0  # one writer at a time: the worker is waited for

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
