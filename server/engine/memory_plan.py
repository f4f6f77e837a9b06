"""How many KV-cache blocks to allocate.

CPU: --kv-cache-memory, 1 GiB by default (pages are only committed as blocks get used).
CUDA: --kv-cache-memory, or what --gpu-memory-utilization leaves after the weights, the peak
activations of a largest-batch forward (measured, not guessed) and a reserve for CUDA graphs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from server.config import EngineConfig
from server.engine.kv_cache import usable_blocks
from server.model.config import ModelConfig
from server.model.llama import LlamaForCausalLM

log = logging.getLogger("sleepserve.engine")

CPU_DEFAULT_KV_BYTES = 1 << 30
GRAPH_RESERVE_BYTES = 512 << 20


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for block_size tokens."""
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int          # including the reserved NULL_BLOCK
    block_size: int
    bytes: int
    bytes_per_block: int
    activation_peak: int = 0

    @property
    def usable_blocks(self) -> int:
        return usable_blocks(self.num_blocks)

    @property
    def capacity_tokens(self) -> int:
        return self.usable_blocks * self.block_size


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

        peak = measure_activation_peak(model, config.batched_tokens(device), config.block_size, dtype)
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
    log.debug("KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens)", plan.usable_blocks, config.block_size,
             plan.bytes / 2**30, plan.capacity_tokens)
    return plan
