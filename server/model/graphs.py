"""CUDA graphs for decode steps, captured once at start-up with their memory in the pool.

One graph per batch-size bucket; a decode batch replays the smallest bucket that holds it, padded.
Padding rows write their K/V into the null block (slot 0) and read one token, so they cost almost
nothing and touch no sequence's cache. Every buffer a graph reads or writes is pool memory under
tag `cuda_graph`, so sleep backs it up, wake restores it, and the graphs replay as captured
(DESIGN.md invariant 2: nothing is re-captured).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from server.model.attention import AttentionContext

if TYPE_CHECKING:
    from server.engine.runner import ModelRunner, StepInputs

log = logging.getLogger("sleepserve.engine")

GRAPH_TAG = "cuda_graph"
_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [b for b in _BUCKETS if b < max_num_seqs]
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, runner: "ModelRunner", buckets: list[int]):
        self.runner = runner
        self.buckets = buckets
        pool, dev = runner.pool, runner.device
        largest = buckets[-1]
        width = -(-runner.model.max_positions // runner.block_size)
        self.input_ids = pool.empty((largest,), torch.long, GRAPH_TAG)
        self.positions = pool.empty((largest,), torch.long, GRAPH_TAG)
        self.slots = pool.empty((largest,), torch.long, GRAPH_TAG)
        self.tables = pool.empty((largest, width), torch.int32, GRAPH_TAG)
        self.lens = pool.empty((largest,), torch.int32, GRAPH_TAG)
        for t in (self.input_ids, self.positions, self.slots, self.tables):
            t.zero_()
        self.lens.fill_(1)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.device = dev

    def _forward(self, batch: int) -> torch.Tensor:
        ctx = AttentionContext(slot_mapping=self.slots[:batch], num_decode_tokens=batch,
                               block_tables=self.tables[:batch], context_lens=self.lens[:batch],
                               max_decode_context=None)
        model = self.runner.model
        return model.compute_logits(model(self.input_ids[:batch], self.positions[:batch], ctx))

    @classmethod
    @torch.inference_mode()
    def capture(cls, runner: "ModelRunner", max_num_seqs: int) -> "DecodeGraphs":
        t0 = time.perf_counter()
        self = cls(runner, batch_buckets(max_num_seqs))
        pool = runner.pool
        stream = torch.cuda.Stream(self.device)
        # Largest first: smaller graphs then reuse the memory the larger ones left in the pool.
        for batch in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with pool.use(GRAPH_TAG), torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                    self._forward(batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool.graph_pool(GRAPH_TAG), stream=stream):
                self.logits[batch] = self._forward(batch)
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.buckets),
                 ",".join(map(str, self.buckets)), time.perf_counter() - t0)
        return self

    def covers(self, batch: int) -> bool:
        return batch <= self.buckets[-1]

    def replay(self, inputs: "StepInputs") -> torch.Tensor:
        n = inputs.input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= n)
        ctx = inputs.ctx
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slots[:n].copy_(ctx.slot_mapping)
        self.lens[:n].copy_(ctx.context_lens)
        self.tables[:n, : ctx.block_tables.shape[1]].copy_(ctx.block_tables)
        if bucket > n:
            self.slots[n:bucket].zero_()
            self.lens[n:bucket].fill_(1)
        self.graphs[bucket].replay()
        return self.logits[bucket][inputs.sample_index]
