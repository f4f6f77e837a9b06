"""How many KV-cache blocks to allocate.

CPU: --kv-cache-memory, 1 GiB by default (pages are only committed as blocks get used).
CUDA: --kv-cache-memory, or what --gpu-memory-utilization leaves after the weights, the peak
activations of a largest-batch forward (measured, not guessed) and a reserve for CUDA graphs.
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch

from allocator import PoolError
from server.config import EngineConfig
from server.wire.stats import KVPlan
from server.model.config import ModelConfig
from server.model.llama import LlamaForCausalLM

log = logging.getLogger("sleepserve.engine")

CPU_DEFAULT_KV_BYTES = 1 << 30
GRAPH_RESERVE_BYTES = 512 << 20


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for block_size tokens."""
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


# Each chunk after the first is this many times the previous one: a wake costs the first chunk only,
# while the number of chunks (one driver handle each, which every sleep releases) stays small:
# 120 GiB with a 2 GiB first chunk is 4 chunks.
CHUNK_GROWTH = 4


def chunk_bounds(num_blocks: int, first_blocks: int, step: int) -> tuple[int, ...]:
    """(0, b1, ..., num_blocks): a first chunk of first_blocks, each next CHUNK_GROWTH times the
    previous, every bound a multiple of step; () when that makes a single chunk."""
    bounds, size = [0], max(step, -(-first_blocks // step) * step)
    while bounds[-1] + size < num_blocks:
        bounds.append(bounds[-1] + size)
        size *= CHUNK_GROWTH
    bounds.append(num_blocks)
    return tuple(bounds) if len(bounds) > 2 else ()


def chunk_plan(plan: KVPlan, granularity: int, first_chunk_bytes: int) -> KVPlan:
    """The plan with its cache split in chunks for lazy wake-up (KVPlan.chunk_bounds). The cache is
    block-major (model/kv_layout.py), so a chunk of blocks is one contiguous range, which must start
    and end on the pool's granularity: the block count drops to a multiple of `step` blocks (by less
    than one granule; step is 1 when a block's bytes, every layer's K and V, are a multiple of it)."""
    if first_chunk_bytes <= 0:
        return plan
    step = granularity // math.gcd(granularity, plan.bytes_per_block)
    num_blocks = plan.num_blocks // step * step
    if num_blocks < 2:
        return plan
    bounds = chunk_bounds(num_blocks, -(-first_chunk_bytes // plan.bytes_per_block), step)
    if not bounds:
        return plan
    return replace(plan, num_blocks=num_blocks, bytes=num_blocks * plan.bytes_per_block, chunk_bounds=bounds)


def plan_kv_cache(config: EngineConfig, model: LlamaForCausalLM, pool, dtype: torch.dtype) -> KVPlan:
    per_block = kv_bytes_per_block(model.config, config.block_size, dtype)
    device = pool.device
    peak = 0
    if config.kv_cache_memory:
        budget = int(config.kv_cache_memory)
    elif device.type == "cpu":
        budget = CPU_DEFAULT_KV_BYTES
    else:
        from server.engine.profile import measure_activation_peak

        peak = measure_activation_peak(model, config.batched_tokens(device), config.block_size, dtype,
                                       num_logit_rows=config.max_num_seqs)
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * config.gpu_memory_utilization) - used - peak - GRAPH_RESERVE_BYTES
        if budget < 16 * per_block:
            raise ValueError(
                f"only {budget / 2**30:.2f} GiB would be left for the KV cache at --gpu-memory-utilization "
                f"{config.gpu_memory_utilization} ({used / 2**30:.1f} GiB in use, {peak / 2**30:.2f} GiB activation "
                "peak); raise --gpu-memory-utilization or lower --max-num-batched-tokens")
    num_blocks = max(2, budget // per_block + 1)
    plan = KVPlan(num_blocks, config.block_size, (num_blocks) * per_block, per_block, peak)
    if config.enable_sleep_mode and config.kv_wake_chunk:
        try:
            granularity = pool.granularity
        except PoolError as err:
            log.warning("no chunked KV cache (%s): a wake will map all of it", err)
        else:
            plan = chunk_plan(plan, granularity, int(config.kv_wake_chunk))
    log.debug("KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens, %d chunks)", plan.usable_blocks,
              config.block_size, plan.bytes / 2**30, plan.capacity_tokens, max(1, len(plan.chunk_bounds) - 1))
    return plan


class KVChunks:
    """What the block manager asks about a chunked KV cache: how many blocks are mapped now, and to
    wait for more (the pool maps the chunks in order in the background after a wake)."""

    def __init__(self, pool, tag: str, bounds: tuple[int, ...]):
        self.pool, self.tag, self.bounds = pool, tag, bounds

    def mapped_blocks(self) -> int:
        return self.bounds[self.pool.chunks_ready(self.tag)]

    def wait_for_more(self) -> bool:
        """Block until another chunk is mapped; False at once when none is coming."""
        ready = self.pool.chunks_ready(self.tag)
        if ready == 0 or ready >= len(self.bounds) - 1:
            return False
        return self.pool.wait_chunks(self.tag, ready + 1) > ready
