"""CUDA graphs for decode steps, captured once at start-up with their memory in the pool.

An engine concern beside the runner it replays for: one graph per batch-size bucket; a decode batch
replays the smallest bucket that holds it, padded. Padding rows write their K/V into NULL_BLOCK and
read one token, so they cost almost nothing and touch no sequence's cache. Every buffer a graph
reads or writes is pool memory under tag `cuda_graph`, so sleep backs it up, wake restores it, and
the graphs replay as captured (docs/architecture.md, invariant 2: nothing is re-captured). The one
exception: with --tp-release-comm-on-sleep the graphs that captured a tensor-parallel communicator's
collectives are destroyed with it (release) and captured again on the same buffers, stream and pool once
a new one is up (recapture, server/engine/parallel/comm_cycle.py).

A step's inputs travel in one host-to-device copy from a pinned staging buffer laid out as
[ids | positions | slots | lengths | block tables, compact]; one device copy then spreads the
tables into the graph's fixed-width table.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import torch

from server.engine.kv_cache import NULL_BLOCK
from server.wire.tags import CUDA_GRAPH
from server.model.attention import AttentionContext

if TYPE_CHECKING:
    from server.engine.host_batch import DecodeTables, HostBatch

class GraphRunner(Protocol):
    """What the graphs read of the runner that captures and replays them (runner.py's ModelRunner)."""
    pool: Any
    device: torch.device
    model: Any
    block_size: int
    split_counts: Any
    decode_tables: "DecodeTables"
    launched: float

    def to_device(self, hb: "HostBatch") -> tuple: ...


log = logging.getLogger("sleepserve.engine")

def batch_buckets(max_num_seqs: int) -> list[int]:
    """vLLM's capture ladder: 1, 2, 4, then every 8 up to 256 and every 16 beyond, ending at
    max_num_seqs: a decode batch pads at most 7 (15) rows. 35 graphs for 256; they share one logits
    buffer and the pool's graph memory, so more sizes cost capture time (~20 ms each), not memory."""
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_num_seqs, 16))
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, runner: GraphRunner, buckets: list[int]):
        self.runner = runner
        self.buckets = buckets
        pool, dev = runner.pool, runner.device
        B = self.largest = buckets[-1]
        self.width = -(-runner.model.max_positions // runner.block_size)
        # The staging area: the first 4*S entries are the graph's own ids/positions/slots/lengths, each S
        # apart: S is B rounded up to even, so each starts 16-byte aligned, as the eager path's do
        # (runner.to_device): the kernels compiled for the graphs then serve eager steps too.
        S = self.segment = B + B % 2
        self.stage = pool.empty((4 * S + B * self.width,), torch.long, CUDA_GRAPH)
        self.tables = pool.empty((B, self.width), torch.long, CUDA_GRAPH)
        self.input_ids, self.positions, self.slots, self.lens = (self.stage[i * S:i * S + B] for i in range(4))
        # What a padding row of each of ids, positions, slots, lengths holds.
        self.padding = (0, 0, NULL_BLOCK * runner.block_size, 1)
        self._reset_inputs()
        # Two pinned host buffers, used in turn, each with the event of the last copy out of it: with
        # async scheduling the next step is staged while the previous step's copy may still be queued.
        self.hosts = [torch.zeros(self.stage.shape, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Every graph writes its logits (model dtype) into the first rows of this one buffer.
        model = runner.model
        self.logits = pool.empty((B, model.config.vocab_size), model.output_weight().dtype, CUDA_GRAPH)
        self.device = dev
        self.stream = torch.cuda.Stream(dev)  # every capture's (a re-capture reuses its cuBLAS workspace's place)

    def _reset_inputs(self) -> None:
        """Every row a padding row: a warm-up forward writes its K/V into NULL_BLOCK only (a re-capture runs
        with sequences' KV in the cache: the slots the last step left here are theirs)."""
        self.stage.zero_()
        self.slots.fill_(self.padding[2])
        self.tables.fill_(NULL_BLOCK)
        self.lens.fill_(1)

    def _forward(self, batch: int) -> torch.Tensor:
        ctx = AttentionContext(slot_mapping=self.slots[:batch], num_decode_tokens=batch,
                               block_tables=self.tables[:batch], context_lens=self.lens[:batch],
                               max_decode_context=None, split_counts=self.runner.split_counts)
        model = self.runner.model
        hidden = model(self.input_ids[:batch], self.positions[:batch], ctx)
        return model.compute_logits(hidden, out=self.logits[:batch])

    @classmethod
    @torch.inference_mode()
    def capture(cls, runner: GraphRunner, max_num_seqs: int) -> "DecodeGraphs":
        t0 = time.perf_counter()
        self = cls(runner, batch_buckets(max_num_seqs))
        self._capture_all(warmups=2)
        log.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.buckets),
                 ",".join(map(str, self.buckets)), time.perf_counter() - t0)
        return self

    def _capture_all(self, warmups: int, warm_largest_only: bool = False, error_mode: str = "global") -> None:
        pool, stream = self.runner.pool, self.stream
        # Largest first: smaller graphs then reuse the memory the larger ones left in the pool.
        for batch in reversed(self.buckets):
            if not warm_largest_only or batch == self.largest:
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with pool.use(CUDA_GRAPH), torch.cuda.stream(stream):
                    for _ in range(warmups):  # warm-up: Triton compiles, cuBLAS picks its kernels
                        self._forward(batch)
                torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool.graph_pool(CUDA_GRAPH), stream=stream,
                                  capture_error_mode=error_mode):
                self._forward(batch)
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)

    def release(self) -> None:
        """Destroy the graphs (their memory stays in the pool, for the re-capture): before the communicator
        whose collectives they captured goes (NCCL's teardown waits for them). Decode runs nothing until
        recapture(): covers() is False meanwhile."""
        self.graphs.clear()
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def recapture(self) -> None:
        """Capture every bucket again into the same buffers and pool, with the communicator now in use
        (every rank at once: the warm-up runs its collectives). One warm-up, at the largest batch: kernels
        were compiled and chosen at start-up; it re-creates the capture stream's cuBLAS workspace (a sleep
        clears it) inside the pool, where the start-up's was. thread_local: the pool's background KV
        mapper (a wake's rest of the cache) may map memory on its thread meanwhile, which a global
        capture would count as an unsafe call; it enqueues nothing on the capture's stream."""
        t0 = time.perf_counter()
        self.release()
        try:
            with torch.cuda.device(self.device):  # this rank's device, whichever the calling thread has current
                self._reset_inputs()
                self._capture_all(warmups=1, warm_largest_only=True, error_mode="thread_local")
        except BaseException:
            self.release()
            raise
        log.info("re-captured %d decode CUDA graphs in %.2f s", len(self.buckets), time.perf_counter() - t0)

    def covers(self, batch: int) -> bool:
        return batch <= self.buckets[-1] and bool(self.graphs)

    def run(self, hb: "HostBatch") -> torch.Tensor:
        """Stage a decode batch, replay the graph of its bucket, return the sampled rows' logits."""
        n, S = len(hb.ids), self.segment
        turn = self.turn = 1 - self.turn
        host, copied = self.hosts[turn], self.copied[turn]
        if copied is not None:
            copied.synchronize()  # its last copy has long run in practice: the step before last
        h = host.numpy()
        bucket = next(b for b in self.buckets if b >= n)
        w = max(len(t) for t in hb.decode_tables)
        for i, values in enumerate((hb.ids, hb.positions, hb.slots, hb.decode_lens)):
            h[i * S:i * S + n] = values
            h[i * S + n:i * S + bucket] = self.padding[i]
        base = 4 * S
        # The tables, padded to width w (padding rows all NULL_BLOCK): one conversion, no copy per row.
        h[base:base + n * w].reshape(n, w)[...] = self.runner.decode_tables.padded(hb.decode_tables, w)
        h[base + n * w:base + bucket * w] = NULL_BLOCK
        used = base + bucket * w
        self.stage[:used].copy_(host[:used], non_blocking=True)
        if copied is None:
            copied = self.copied[turn] = torch.cuda.Event()
        copied.record()
        self.tables[:bucket, :w].copy_(self.stage[base:used].view(bucket, w))
        if hb.ids_from is not None:  # async scheduling: the previous step's tokens, never on the host
            self.input_ids[:n].copy_(hb.ids_from)
        self.runner.launched = time.perf_counter()
        self.graphs[bucket].replay()
        # In the model's dtype: the sampler converts them only where it needs float32 (sample_on_device).
        return self.logits[:n] if len(hb.sample_rows) == n else self.logits[hb.sample_rows]
