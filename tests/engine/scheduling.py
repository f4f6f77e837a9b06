"""Builders for unit tests of the scheduler and the block manager: a real Scheduler over a real
BlockManager, and requests made of plain token ids, with no model, tokenizer or device (in the spirit
of vLLM's tests/v1/core/utils.py: create_scheduler, create_requests).

Token ids: request i's prompt is 1000·(i+1) + j, so no two requests share a block unless asked to
(`same_prompt`). Sampled tokens are SAMPLED (never an EOS unless a test says so), so a sequence ends by
its max_tokens, by the context limit, or when a test aborts it.
"""
from __future__ import annotations

import itertools

from server.engine.kv_cache import NULL_BLOCK, BlockManager, usable_blocks
from server.engine.params import SamplingParams
from server.engine.scheduler import ScheduledBatch, Scheduler
from server.engine.sequence import Request, Sequence, SeqStatus

BLOCK_SIZE = 4
EOS = 2
EOS_IDS = frozenset([EOS])
SAMPLED = 7
MAX_MODEL_LEN = 256

_seq_ids = itertools.count()


def make_scheduler(*, num_blocks: int = 64, block_size: int = BLOCK_SIZE, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 64, enable_prefix_caching: bool = True) -> Scheduler:
    """A scheduler over a cache of num_blocks blocks (one of them the null block, never handed out)."""
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(blocks, max_num_seqs, max_num_batched_tokens)


def make_request(prompt_token_ids: list[int], request_id: str = "req", *, max_tokens: int | None = 16,
                 n: int = 1, prompt_logprobs: int | None = None) -> Request:
    """One request of these prompt tokens, with n sequences (not yet added to a scheduler)."""
    params = SamplingParams(n=n, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    req = Request(request_id, None, list(prompt_token_ids), params)
    req.seqs = [Sequence(next(_seq_ids), req, k, None) for k in range(n)]
    return req


def make_requests(num_requests: int, num_tokens: int = 10, *, max_tokens: int | None = 16, n: int = 1,
                  same_prompt: bool = False, prompt_logprobs: int | None = None,
                  first: int = 0) -> list[Request]:
    """Requests req-{first}, req-{first+1}, ... of num_tokens prompt tokens each."""
    requests = []
    for i in range(first, first + num_requests):
        base = 1000 if same_prompt else 1000 * (i + 1)
        requests.append(make_request([base + j for j in range(num_tokens)], f"req-{i}", max_tokens=max_tokens,
                                     n=n, prompt_logprobs=prompt_logprobs))
    return requests


def seq_of(req: Request) -> Sequence:
    """The one sequence of an n=1 request."""
    (seq,) = req.seqs
    return seq


def add_requests(scheduler: Scheduler, requests: list[Request]) -> list[Sequence]:
    """Queue every sequence of `requests`, in order (as EngineCore.add_request does); returns them."""
    seqs = [seq for req in requests for seq in req.seqs]
    for seq in seqs:
        scheduler.add(seq)
    return seqs


def items(batch: ScheduledBatch) -> list[tuple[str, int]]:
    """The batch as (request id and sequence index, new tokens) pairs, for readable asserts."""
    return [(f"{seq.request.request_id}/{seq.index}", n) for seq, n in batch.items]


def check_invariants(scheduler: Scheduler) -> None:
    """What must hold between any two steps: every handed-out block is counted once per table holding
    it, the null block is in no table, used + free = usable, a waiting sequence holds no KV, and a
    running one holds blocks for all it has computed."""
    blocks = scheduler.blocks
    holders = [0] * blocks.num_blocks
    for seq in scheduler.running:
        assert seq.status is SeqStatus.RUNNING
        assert NULL_BLOCK not in seq.block_table
        assert seq.num_computed <= len(seq.block_table) * blocks.block_size
        for b in seq.block_table:
            holders[b] += 1
    for seq in scheduler.waiting:
        assert seq.status is SeqStatus.WAITING
        assert seq.block_table == [] and seq.num_computed == 0
    assert holders == blocks.ref_count
    assert blocks.ref_count[NULL_BLOCK] == 0
    assert blocks.num_used + blocks.num_free == max(0, usable_blocks(blocks.mapped))
    assert blocks.num_used == sum(1 for c in blocks.ref_count if c)


class MappedChunks:
    """A KV cache whose memory comes in chunks (the Residency protocol of kv_cache.py, as
    memory_plan.KVChunks answers it for the pool): blocks [0, bounds[ready]) are mapped. A sleep that
    discards the cache sets ready to 0; a wake maps the chunks in order. `arriving`: whether a chunk
    not mapped yet is on its way (wait_for_more then maps the next one, as the pool's background
    mapper would), or none is coming (a sleep)."""

    def __init__(self, bounds: tuple[int, ...]):
        self.bounds = bounds
        self.ready = len(bounds) - 1
        self.arriving = False
        self.waits = 0

    def mapped_blocks(self) -> int:
        return self.bounds[self.ready]

    def wait_for_more(self) -> bool:
        self.waits += 1
        if not self.arriving or self.ready >= len(self.bounds) - 1:
            return False
        self.ready += 1
        return True


# -- after the step ran ---------------------------------------------------------------------------
# What EngineCore.postprocess does to the scheduler and the sequences once a batch ran, without the
# text: the KV progress, one sampled token per sequence whose prompt is all computed, and the end of
# those that reached their length. (Scheduler.update_from_output will take this over: then this is
# the one function to change.)

def record_step(scheduler: Scheduler, batch: ScheduledBatch, token: int = SAMPLED,
                max_model_len: int = MAX_MODEL_LEN) -> list[Sequence]:
    """Record that `batch` ran and each of its sequences that finished its prompt sampled `token`;
    returns the sequences that ended (already finished in the scheduler)."""
    scheduler.advance(batch)
    ended = []
    for seq, _ in batch.items:
        if seq.num_computed < seq.num_tokens:
            continue  # a prefill chunk that is not the prompt's last: nothing sampled (runner.prepare)
        if seq.append_token(token, None, EOS_IDS):
            seq.append_text("", max_model_len)  # the length limits (no tokenizer: no text)
        if seq.finish_reason is not None:
            ended.append(seq)
    for seq in ended:
        scheduler.finish(seq)
    return ended


def run_step(scheduler: Scheduler, token: int = SAMPLED) -> tuple[ScheduledBatch, list[Sequence]]:
    """schedule() and record the batch as if it ran; returns the batch and the sequences that ended."""
    batch = scheduler.schedule()
    return batch, record_step(scheduler, batch, token)
