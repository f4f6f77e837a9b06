"""Rank 0's runner with tensor parallelism: the ModelRunner the engine core calls, which also sends
each step's inputs to every worker (they run the same forward; the collectives join the ranks) and
loads weights on every rank. Sampling stays on rank 0.

Async scheduling (core.py): step t+1 is launched before step t's tokens reach rank 0's host, so the
workers cannot get its input ids over the pipe. Rank 0 broadcasts the tokens it sampled in step t on the
device communicator, queued right after its sampling; each worker queues the same broadcast right after
its forward of step t, into a small buffer, and step t+1 (its plan sent over the pipe, with which rows of
t continue) reads its ids from there, as rank 0 reads its own. Every rank issues the same collectives
in the same stream order, and nothing waits on the host: the broadcast is one kernel of a few hundred
bytes. The other way, every rank sampling alike from all-gathered logits, was not taken: sampling reads
state only rank 0 holds (each seeded sequence's torch.Generator, advanced once per token; grammar
matchers; the history penalties read; the log-prob rows; n > 1's rows of one request), all of which
would have to be mirrored and kept in step on every worker. With the broadcast, whatever rank 0 samples
(seeded, structured, n > 1, with log-probs) is by construction what every rank feeds on.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch

from server.engine.parallel.executor import Workers
from server.engine.parallel.steps import StepLag, pack_step
from server.engine.parallel.worker import drop_graphs
from server.engine.host_batch import HostBatch
from server.engine.runner import Launched, ModelRunner
from server.engine.scheduler import ScheduledBatch
from server.model.shard import TensorParallel


class ParallelRunner(ModelRunner):
    supports_async = True  # the sampled tokens reach the workers on the device (the module's docstring)

    def __init__(self, model, pool, num_blocks: int, block_size: int, dtype: torch.dtype,
                 kv_chunk_bounds: tuple[int, ...] = (), *, workers: Workers):
        self._feeds_next = False  # inside a launch() whose tokens feed the next step (it broadcasts them)
        self._shared: int | None = None  # the tokens that launch() owes the workers' broadcast, once forward sent it
        super().__init__(model, pool, num_blocks, block_size, dtype, kv_chunk_bounds)
        self.workers = workers
        self.lag = StepLag()
        workers.before_down.append(lambda: drop_graphs(self))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, eos_ids: frozenset[int], tokenizer, after: Launched | None = None,
               rows: list[int] | None = None, feeds_next: bool = True) -> Launched:
        self._feeds_next, self._shared = feeds_next, None
        try:
            launched = super().launch(batch, eos_ids, tokenizer, after, rows, feeds_next)
        except BaseException:
            if self._shared is not None:
                # The workers were told this step broadcasts (forward sent it) and will wait in that broadcast:
                # join it with placeholders so every rank's collectives stay paired. Nothing reads them: a
                # failed launch leaves nothing in flight, so no step follows this one on the device.
                self._broadcast(torch.zeros(self._shared, dtype=torch.long, device=self.device))
            raise
        finally:
            self._feeds_next = False
        if self._shared is not None:
            assert launched.sampled is not None  # rank 0 samples exactly when the batch has rows to sample
            self._broadcast(launched.sampled.tokens)
        return launched

    def _broadcast(self, tokens: torch.Tensor) -> None:
        comm = self.workers.group.comm
        try:
            if comm is None:
                raise RuntimeError("the device communicator is down")
            comm.broadcast(tokens)
        except Exception as e:
            raise self.workers.explain(e) from e

    @torch.inference_mode()
    def forward(self, hb: HostBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        # rank 0 samples (and then broadcasts) exactly when the batch has rows to sample (launch())
        share = self._feeds_next and bool(hb.sample_rows)
        packed = pack_step(hb, share)
        self.workers.send_all("step", packed)
        if share:
            self._shared = len(hb.sample_rows)  # from here on, the workers will wait in the broadcast
        try:
            out = super().forward(hb)
        except Exception as e:  # a collective that failed because a rank died says so
            raise self.workers.explain(e) from e
        if hb.decode_only:
            self.lag.add(packed[0], self.launched, self.replayed)
        return out

    def step_lag(self) -> dict[int, dict]:
        """Each rank's StepLag summary since the last call (steps.py): how long after rank 0 sent a
        decode step each rank launched its graph (and, on workers, received the step)."""
        lags = {0: self.lag.take()}
        for rank in self.workers.conns:
            lags[rank] = self.workers.send_one(rank, "step_lag")
        return lags

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Whole tensors (in rank 0's memory): each worker gets its slices (CPU tensors travel through
        shared memory, not the pipe)."""
        named = list(named)
        full = self.model.tp.full_config
        args = {}
        for rank in self.workers.conns:
            tp = TensorParallel(full, rank, self.workers.world)
            parts = []
            for name, t in named:
                shard = tp.shard(name)
                part = t if shard is None else shard.take(t)
                parts.append((name, part.detach().to("cpu").contiguous()))
            args[rank] = parts
        return self.workers.run_all("load_sliced", None, lambda: super(ParallelRunner, self).load_weights(named),
                                    args=args)

    def load_files(self, files: list[Path]) -> set[str]:
        return self.workers.run_all("load_files", files, lambda: super(ParallelRunner, self).load_files(files))

    def load_dummy(self, seed: int) -> set[str]:
        return self.workers.run_all("load_dummy", seed, lambda: super(ParallelRunner, self).load_dummy(seed))

    def ranks(self) -> list[dict]:
        own = [{**r, "all_reduce": self.workers.group.all_reduce_name} for r in super().ranks()]
        return own + self.workers.infos

    def watch(self, on_lost: Callable[[BaseException], None]) -> None:
        self.workers.listeners.append(on_lost)


__all__ = ["ParallelRunner"]
