"""Runs the model on a scheduled batch: builds the flat inputs, calls the model, samples.

Owns the model, its KV-cache tensor and the tokenizer-independent compute. Memory comes from the
pool only (weights under `weights`, the cache under `kv_cache`); the runner never frees or moves it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from server.engine.outputs import TokenLogprobs
from server.engine.sampler import sample
from server.engine.scheduler import ScheduledBatch
from server.engine.sequence import Sequence
from server.model.attention import AttentionContext, PrefillSpan
from server.model.config import ModelConfig
from server.model.llama import LlamaForCausalLM

log = logging.getLogger("sleepserve.engine")

KV_TAG = "kv_cache"


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: AttentionContext
    sample_index: torch.Tensor       # rows of the flat batch whose logits are sampled
    sample_seqs: list[Sequence]
    decode_only: bool


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool, num_blocks: int, block_size: int, dtype: torch.dtype):
        self.model = model
        self.cfg = model.config
        self.pool = pool
        self.device = pool.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        c = self.cfg
        # One tensor for the whole cache: one pool allocation, sliced into per-layer K and V views.
        self.kv_cache = pool.empty((c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim),
                                   dtype, KV_TAG)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = self.kv_cache[i, 0]
            layer.self_attn.v_cache = self.kv_cache[i, 1]
        self.graphs = None  # set by enable_cuda_graphs(): decode-only batches replay captured graphs

    def finish_setup(self, enforce_eager: bool, max_num_seqs: int) -> None:
        """Device-specific speedups, once the cache exists: on CUDA the fused decode kernel and
        CUDA graphs for decode batches (captured once, their memory in the pool)."""
        if self.device.type != "cuda":
            return
        from server.model.decode_kernel import triton_decode_attention

        self.model.decode_fn = triton_decode_attention
        if not enforce_eager:
            from server.model.graphs import DecodeGraphs

            self.graphs = DecodeGraphs.capture(self, max_num_seqs)

    # -- inputs --------------------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        bs = self.block_size
        # Decodes (one new token) first: they share one batched attention call.
        items = sorted(batch.items, key=lambda it: it[1] != 1)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        spans: list[tuple[int, int, int, list[int]]] = []
        for seq, n in items:
            start = seq.num_computed
            offset = len(ids)
            ids.extend(seq.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                spans.append((offset, n, start + n, table))
            if start + n == seq.num_tokens:
                sample_rows.append(offset + n - 1)
                sample_seqs.append(seq)
        dev = self.device
        width = max((len(t) for t in decode_tables), default=1)
        tables = torch.zeros((len(decode_tables), width), dtype=torch.int32)
        for r, t in enumerate(decode_tables):
            tables[r, :len(t)] = torch.tensor(t, dtype=torch.int32)
        ctx = AttentionContext(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
            num_decode_tokens=len(decode_tables),
            block_tables=tables.to(dev, non_blocking=True),
            context_lens=torch.tensor(decode_lens, dtype=torch.int32).to(dev, non_blocking=True),
            max_decode_context=max(decode_lens, default=0),
            prefills=[PrefillSpan(o, n, c, torch.tensor(t, dtype=torch.int32).to(dev, non_blocking=True))
                      for o, n, c, t in spans],
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True),
            positions=torch.tensor(pos, dtype=torch.long).to(dev, non_blocking=True),
            ctx=ctx,
            sample_index=torch.tensor(sample_rows, dtype=torch.long).to(dev, non_blocking=True),
            sample_seqs=sample_seqs,
            decode_only=not spans,
        )

    # -- execution -----------------------------------------------------------------------------

    @torch.inference_mode()
    def logits(self, inputs: StepInputs) -> torch.Tensor:
        if inputs.decode_only and self.graphs is not None and self.graphs.covers(len(inputs.sample_seqs)):
            return self.graphs.replay(inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.ctx)
        return self.model.compute_logits(hidden[inputs.sample_index])

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, eos_ids: frozenset[int], tokenizer
                ) -> list[tuple[Sequence, int, TokenLogprobs | None]]:
        inputs = self.prepare(batch)
        logits = self.logits(inputs)
        if not inputs.sample_seqs:
            return []
        tokens, logprobs = sample(logits, inputs.sample_seqs, eos_ids, tokenizer)
        return list(zip(inputs.sample_seqs, tokens, logprobs))
