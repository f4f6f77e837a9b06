"""Runs the model on a scheduled batch: builds the flat inputs, calls the model, samples.

Owns the model, its KV-cache tensor and the tokenizer-independent compute. Memory comes from the
pool only (weights under `weights`, the cache under `kv_cache`); the runner never frees or moves it.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from allocator import PoolError
from server.engine.grammar_masks import GrammarMasks, bit_values_on
from server.engine.host_batch import DecodeTables, HostBatch, continuing
from server.engine.routed_experts import RoutedExperts
from server.engine.kv_cache import NULL_BLOCK
from server.wire.outputs import TokenLogprobs
from server.engine.sampler import DeviceSample, SamplingMeta, prompt_logprobs, read_sample, sample, sample_on_device
from server.engine.step_types import ScheduledBatch, StepResult
from server.engine.sequence import Request, Sequence, SeqStatus
from server.wire.tags import CUDA_GRAPH, KV_CACHE
from server.model.attention import (AttentionContext, PrefillPlan, PrefillSpan, prefill_tile_rows, prefill_tile_tokens,
                                    prefill_tiles)
from server.model.kv_layout import attach, kv_cache_shape
from server.model.llama import LlamaForCausalLM
from server.model.finite import FiniteCheck
from server.model.loader import copy_weights, init_dummy_weights, iter_checkpoint, parameter_names
from server.model.ops import TorchOps

log = logging.getLogger("sleepserve.engine")




def _ops_for(device: torch.device, batch_invariant: bool = False):
    """The model's kernels: Triton's fused ones on CUDA (imported only there), plain PyTorch elsewhere;
    with batch_invariant, those whose every reduction keeps one order whatever the batch (batch_invariant.py)."""
    if batch_invariant:
        if device.type == "cuda":
            from server.model.batch_invariant_kernels import BatchInvariantTritonOps

            return BatchInvariantTritonOps
        from server.model.batch_invariant import BatchInvariantTorchOps

        return BatchInvariantTorchOps
    if device.type == "cuda":
        from server.model.fused_ops import TritonOps

        return TritonOps
    return TorchOps


class ModelRunner:
    # Async scheduling (core.py) launches a step before the previous one's tokens reach the host, its
    # input ids taken on the device (a tensor-parallel runner broadcasts them to its workers).
    supports_async = True

    def __init__(self, model: LlamaForCausalLM, pool, num_blocks: int, block_size: int, dtype: torch.dtype,
                 kv_chunk_bounds: tuple[int, ...] = ()):
        self.model = model
        # Every weight update checks that what landed is finite (--no-check-weights-finite: off); build.py sets it.
        self.check_finite = True
        self.cfg = model.config
        self.pool = pool
        self.device = pool.device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        c = self.cfg
        # Query tokens per tile of the prefill plan (to_device): the GQA group's heads share a tile's rows.
        self.tile_tokens = prefill_tile_tokens(c.num_heads // c.num_kv_heads, prefill_tile_rows(c.head_dim))
        # One block-major tensor for the whole cache (model/kv_layout.py), seen by each layer through
        # strided K and V views. With chunk bounds its memory comes in chunks of blocks (dim 0), each
        # one contiguous range = one pool piece, which a wake maps back one after the other.
        shape = kv_cache_shape(c, num_blocks, block_size)
        self.kv_chunked = bool(kv_chunk_bounds)
        if kv_chunk_bounds:
            try:
                self.kv_cache = pool.empty_chunked(shape, dtype, KV_CACHE, bounds=kv_chunk_bounds)
            except PoolError as err:  # serve anyway, with a wake that maps the whole cache first
                log.warning("the KV cache cannot be split in chunks (%s); a wake will map all of it", err)
                self.kv_chunked = False
        if not self.kv_chunked:
            self.kv_cache = pool.empty(shape, dtype, KV_CACHE)
        attach(model.model.layers, self.kv_cache)
        self.graphs = None  # set by enable_cuda_graphs(): decode-only batches replay captured graphs
        # When the last forward was launched (perf_counter) and whether a graph ran it (parallel/steps.py)
        self.launched, self.replayed = 0.0, False
        # Structured outputs: grammar token masks, computed while the forward runs (grammar_masks.py).
        # On CUDA its 8-byte table of bit values lives in the pool (restored by every wake, as the graphs').
        bits = None
        # The decode kernel's split counts (decode_kernel.py), in the pool too: zeros between launches.
        self.split_counts: torch.Tensor | None = None
        if self.device.type == "cuda":
            from server.model.decode_kernel import SPLIT_COUNTS  # Triton: imported where CUDA runs

            bits = pool.empty((8,), torch.uint8, CUDA_GRAPH)
            bits.copy_(bit_values_on(self.device))
            self.split_counts = pool.empty((SPLIT_COUNTS,), torch.int32, CUDA_GRAPH)
            self.split_counts.zero_()
        self.masks = GrammarMasks(c.vocab_size, self.device, bits)
        self._sampling: SamplingMeta | None = None  # the last batch's (sampler.py): steady batches reuse it
        self.decode_tables = DecodeTables()  # the last decode batch's padded block tables, kept up to date
        self.batch_invariant = False  # finish_setup sets it
        # --enable-return-routed-experts: the buffer the sparse layers write their top-k ids into (enable_routed_experts).
        self.routed: RoutedExperts | None = None

    def enable_routed_experts(self, max_tokens: int) -> None:
        """Record routed experts (before finish_setup: the decode graphs capture the sparse layers' writes)."""
        warm_up = 1 + min(2 * self.block_size, self.model.max_positions)  # _warm_up's batch
        self.routed = RoutedExperts(self.model, self.pool, max(max_tokens, warm_up))

    def finish_setup(self, enforce_eager: bool, max_num_seqs: int, batch_invariant: bool = False,
                     max_step_tokens: int | None = None) -> None:
        """Device-specific speedups, once the cache exists: on CUDA the fused Triton kernels and
        CUDA graphs for decode batches (captured once, their memory in the pool). batch_invariant: the
        ops whose reductions keep one order whatever the batch (model/batch_invariant.py). max_step_tokens:
        the most tokens a step runs (--max-num-batched-tokens), whose matmul variants the mode compiles now."""
        self.batch_invariant = batch_invariant
        self.model.ops = _ops_for(self.device, batch_invariant)
        self.max_num_seqs = max_num_seqs
        self.max_step_tokens = max(max_step_tokens or 0, max_num_seqs)
        self._warm_up()
        if self.device.type != "cuda":
            return
        if not enforce_eager:
            from server.engine.graphs import DecodeGraphs

            self.graphs = DecodeGraphs.capture(self, max_num_seqs)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One eager step over padding, a decode row beside a prefill of up to two blocks, every K/V written into and
        read from NULL_BLOCK: on CUDA, Triton compiles the eager path's kernels (and the fused sampler's) now rather
        than at the first request (~1 s with the engine stalled); the graphs' capture compiles the decode ones. (On the CPU it
        costs one tiny forward, and CI runs the code.) The plain forward, on every rank in step: a tensor-
        parallel rank 0 must not send its workers a step, they are building too."""
        bs = self.block_size
        n = min(2 * bs, self.model.max_positions)  # positions index the rotary tables: a short context is shorter
        null = NULL_BLOCK * bs
        hb = HostBatch(ids=[0] * (1 + n), positions=[0, *range(n)], slots=[null] + [null + p % bs for p in range(n)],
                       decode_tables=[[NULL_BLOCK]], decode_lens=[1], spans=[(1, n, n, [NULL_BLOCK] * -(-n // bs))],
                       sample_rows=[0, n], sample_seqs=[])
        ModelRunner.forward(self, hb)
        if self.device.type == "cuda":
            from server.engine.fused_sample import warm_up as warm_up_sampler

            # the model's output dtype: a decode graph's logits buffer is in it (graphs.py)
            warm_up_sampler(self.model.config.vocab_size, self.device, self.model.output_weight().dtype)
            from server.model.finite import warm_up as warm_up_finite  # the weight updates' copy (and check)

            warm_up_finite(self.device, {p.dtype for p in self.model.parameters()}, check=self.check_finite)
            if self.model.config.num_experts:  # every fused-MoE variant (a long prefill's tiles too)
                from server.model.fused_moe import warm_up as warm_up_moe

                warm_up_moe(self.model)
            if self.batch_invariant:  # every tile of the mode's matmul a step can take, per weight shape
                from server.model.batch_invariant_kernels import warm_up as warm_up_matmuls

                warm_up_matmuls(self.model, self.max_step_tokens)
            torch.cuda.synchronize(self.device)

    # -- weights (in place; a tensor-parallel runner does the same on every rank) ----------------

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Whole checkpoint tensors, already checked, copied in place. Returns the names loaded; raises
        NonFiniteWeightsError (after every copy) if any holds NaN or Inf (model/finite.py)."""
        check = FiniteCheck(self.check_finite)
        loaded = copy_weights(self.model, named, check=check)
        check.verify()
        return loaded

    def load_files(self, files: list[Path]) -> set[str]:
        """Checked safetensors files, read slice by slice (a rank reads only what it holds); checked finite."""
        check = FiniteCheck(self.check_finite)
        loaded = copy_weights(self.model, iter_checkpoint(files, self.model), sliced=True, check=check)
        check.verify()
        return loaded

    def load_dummy(self, seed: int) -> set[str]:
        init_dummy_weights(self.model, seed)
        return parameter_names(self.model)

    def ranks(self) -> list[dict]:
        """Each rank's process and device (GET /server_info)."""
        return [{"rank": 0, "pid": os.getpid(), "device": str(self.device)}]

    def watch(self, on_lost: Callable[[BaseException], None]) -> None:
        """on_lost(error) is called, from any thread, if this runner can no longer run (a tensor-
        parallel worker process died). One process cannot lose a part of itself: nothing to watch."""

    # -- inputs --------------------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch) -> HostBatch:
        if batch.decode_only:
            hb = self._prepare_decodes(batch)
            if hb is not None:
                return hb
        bs = self.block_size
        # Decodes (one new token) first: they share one batched attention call.
        items = sorted(batch.items, key=lambda it: it[1] != 1)
        hb = HostBatch([], [], [], [], [], [], [], [])
        routed = self.routed is not None
        next_scored: dict[str, int] = {}  # per request: the first prompt token still without a log-prob
        for seq, n in items:
            start = seq.num_computed
            offset = len(hb.ids)
            req = seq.request
            if req.prompt_logprobs_pending:
                # Position p's logits score prompt token p + 1. Of this chunk, the positions whose
                # token has no entry yet (sequences of one request share the prompt: score it once).
                first = next_scored.get(req.request_id, len(req.prompt_logprobs))  # type: ignore[arg-type]
                end = min(start + n, len(req.prompt_token_ids) - 1)
                if start <= first - 1 < end:
                    hb.prompt_rows.extend(range(offset + first - 1 - start, offset + end - start))
                    hb.prompt_targets.extend(req.prompt_token_ids[first:end + 1])
                    hb.prompt_groups.append((req, end + 1 - first))
                    next_scored[req.request_id] = end + 1
            if routed and seq.params.return_routed_experts:
                hb.routed.append((seq, offset, start, n))
            table = seq.block_table
            if n == 1:
                hb.ids.append(seq.token_ids[start])
                hb.positions.append(start)
                hb.slots.append(table[start // bs] * bs + start % bs)
                hb.decode_tables.append(table)
                hb.decode_lens.append(start + 1)
            else:
                hb.ids.extend(seq.token_ids[start:start + n])
                hb.positions.extend(range(start, start + n))
                hb.slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
                hb.spans.append((offset, n, start + n, table))
            if start + n == seq.num_tokens:
                hb.sample_rows.append(offset + n - 1)
                hb.sample_seqs.append(seq)
        return hb

    def _prepare_decodes(self, batch: ScheduledBatch) -> HostBatch | None:
        """prepare() for a batch of one-token steps (the steady state of generation), one list
        comprehension per field instead of a Python loop with a branch per sequence. None when a request
        still needs prompt log-probs (then the general path picks the rows)."""
        seqs = [seq for seq, _ in batch.items]
        if any(s.request.prompt_logprobs is not None for s in seqs):
            return None
        bs = self.block_size
        starts = [s.num_computed for s in seqs]
        tables = [s.block_table for s in seqs]
        ids = [s.token_ids[p] for s, p in zip(seqs, starts)]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, starts)]
        lens = [p + 1 for p in starts]
        # A one-token item is sampled when it is the sequence's last token (a prompt's last chunk can be
        # one token long and not be).
        rows = [i for i, (s, n) in enumerate(zip(seqs, lens)) if n == len(s.token_ids)]
        sample_seqs = seqs if len(rows) == len(seqs) else [seqs[i] for i in rows]
        return HostBatch(ids, starts, slots, tables, lens, [], rows, sample_seqs, routed=self._routed_rows(seqs, starts))

    def _routed_rows(self, seqs: list[Sequence], starts: list[int]) -> list[tuple[Sequence, int, int, int]]:
        """A one-token-per-sequence batch's rows of the sequences that asked for their routed experts."""
        if self.routed is None:
            return []
        return [(s, i, p, 1) for i, (s, p) in enumerate(zip(seqs, starts)) if s.params.return_routed_experts]

    def prepare_ahead(self, batch: ScheduledBatch, after: "Launched", rows: list[int]) -> HostBatch:
        """prepare() for a batch scheduled before the previous step's tokens reached the host (async
        scheduling, core.py): one token per sequence, at position num_tokens (the token still in flight,
        which the scheduler has room for already), its id taken on the device from the tokens `after`
        sampled: rows[i] is the row of after's sampled sequences that batch.items[i] continues."""
        seqs = [seq for seq, _ in batch.items]
        bs = self.block_size
        starts = [len(s.token_ids) for s in seqs]  # num_tokens, without a property call per sequence
        tables = [s.block_table for s in seqs]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, starts)]
        lens = [p + 1 for p in starts]
        return HostBatch([0] * len(seqs), starts, slots, tables, lens, [], list(range(len(seqs))), seqs,
                         ids_from=continuing(after.tokens, rows), ids_rows=rows,  # type: ignore[arg-type]
                         routed=self._routed_rows(seqs, starts))

    def to_device(self, hb: HostBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionContext, torch.Tensor]:
        """(input ids, positions, attention context, sample rows) on the device, from ONE host-to-
        device copy: small copies each cost a round of driver overhead, and a step has many. The copy
        carries the prefill spans' tile plan too (attention.PrefillPlan: what the one-launch prefill
        kernel reads, for every layer; the PyTorch path ignores it)."""
        nd = len(hb.decode_tables)
        width = max(map(len, hb.decode_tables), default=1)
        spans = [b for _, _, _, t in hb.spans for b in t]
        tiles = prefill_tiles(hb.spans, self.tile_tokens) if hb.spans else np.empty((0, 4), dtype=np.int64)
        # Every segment starts 16-byte aligned (an even int64 offset): Triton compiles a kernel per
        # alignment of its pointer arguments (the slots for rotary + cache write, the lengths and tables for
        # decode attention, the prefill plan), so an offset that shifts with the batch's size would compile
        # (~1 s, the whole engine stalled) in the middle of serving. The graphs' staging is aligned likewise.
        segments = (hb.ids, hb.positions, hb.slots, hb.decode_lens, hb.sample_rows)
        sizes = [len(v) for v in segments] + [nd * width, len(spans), tiles.size]
        at = list(itertools.accumulate((n + n % 2 for n in sizes), initial=0))
        at_tables, at_spans, at_tiles = at[len(segments):len(segments) + 3]
        tables_end = at_tables + nd * width
        flat = np.empty(at[-1], dtype=np.int64)
        for start, values in zip(at, segments):
            flat[start:start + len(values)] = values
        if nd:
            flat[at_tables:tables_end].reshape(nd, width)[...] = self.decode_tables.padded(hb.decode_tables, width)
        flat[at_spans:at_spans + len(spans)] = spans
        flat[at_tiles:] = tiles.ravel()
        d = torch.from_numpy(flat).to(self.device, non_blocking=True)
        prefills, cursor = [], at_spans
        for offset, n, ctx_len, t in hb.spans:
            prefills.append(PrefillSpan(offset, n, ctx_len, d[cursor:cursor + len(t)]))
            cursor += len(t)
        plan = None
        if prefills:
            plan = PrefillPlan(d[at_tiles:].view(-1, 4), d[at_spans:at_spans + len(spans)], self.tile_tokens)
        ids, positions, slots, lens, rows = (d[start:start + len(v)] for start, v in zip(at, segments))
        ctx = AttentionContext(
            slot_mapping=slots, num_decode_tokens=nd,
            block_tables=d[at_tables:tables_end].view(nd, width), context_lens=lens,
            max_decode_context=max(hb.decode_lens, default=0), prefills=prefills, prefill_plan=plan,
            split_counts=self.split_counts)
        return ids, positions, ctx, rows

    # -- execution -----------------------------------------------------------------------------

    @torch.inference_mode()
    def logits(self, hb: HostBatch) -> torch.Tensor:
        return self.forward(hb)[0]

    @torch.inference_mode()
    def forward(self, hb: HostBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits of the sampled rows, final hidden states of the prompt-log-prob rows or None)."""
        if (hb.decode_only and not hb.prompt_rows and self.graphs is not None
                and self.graphs.covers(len(hb.ids))):
            self.replayed = True
            return self.graphs.run(hb), None
        self.launched, self.replayed = time.perf_counter(), False
        ids, positions, ctx, rows = self.to_device(hb)
        if hb.ids_from is not None:
            ids = hb.ids_from
        hidden = self.model(ids, positions, ctx)
        prompt_hidden = None
        if hb.prompt_rows:
            prompt_hidden = hidden[torch.tensor(hb.prompt_rows, device=hidden.device)]
        return self.model.compute_logits(hidden[rows]), prompt_hidden

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, eos_ids: frozenset[int], tokenizer) -> StepResult:
        """(sampled tokens, new prompt log-prob entries per request), both from this one forward."""
        return self.launch(batch, eos_ids, tokenizer, feeds_next=False).collect()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, eos_ids: frozenset[int], tokenizer, after: "Launched | None" = None,
               rows: list[int] | None = None, feeds_next: bool = True) -> "Launched":
        """Queue a step on the device up to its sampled tokens' copy to the host; collect() waits for them.
        after, rows: the batch was scheduled ahead (prepare_ahead), its input ids are these rows of the tokens
        `after` sampled, on the device. feeds_next: this step's tokens may feed the next step on the device
        (async scheduling; a tensor-parallel runner then broadcasts them to every rank)."""
        hb = self.prepare(batch) if after is None else self.prepare_ahead(batch, after, rows or [])
        logits, prompt_hidden = self.forward(hb)
        # Asked-for routed experts: their copy to the host, queued behind the forward (no wait here).
        routed = (*self.routed.copy_out(len(hb.ids)), hb.routed) if hb.routed and self.routed else None
        scored: list[tuple[Request, list[TokenLogprobs]]] = []
        if prompt_hidden is not None:  # synchronizes (a prefill with prompt log-probs is never overlapped)
            ks = [req.params.prompt_logprobs or 0 for req, count in hb.prompt_groups for _ in range(count)]
            entries = prompt_logprobs(self.model.compute_logits, prompt_hidden, hb.prompt_targets, ks, tokenizer)
            at = 0
            for req, count in hb.prompt_groups:
                scored.append((req, entries[at:at + count]))
                at += count
        if not hb.sample_seqs:
            return Launched(batch, hb, None, None, scored, tokenizer, self, routed)
        meta = self._sampling
        if meta is None or not meta.matches(hb.sample_seqs):
            meta = self._sampling = SamplingMeta(hb.sample_seqs, logits.device, self.batch_invariant)
        if meta.grammar:  # the grammar first: what it forbids is never sampled, whatever else applies
            self.masks.apply(logits, hb.sample_seqs)
        ds = sample_on_device(logits, hb.sample_seqs, eos_ids, meta)
        return Launched(batch, hb, ds, meta, scored, tokenizer, self, routed)

    @torch.inference_mode()
    def sample(self, hb: HostBatch, logits: torch.Tensor, eos_ids: frozenset[int], tokenizer) -> StepResult:
        """Sample on the host's time, synchronously (bench/step_profile.py times the stages one by one)."""
        if not hb.sample_seqs:
            return StepResult()
        # The grammar first: what it forbids is never sampled, whatever else applies.
        self.masks.apply(logits, hb.sample_seqs)
        meta = self._sampling
        if meta is None or not meta.matches(hb.sample_seqs):
            meta = self._sampling = SamplingMeta(hb.sample_seqs, logits.device, self.batch_invariant)
        tokens, logprobs = sample(logits, hb.sample_seqs, eos_ids, tokenizer, meta)
        return self.result(hb.sample_seqs, tokens, logprobs, [])

    def result(self, seqs: list[Sequence], tokens: list[int], logprobs: list | None,
               scored: list[tuple[Request, list[TokenLogprobs]]], routed: tuple | None = None) -> StepResult:
        """The step's plain result; the grammars consume the sampled tokens first (their matchers are the
        masks' state, and the next step's masks start computing now)."""
        running = SeqStatus.RUNNING  # a row computed after its sequence ended (async scheduling) is dropped
        done = self.masks.advance([(s, t) for s, t in zip(seqs, tokens) if s.matcher is not None and s.status is running])
        rows = self.routed.rows_of(*routed) if routed is not None and self.routed is not None else []
        return StepResult([s.seq_id for s in seqs], tokens, logprobs,
                          [(req.request_id, entries) for req, entries in scored], done, rows)


@dataclass
class Launched:
    """A step queued on the device (ModelRunner.launch): its batch, inputs, and sampled tokens on their way
    to the host. collect() waits for them; until then the host may prepare and launch the next step."""
    batch: ScheduledBatch
    hb: HostBatch
    sampled: DeviceSample | None
    meta: SamplingMeta | None
    scored: list[tuple[Request, list[TokenLogprobs]]]
    tokenizer: object
    runner: "ModelRunner | None" = None
    routed: tuple | None = None  # asked-for routed experts on their way to the host: (host rows, copy event, items)

    @property
    def tokens(self) -> torch.Tensor | None:
        """The sampled tokens on the device, one per hb.sample_seqs, in order."""
        return None if self.sampled is None else self.sampled.tokens

    def collect(self) -> StepResult:
        """Wait for the sampled tokens and return the step's plain result."""
        assert self.runner is not None
        if self.sampled is None:
            return self.runner.result([], [], None, self.scored, self.routed)
        tokens, logprobs = read_sample(self.sampled, self.hb.sample_seqs, self.meta, self.tokenizer)  # type: ignore[arg-type]
        return self.runner.result(self.hb.sample_seqs, tokens, logprobs, self.scored, self.routed)
