"""Builders for unit tests of the scheduler and the block manager: a real Scheduler over a real
BlockManager, and requests made of plain token ids, with no model, tokenizer or device (in the spirit
of vLLM's tests/v1/core/utils.py: create_scheduler, create_requests).

Token ids: request i's prompt is 1000·(i+1) + j, so no two requests share a block unless asked to
(`same_prompt`). Sampled tokens are SAMPLED (never an EOS unless a test says so), so a sequence ends by
its max_tokens, by the context limit, or when a test aborts it. The ids are the embedded model's
vocabulary (49,152 tokens; EOS is its <|im_end|>), whose tokenizer gives the sampled tokens their text.
"""
from __future__ import annotations

import functools
import itertools

from server.engine.kv_cache import NULL_BLOCK, BlockManager, usable_blocks
from server.wire.params import SamplingParams
from server.engine.scheduler import Scheduler
from server.engine.sequence import Request, Sequence, SeqStatus
from server.engine.step_types import ScheduledBatch, StepResult

BLOCK_SIZE = 4
EOS = 2
EOS_IDS = frozenset([EOS])
SAMPLED = 260  # " the": a plain token (ids below 17 are special tokens)
MAX_MODEL_LEN = 256

_seq_ids = itertools.count()


def make_scheduler(*, num_blocks: int = 64, block_size: int = BLOCK_SIZE, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 64, enable_prefix_caching: bool = True) -> Scheduler:
    """A scheduler over a cache of num_blocks blocks (one of them the null block, never handed out)."""
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(blocks, max_num_seqs, max_num_batched_tokens, max_model_len=MAX_MODEL_LEN, eos_ids=EOS_IDS,
                     tokenizer=tokenizer())


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
# What the runner hands back (a StepResult: one sampled token for each sequence whose prompt the step
# finished) and Scheduler.update_from_output applying it: the KV progress, the token and its text, the
# ends. The text needs a real tokenizer: the embedded model's, loaded once (tokenizer()).

@functools.cache
def tokenizer():
    """The embedded default model's tokenizer, through the server's own loader (no model weights)."""
    from server.model.tokenizer import load_tokenizer
    from testkit.models import tokenizer_folder

    return load_tokenizer(tokenizer_folder())


def step_result(batch: ScheduledBatch, token: int = SAMPLED) -> StepResult:
    """What the runner returns for `batch`, sampling `token` for every sequence whose prompt the step
    finishes (a prefill chunk that is not its prompt's last samples nothing: runner.prepare)."""
    rows = [seq.seq_id for seq, n in batch.items if seq.num_computed + n == seq.num_tokens]
    return StepResult(seq_ids=rows, token_ids=[token] * len(rows))


def record_step(scheduler: Scheduler, batch: ScheduledBatch, token: int = SAMPLED) -> list[Sequence]:
    """Apply `batch`'s result as if it ran; returns the sequences that ended (already finished in the
    scheduler), in the batch's order."""
    seqs = [seq for seq, _ in batch.items]
    scheduler.update_from_output(batch, step_result(batch, token))
    return [seq for seq in seqs if seq.status is SeqStatus.FINISHED]


def run_step(scheduler: Scheduler, token: int = SAMPLED) -> tuple[ScheduledBatch, list[Sequence]]:
    """schedule() and record the batch as if it ran; returns the batch and the sequences that ended."""
    batch = scheduler.schedule()
    return batch, record_step(scheduler, batch, token)
