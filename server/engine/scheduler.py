"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Each step: running sequences first (a decode is one token; an unfinished prompt continues with a
chunk), oldest first; if blocks run out, the newest running sequence is preempted (its blocks are
freed and it waits to be recomputed). Then waiting sequences are admitted while the budget, the
sequence limit and free blocks allow. After the batch ran, update_from_output() applies its result.

The scheduler is the one writer of a sequence's progress: Sequence.num_computed (how many tokens have
KV in the cache: admission sets it to the cached prefix, a step's result adds what it computed,
preemption and finishing reset it), its tokens, text and end (update_from_output), and its status.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from server.wire.detokenizer import detokenize_step
from server.engine.kv_cache import BlockManager
from server.engine.routed_experts import store as store_routed
from server.engine.sequence import Request, Sequence, SeqStatus, settle_texts
from server.engine.step_types import ScheduledBatch, StepResult


@dataclass
class StepUpdate:
    """What update_from_output changed, for the core's outputs: the requests the step advanced (in order),
    those that got their first token now, and those with a sequence that ended."""
    touched: dict[str, Request] = field(default_factory=dict)
    first: set[str] = field(default_factory=set)
    done: set[str] = field(default_factory=set)
    sampled: int = 0  # tokens sampled (vllm:iteration_tokens_total counts them)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, *,
                 max_model_len: int = 1 << 62, eos_ids: frozenset[int] = frozenset(), tokenizer=None):
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer  # the text of each new token (stop strings), in update_from_output
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
            batch.mark = self.removals
            return batch  # no admissions while the cache is under pressure
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.blocks.match_prefix(seq)
            start = len(cached) * self.blocks.block_size
            n = min(seq.num_tokens - start, budget)
            if not self.blocks.admit(seq, cached, start + n):
                break
            seq.num_computed = seq.num_cached_tokens = start
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.items.append((seq, n))
            budget -= n
        batch.num_tokens = self.max_num_batched_tokens - budget
        batch.mark = self.removals
        return batch

    def schedule_ahead(self, seqs: list[Sequence], all_running: bool = False
                       ) -> tuple[ScheduledBatch, list[int]] | None:
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
        bs, blocks, max_model_len = self.blocks.block_size, self.blocks, self.max_model_len
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
        batch.mark = self.removals
        return batch, rows

    def update_from_output(self, batch: ScheduledBatch, result: StepResult) -> StepUpdate:
        """Apply what a step computed: the KV progress, prompt log-probs, the sampled tokens and their text,
        the sequences that end (their blocks are freed here). A sequence that left `running` after the
        batch was made (a stop in the step before, an abort) is dropped with what it computed.

        One pass over the sequences does what each needs (append, the end checks, request times), so the
        work per sequence is a few attribute reads for one that goes on; the text of every continuing
        sequence is one detokenizer call for the step, then the checks that need the text (stop strings,
        grammar, length)."""
        items = batch.items
        sampled = [s for s, _ in items] if len(result.seq_ids) == len(items) else None
        if sampled is None or any(s.seq_id != i for s, i in zip(sampled, result.seq_ids)):
            by_id = {s.seq_id: s for s, _ in items}
            sampled = [by_id[i] for i in result.seq_ids]
        tokens, logprobs = result.token_ids, result.logprobs or [None] * len(sampled)
        if batch.mark != self.removals:  # some left `running` since: keep those that did not
            running = SeqStatus.RUNNING
            kept = [i for i, s in enumerate(sampled) if s.status is running]
            if len(kept) < len(sampled):
                sampled = [sampled[i] for i in kept]
                tokens, logprobs = [tokens[i] for i in kept], [logprobs[i] for i in kept]
            live = [it for it in items if it[0].status is running]
            if len(live) < len(items):
                batch = ScheduledBatch(live, batch.preempted, sum(n for _, n in live), batch.mark)
        self.advance(batch)
        if result.routed_experts:
            by_seq = {s.seq_id: s for s, _ in batch.items}
            for seq_id, start, rows in result.routed_experts:
                if seq_id in by_seq:
                    store_routed(by_seq[seq_id], start, rows)
        if result.prompt_logprobs:
            reqs = {s.request.request_id: s.request for s, _ in batch.items}
            for rid, entries in result.prompt_logprobs:
                if rid in reqs:
                    reqs[rid].prompt_logprobs.extend(entries)  # type: ignore[union-attr]
        complete = result.grammar_done
        eos_ids, max_len, tokenizer = self.eos_ids, self.max_model_len, self.tokenizer
        now = time.monotonic()
        texts: list[Sequence] = []
        pairs: list[tuple] = []
        ended: list[Sequence] = []
        update = StepUpdate(sampled=len(sampled))
        touched, first = update.touched, update.first
        req = None
        for seq, token, lp in zip(sampled, tokens, logprobs):
            if seq.request is not req:  # a request's sequences are mostly side by side
                req = seq.request
                if req.request_id not in touched:
                    if req.first_token_time is None:
                        req.first_token_time = now
                        first.add(req.request_id)
                    req.last_token_time = now
                    touched[req.request_id] = req
            if seq.append_token(token, lp, eos_ids):
                if seq.lazy_text:  # no text before the end: only the length and grammar checks
                    seq.append_text("", max_len, seq.seq_id in complete)
                    if seq.finish_reason is not None:
                        ended.append(seq)
                    continue
                d = seq.detok or seq.detokenizer(tokenizer)
                piece = d.add_whole(token) if d.clean else None  # most tokens of a step: no decode
                if piece is not None:
                    seq.append_text(piece, max_len, seq.seq_id in complete)
                    if seq.finish_reason is not None:
                        ended.append(seq)
                    continue
                texts.append(seq)
                pairs.append((d, token))
            else:
                ended.append(seq)
        if texts:
            stopped = len(ended)
            for seq, delta in zip(texts, detokenize_step(pairs)):
                seq.append_text(delta, max_len, seq.seq_id in complete)
                if seq.finish_reason is not None:
                    ended.append(seq)
            if 0 < stopped < len(ended):  # free blocks in the batch's order, as one pass would
                order = {id(s): i for i, s in enumerate(sampled)}
                ended.sort(key=lambda s: order[id(s)])
        settle_texts(ended)  # the lazy texts of every sequence that ended here, decoded together
        for seq in ended:
            self.finish(seq)
            update.done.add(seq.request.request_id)
        return update

    def advance(self, batch: ScheduledBatch) -> None:
        """The batch ran: its new tokens have KV now, and blocks it filled join the prefix cache (part of
        update_from_output; alone for a step that sampled nothing of interest, as in benches)."""
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
