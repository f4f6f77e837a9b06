"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Each step: running sequences first (a decode is one token; an unfinished prompt continues with a
chunk), oldest first; if blocks run out, the newest running sequence is preempted (its blocks are
freed and it waits to be recomputed). Then waiting sequences are admitted while the budget, the
sequence limit and free blocks allow. After the batch ran, advance() records its progress.

The scheduler is the one writer of Sequence.num_computed (how many tokens have KV in the cache):
admission sets it to the cached prefix, advance() adds what a step computed, preemption and
finishing reset it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from server.engine.kv_cache import BlockManager
from server.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: int = 0
    num_tokens: int = 0  # the sum of new tokens

    @property
    def decode_only(self) -> bool:
        """Every item is one token (the steady state of generation)."""
        return self.num_tokens == len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_finished = 0  # sequences finish()ed: with num_preemptions, whether `running` lost any

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bs = self.blocks.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if seq.num_computed + n <= len(seq.block_table) * bs:
                # It fits in the blocks it holds (15 decode steps in 16): nothing to allocate or check.
                batch.items.append((seq, n))
                budget -= n
                i += 1
                continue
            while not self.blocks.can_grow(seq, seq.num_computed + n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted += 1
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq, seq.num_computed + n)
                batch.items.append((seq, n))
                budget -= n
                i += 1
        batch.num_tokens = self.max_num_batched_tokens - budget
        if batch.preempted:
            return batch  # no admissions while the cache is under pressure
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.blocks.match_prefix(seq)
            start = len(cached) * self.blocks.block_size
            n = min(seq.num_tokens - start, budget)
            if not self.blocks.admit(seq, cached, start + n):
                break
            seq.num_computed = seq.num_cached_tokens = start
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.items.append((seq, n))
            budget -= n
        batch.num_tokens = self.max_num_batched_tokens - budget
        return batch

    def schedule_ahead(self, seqs: list[Sequence], max_model_len: int,
                       all_running: bool = False) -> tuple[ScheduledBatch, list[int]] | None:
        """Async scheduling (core.py): the next decode step of `seqs`, the sequences the step in flight
        samples, before its tokens reach the host. Each goes on with one token at position num_tokens (the
        token in flight) and gets the block for it now, except a sequence that ends with the token in flight
        by its length (max_tokens, the context), known ahead; one that ends by a stop (EOS, a stop token or
        string) computes one token too many, which the engine drops. Returns the batch and the index in
        `seqs` of each of its items, or None when the step needs the host's results first: a running
        sequence not in `seqs`, a request to admit, a block that is not free without a preemption.
        all_running: the caller knows every one of `seqs` is still running (nothing left `running` since)."""
        if self.waiting and len(self.running) < self.max_num_seqs:
            return None  # admission (schedule()) comes after the tokens in flight are recorded
        running = SeqStatus.RUNNING
        if all_running:
            live = range(len(seqs))
        else:
            live = [i for i, s in enumerate(seqs) if s.status is running]  # not aborted meanwhile
        if len(live) != len(self.running) or len(live) > self.max_num_batched_tokens:
            return None
        bs, blocks = self.blocks.block_size, self.blocks
        batch = ScheduledBatch()
        items = batch.items
        rows = []
        for i in live:
            seq = seqs[i]
            need = len(seq.token_ids) + 1  # with the token in flight, and the one after it
            max_tokens = seq.params.max_tokens
            if need >= max_model_len or (max_tokens is not None and need - seq.num_prompt_tokens >= max_tokens):
                continue  # the token in flight is its last
            if need > len(seq.block_table) * bs:
                if not blocks.can_grow(seq, need):
                    return None  # schedule() preempts, once the tokens in flight are recorded
                blocks.grow(seq, need)
            items.append((seq, 1))
            rows.append(i)
        if not rows:
            return None
        batch.num_tokens = len(rows)
        return batch, rows

    def advance(self, batch: ScheduledBatch) -> None:
        """The batch ran: its new tokens have KV now, and blocks it filled join the prefix cache."""
        bs, blocks = self.blocks.block_size, self.blocks
        if not blocks.enable_prefix_caching:  # nothing to register
            for seq, n in batch.items:
                seq.num_computed += n
            return
        for seq, n in batch.items:
            computed = seq.num_computed = seq.num_computed + n
            if computed // bs > len(seq.block_hashes):  # a block filled (1 decode step in 16)
                blocks.commit(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        seq.request.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence that is done (or aborted) and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.FINISHED
        self.num_finished += 1

    @property
    def removals(self) -> tuple[int, int]:
        """Changes when a sequence leaves `running` (finished, aborted, preempted): while it stays the same,
        every sequence that was running still is."""
        return self.num_finished, self.num_preemptions

    def preempt_all(self) -> list[Sequence]:
        """Release every running sequence's KV (they will be recomputed): used when the KV cache
        is discarded by sleep with mode=keep."""
        seqs = list(self.running)
        for seq in reversed(seqs):
            self.running.remove(seq)
            self._preempt(seq)
        return seqs
