"""What every rank builds (rank 0 in the engine process, the others in their worker processes:
server/engine/parallel/): its device, the pool, the model with its weights, the runner and the KV plan.
Every check that can fail on a bad flag fails here, before anything serves."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace

import torch

from allocator import MemoryPool, create_pool
from server.config import EngineConfig
from server.engine.memory_plan import plan_kv_cache
from server.wire.stats import KVPlan
from server.engine.sleep_plan import OFFLOADED_TAGS
from server.wire.tags import WEIGHTS
from server.engine.runner import ModelRunner
from server.model.config import ModelConfig
from server.model.llama import LlamaForCausalLM
from server.model.loader import build_model, init_dummy_weights, load_checkpoint
from server.model.source import ModelSource
from server.model.shard import TensorParallel

log = logging.getLogger("sleepserve.engine")


def position_limit(config: EngineConfig, model_config: ModelConfig) -> int:
    """Positions the model can take: its own limit (or sliding window), or --max-model-len below it."""
    limit = model_config.max_position_embeddings
    if model_config.sliding_window:
        limit = min(limit, model_config.sliding_window)
    if config.max_model_len and config.max_model_len > limit:
        raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's {limit} positions")
    return config.max_model_len or limit


def prepare_backups(pool, only_if_room: bool) -> None:
    """Pin the host backups of level 1 in the background, once every tag they cover exists (graphs
    are captured), so the server is ready at once and its first sleep only copies."""
    nbytes = pool.prepare_backups(OFFLOADED_TAGS, only_if_room=only_if_room)
    if nbytes:
        log.info("preparing %.2f GiB of host backups for level-1 sleep in the background", nbytes / 2**30)
    elif only_if_room:
        log.info("host backups are not prepared at start-up: they would take more than half of the free host "
                 "memory (or offload-folder space); the first level-1 sleep allocates them "
                 "(--prepare-backups on forces it)")


@dataclass
class RankParts:
    """What one rank builds: its pool, its (shard of the) model, its KV cache and runner."""
    pool: MemoryPool
    model: LlamaForCausalLM
    runner: ModelRunner
    plan: KVPlan
    load_seconds: float
    weight_version: str


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r of a tensor-parallel group drives the r-th GPU after the one --device names; under
    torchrun (ranks on several hosts) the LOCAL_RANK-th, torchrun's number for it on its host."""
    device = config.torch_device()
    offset = int(os.environ.get("LOCAL_RANK", rank)) if config.tp_launch == "torchrun" else rank
    if device.type == "cuda" and offset:
        device = torch.device("cuda", (device.index or 0) + offset)
    return device


def build_rank(config: EngineConfig, source: ModelSource, model_config: ModelConfig, tp: TensorParallel,
               runner_class: type[ModelRunner] = ModelRunner, **runner_args) -> RankParts:
    """Pool, model (this rank's shard), weights, KV plan and runner. Every rank of a tensor-parallel
    group runs this in step: the memory plan and the CUDA-graph capture run collectives."""
    if tp.enabled and config.kv_wake_chunk:
        # A KV cache mapped chunk by chunk after a wake is one rank's residency; the ranks' chunks would
        # differ (their KV heads do): with tensor parallelism a wake maps the whole cache on every rank.
        config = replace(config, kv_wake_chunk=0)
    device = rank_device(config, tp.rank)
    # Plain "cuda" (no index) is the current device already; set_device refuses it.
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    dtype = config.torch_dtype(device, model_config.torch_dtype)
    torch.manual_seed(config.seed)
    positions = position_limit(config, model_config)
    pool = create_pool(device, backup_dir=config.offload_dir)
    t0 = time.perf_counter()
    model = build_model(model_config, pool, dtype, positions, tp)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
        weight_version = "dummy"
    else:
        load_checkpoint(model, source.folder)
        weight_version = "initial"
    load_seconds = time.perf_counter() - t0
    if config.enable_sleep_mode:
        pool.check_backup_space([WEIGHTS])  # level 1 offloads them: say now if they cannot fit

    plan = plan_kv_cache(config, model, pool, dtype)
    if tp.enabled:  # one block manager (rank 0's) indexes every rank's cache: all hold the fewest blocks
        plan = replace(plan, num_blocks=tp.min(plan.num_blocks))
    if config.max_model_len and config.max_model_len > plan.capacity_tokens:
        raise ValueError(
            f"the KV cache holds {plan.capacity_tokens} tokens, fewer than --max-model-len {config.max_model_len}; "
            "give it more memory (--kv-cache-memory / --gpu-memory-utilization) or lower --max-model-len")
    runner = runner_class(model, pool, plan.num_blocks, config.block_size, dtype, plan.chunk_bounds, **runner_args)
    runner.check_finite = config.check_weights_finite
    if config.enable_return_routed_experts and tp.rank == 0:  # the router is whole on every rank: rank 0's ids
        runner.enable_routed_experts(max(config.batched_tokens(device), config.max_num_seqs))
    tp.ordered_reduce = bool(config.batch_invariant)
    runner.finish_setup(enforce_eager=config.enforce_eager, max_num_seqs=config.max_num_seqs,
                        batch_invariant=bool(config.batch_invariant), max_step_tokens=config.batched_tokens(device))
    if config.enable_sleep_mode and config.prepare_backups != "off":
        prepare_backups(pool, config.prepare_backups == "auto")
    return RankParts(pool, model, runner, plan, load_seconds, weight_version)
