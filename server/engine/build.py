"""build_engine(config): read the model, make the pool, load the weights, size the KV cache, and hand
the parts to EngineCore. Every check that can fail on a bad flag fails here, before anything serves."""
from __future__ import annotations

import logging
import time

import torch

from allocator import create_pool
from server.config import EngineConfig
from server.engine.core import EngineCore
from server.engine.kv_cache import BlockManager
from server.engine.memory_plan import KVChunks, plan_kv_cache
from server.engine.sleep_plan import OFFLOADED_TAGS
from server.engine.tags import KV_CACHE, WEIGHTS
from server.engine.runner import ModelRunner
from server.engine.scheduler import Scheduler
from server.model.config import ModelConfig
from server.model.loader import build_model, init_dummy_weights, load_checkpoint, resolve_model
from server.model.tokenizer import load_tokenizer

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


def build_engine(config: EngineConfig) -> EngineCore:
    device = config.torch_device()
    source = resolve_model(config.model)
    model_config = ModelConfig.from_folder(source.folder)
    dtype = config.torch_dtype(device, model_config.torch_dtype)
    tokenizer = load_tokenizer(source.folder)
    torch.manual_seed(config.seed)
    positions = position_limit(config, model_config)

    pool = create_pool(device, backup_dir=config.offload_dir)
    t0 = time.perf_counter()
    model = build_model(model_config, pool, dtype, positions)
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
    if config.max_model_len and config.max_model_len > plan.capacity_tokens:
        raise ValueError(
            f"the KV cache holds {plan.capacity_tokens} tokens, fewer than --max-model-len {config.max_model_len}; "
            "give it more memory (--kv-cache-memory / --gpu-memory-utilization) or lower --max-model-len")
    runner = ModelRunner(model, pool, plan.num_blocks, config.block_size, dtype, plan.chunk_bounds)
    blocks = BlockManager(plan.num_blocks, config.block_size, config.enable_prefix_caching)
    if runner.kv_chunked:
        blocks.residency = KVChunks(pool, KV_CACHE, plan.chunk_bounds)
    scheduler = Scheduler(blocks, config.max_num_seqs, config.batched_tokens(device))
    runner.finish_setup(enforce_eager=config.enforce_eager, max_num_seqs=config.max_num_seqs)
    if config.enable_sleep_mode and config.prepare_backups != "off":
        prepare_backups(pool, config.prepare_backups == "auto")
    return EngineCore(
        config=config, device=device, dtype=dtype, model_path=source.folder, model_config=model_config,
        served_model_name=config.served_model_name or source.name, tokenizer=tokenizer, pool=pool, model=model,
        runner=runner, blocks=blocks, scheduler=scheduler, kv_plan=plan,
        max_model_len=min(positions, plan.capacity_tokens), load_seconds=load_seconds,
        weight_version=weight_version)
