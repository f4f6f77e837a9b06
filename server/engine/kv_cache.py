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

from server.engine.sequence import Sequence

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
        # Insertion order is eviction order: the front is handed out first.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks) if b != NULL_BLOCK)
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return usable_blocks(self.num_blocks) - len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks seq lacks to hold the KV of num_tokens tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- prefix cache --------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq's tokens. At least one token is always left to
        compute, since the last prompt token's logits are what the first sample needs. A request
        that still needs prompt log-probs reuses nothing: they come from computing every position."""
        if not self.enable_prefix_caching or seq.request.prompt_logprobs_pending:
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
        block, _ = self.free.popitem(last=False)
        h = self.hash_of[block]
        if h is not None:
            if self.block_of.get(h) == block:
                del self.block_of[h]
            self.hash_of[block] = None
        self.ref_count[block] = 1
        return block

    def admit(self, seq: Sequence, cached: list[int], num_tokens: int) -> bool:
        """Give a waiting sequence its cached prefix blocks plus room for num_tokens tokens in all.
        False (nothing taken) when the free blocks do not suffice."""
        for b in cached:  # take the hits first, so allocating fresh blocks cannot evict them
            self._take(b)
        seq.block_table = list(cached)
        if self.blocks_needed(seq, num_tokens) > self.num_free:
            self.release(seq)
            return False
        self.grow(seq, num_tokens)
        if self.enable_prefix_caching:
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += len(cached) * self.block_size
        return True

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Add blocks until seq can hold num_tokens tokens."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._pop_free())

    def release(self, seq: Sequence) -> None:
        """Drop a sequence's blocks. Its last blocks are queued for eviction first: a prefix shared
        with others is worth more than a tail only this sequence had."""
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
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
