"""build_engine(config): read the model, build rank 0 (and the other ranks under tensor parallelism),
size the scheduler, and hand the parts to EngineCore."""
from __future__ import annotations

from server.config import EngineConfig
from server.engine.core import EngineCore
from server.engine.kv_cache import BlockManager
from server.engine.memory_plan import KVChunks
from server.engine.rank import build_rank, position_limit
from server.engine.sampler import warm_pieces
from server.engine.scheduler import Scheduler
from server.model.config import ModelConfig
from server.model.source import resolve_model
from server.model.shard import TensorParallel
from server.model.tokenizer import load_tokenizer
from server.wire.tags import KV_CACHE


def build_engine(config: EngineConfig) -> EngineCore:
    source = resolve_model(config.model)
    model_config = ModelConfig.from_folder(source.folder)
    tokenizer = load_tokenizer(source.folder)
    positions = position_limit(config, model_config)
    if config.tensor_parallel_size > 1:
        from server.engine.parallel.build import build_parallel

        parts, pool = build_parallel(config, source, model_config)
    else:
        parts = build_rank(config, source, model_config, TensorParallel(model_config))
        pool = parts.pool
    plan = parts.plan
    blocks = BlockManager(plan.num_blocks, config.block_size, config.enable_prefix_caching)
    if parts.runner.kv_chunked:
        blocks.residency = KVChunks(parts.pool, KV_CACHE, plan.chunk_bounds)
    max_model_len = min(positions, plan.capacity_tokens)
    eos_ids = frozenset(model_config.eos_token_ids) | frozenset(
        [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    scheduler = Scheduler(blocks, config.max_num_seqs, config.batched_tokens(parts.pool.device),
                          max_model_len=max_model_len, eos_ids=eos_ids, tokenizer=tokenizer)
    if parts.runner.kv_chunked:
        # After a wake, the rest of the KV cache maps in the background, but only while no request
        # runs, or at full speed when the scheduler waits for blocks (MemoryPool.yield_mapping_while).
        parts.pool.yield_mapping_while(lambda: scheduler.has_work)
    warm_pieces(tokenizer, model_config.vocab_size)
    return EngineCore(
        config=config, device=parts.pool.device, dtype=parts.runner.dtype, model_path=source.folder,
        model_config=model_config, served_model_name=config.served_model_name or source.name, tokenizer=tokenizer,
        pool=pool, model=parts.model, runner=parts.runner, blocks=blocks, scheduler=scheduler, kv_plan=plan,
        max_model_len=max_model_len, load_seconds=parts.load_seconds,
        weight_version=parts.weight_version)
