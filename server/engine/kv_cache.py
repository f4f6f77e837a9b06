"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, and a prefix cache.

A block that is full of computed tokens is registered under a hash chained over its tokens and
all tokens before it, so a later request with the same prefix reuses it instead of recomputing.
Free blocks keep their hash until they are handed out again, least recently freed first.
The manager only hands out blocks; the scheduler says how many tokens a sequence holds
(Sequence.num_computed has one writer: server/engine/scheduler.py).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from server.engine.sequence import Sequence


class Residency(Protocol):
    """Which blocks have memory behind them (server/engine/memory_plan.py: KVChunks). After a wake,
    the cache's memory comes back in chunks of blocks, in order, in the background."""

    def mapped_blocks(self) -> int: ...  # blocks [0, n) are mapped

    def wait_for_more(self) -> bool: ...  # block until n grows; False when it will not

# Never handed out: padded rows of a CUDA-graph batch and the padding of block tables point here,
# so they write and read harmlessly.
NULL_BLOCK = 0


def usable_blocks(num_blocks: int) -> int:
    """Blocks a cache of num_blocks can hand out: all but NULL_BLOCK."""
    return num_blocks - 1


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.block_of: dict[bytes, int] = {}
        # Free blocks come in two kinds. Blocks [fresh, mapped) were never handed out since their
        # memory came (at start-up, or since the wake that mapped them): no hash, no order to keep,
        # so they are a range, and a chunk of 150k blocks joining or a discarded cache leaving costs
        # O(1) instead of a Python loop over every block (~35-70 ms on the first step after a wake of
        # a 117 GiB cache). Blocks handed out and released since wait in `free`, whose insertion order
        # is eviction order (the front is handed out first); fresh blocks go before them, so a cached
        # prefix lives as long as possible.
        self.free: OrderedDict[int, None] = OrderedDict()
        self.fresh = NULL_BLOCK + 1
        self.stats = PrefixCacheStats()
        # Blocks [0, mapped) have memory; only they are ever handed out. Without a residency every
        # block always has.
        self.mapped = num_blocks
        self.residency: Residency | None = None

    @property
    def num_free(self) -> int:
        return len(self.free) + max(0, self.mapped - self.fresh)

    @property
    def num_used(self) -> int:
        return max(0, usable_blocks(self.mapped)) - self.num_free

    # -- memory behind the blocks (a KV cache mapped back in chunks after a wake) ---------------

    def sync_mapped(self) -> None:
        """Follow the residency: blocks that got memory become free (fresh); blocks that lost it (a
        sleep discarded the cache, which frees every block first) leave the free list."""
        if self.residency is None:
            return
        n = self.residency.mapped_blocks()
        if n < self.mapped:
            if self.num_used == 0:
                # The cache was discarded whole (a sleep releases every chunk): whatever the blocks
                # below n held is gone too, so every block starts fresh, with no hash.
                self.free.clear()
                self.fresh = NULL_BLOCK + 1
                self.reset_prefix_cache()
            else:
                held = [b for b in range(max(n, NULL_BLOCK + 1), self.mapped) if self.ref_count[b]]
                if held:
                    raise RuntimeError(f"KV blocks {held[:8]} are in use but their memory was released; "
                                       "the cache must be emptied before a sleep discards it")
                for b in [b for b in self.free if b >= n]:
                    del self.free[b]
                    self._forget(b)
                # Blocks [n, fresh) were handed out once: forget them, so they come back fresh.
                for b in range(max(n, NULL_BLOCK + 1), self.fresh):
                    self._forget(b)
                self.fresh = min(self.fresh, max(n, NULL_BLOCK + 1))
        self.mapped = n  # growing: blocks [old mapped, n) extend the fresh range

    def _room(self, needed: int) -> bool:
        """Whether `needed` blocks are free, waiting for chunks still being mapped rather than
        answering no: a request then waits a few milliseconds instead of being preempted."""
        self.sync_mapped()
        while needed > self.num_free and self.residency is not None and self.mapped < self.num_blocks:
            if not self.residency.wait_for_more():
                break
            self.sync_mapped()
        return needed <= self.num_free

    def _forget(self, block: int) -> None:
        h = self.hash_of[block]
        if h is not None:
            if self.block_of.get(h) == block:
                del self.block_of[h]
            self.hash_of[block] = None

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks seq lacks to hold the KV of num_tokens tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- prefix cache --------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq's tokens. At least one token is always left to
        compute, since the last prompt token's logits are what the first sample needs. A request
        that still needs prompt log-probs reuses nothing: they come from computing every position."""
        if (not self.enable_prefix_caching or seq.request.prompt_logprobs_pending
                or seq.params.return_routed_experts):  # a hit's routed experts were never recorded
            seq.block_hashes = []
            return []
        bs = self.block_size
        usable = (seq.num_tokens - 1) // bs
        hits: list[int] = []
        parent = b""
        hashes: list[bytes] = []
        for i in range(usable):
            h = block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            block = self.block_of.get(h)
            if block is None:
                break
            hits.append(block)
            hashes.append(h)
            parent = h
        seq.block_hashes = hashes
        return hits

    def reset_prefix_cache(self) -> None:
        """Forget every hash, so nothing computed before now is ever reused (after a KV discard
        or a weight update). Blocks in use stay in use."""
        self.block_of.clear()
        self.hash_of = [None] * self.num_blocks

    # -- allocation ----------------------------------------------------------------------------

    def _take(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def _pop_free(self) -> int:
        if self.fresh < self.mapped:
            block = self.fresh
            self.fresh += 1
        else:
            block, _ = self.free.popitem(last=False)
        self._forget(block)
        self.ref_count[block] = 1
        return block

    def admit(self, seq: Sequence, cached: list[int], num_tokens: int) -> bool:
        """Give a waiting sequence its cached prefix blocks plus room for num_tokens tokens in all.
        False (nothing taken) when the free blocks do not suffice."""
        for b in cached:  # take the hits first, so allocating fresh blocks cannot evict them
            self._take(b)
        seq.block_table = list(cached)
        if not self._room(self.blocks_needed(seq, num_tokens)):
            self.release(seq)
            return False
        self.grow(seq, num_tokens)
        if self.enable_prefix_caching:
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += len(cached) * self.block_size
        return True

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self._room(self.blocks_needed(seq, num_tokens))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Add blocks until seq can hold num_tokens tokens."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._pop_free())

    def release(self, seq: Sequence) -> None:
        """Drop a sequence's blocks. Its last blocks are queued for eviction first: a prefix shared
        with others is worth more than a tail only this sequence had."""
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0 and block < self.mapped:
                self.free[block] = None
        seq.block_table = []
        seq.block_hashes = []

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed tokens, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed // bs
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else b""
            h = block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.block_of and self.hash_of[block] is None:
                self.block_of[h] = block
                self.hash_of[block] = h
