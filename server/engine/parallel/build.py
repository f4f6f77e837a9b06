"""Tensor parallelism's start: the workers, rank 0 built beside them, the pool that sleeps every rank."""
from __future__ import annotations

import logging
import os

from server.config import EngineConfig
from server.engine.parallel.executor import Workers, check_layout
from server.engine.parallel.group import comm_options
from server.engine.parallel.pool import ParallelPool
from server.engine.parallel.runner import ParallelRunner
from server.engine.rank import build_rank
from server.model.config import ModelConfig
from server.model.source import ModelSource
from server.model.shard import TensorParallel

log = logging.getLogger("sleepserve.engine")


def build_parallel(config: EngineConfig, source: ModelSource, model_config: ModelConfig):
    """Start the workers and build rank 0 beside them. Returns (rank 0's RankParts, the ParallelPool)."""
    check_layout(config, model_config)
    world = config.tensor_parallel_size
    tp = TensorParallel(model_config, 0, world)
    workers = Workers(config, world, tp)
    try:
        workers.wait_ready()  # every worker read the model's config and is about to join
        workers.group.start(**comm_options(config, model_config, workers.group.device))
        parts = build_rank(config, source, model_config, tp, runner_class=ParallelRunner, workers=workers)
        infos = workers.infos = workers.wait_ready()
    except BaseException as e:
        lost = workers.lost
        workers.close()
        if lost is not None and not isinstance(e, ValueError):
            raise ValueError(f"tensor parallelism could not start: {lost}") from e
        raise
    log.info("tensor parallelism: %d ranks (%s); rank 0 is pid %d", world,
             ", ".join(f"rank {i['rank']} pid {i['pid']} on {i['device']}" for i in infos), os.getpid())
    suspend = config.tp_comm_suspend != "off" and workers.group.suspendable
    if workers.group.device.type == "cuda":
        from server.engine.parallel.comm_cycle import suspend_support

        log.info("device communicator while asleep: %s", suspend_support(config.tp_comm_suspend,
                                                                        config.tp_release_comm_on_sleep))
    return parts, ParallelPool(parts.pool, workers, parts.runner, release_comm=config.tp_release_comm_on_sleep,
                               suspend_comm=suspend)
