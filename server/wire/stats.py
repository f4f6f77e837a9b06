"""What the engine reports about itself: its load (EngineStats, in every frame) and the KV cache's size
(KVPlan, once at start-up). Plain values: the API process reads them without importing the engine."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    preemptions: int


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int          # including the reserved null block (block 0), which is never handed out
    block_size: int
    bytes: int
    bytes_per_block: int
    activation_peak: int = 0
    # Block indices where the cache's memory chunks start and end (0, ..., num_blocks), or () for
    # one piece: after a sleep, a wake maps the first chunk and the rest follow in the background.
    chunk_bounds: tuple[int, ...] = ()

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def capacity_tokens(self) -> int:
        return self.usable_blocks * self.block_size


__all__ = ["EngineStats", "KVPlan"]
