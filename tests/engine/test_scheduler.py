"""The scheduler (server/engine/scheduler.py) over a real block manager, with no model: admission under
the token budget, chunked prefill, preemption and resumption, prefix-cache hits, abort, async
scheduling's step ahead, and what a sleep's discard leaves. Each step's result is a StepResult applied
by Scheduler.update_from_output (tests.engine.scheduling.record_step), as the engine core does after a
batch ran."""
from __future__ import annotations

import random

from server.engine.kv_cache import usable_blocks
from server.engine.sequence import SeqStatus
from tests.engine.scheduling import (BLOCK_SIZE, EOS, SAMPLED, MappedChunks, add_requests, check_invariants, items,
                                     make_request, make_requests, make_scheduler, record_step, run_step, seq_of)

BS = BLOCK_SIZE


def ids(seqs) -> list[str]:
    return [s.request.request_id for s in seqs]


def test_admission_fills_the_token_budget_and_chunks_the_last_prompt():
    s = make_scheduler(max_num_batched_tokens=16)
    add_requests(s, make_requests(3, num_tokens=10))
    batch = s.schedule()
    assert items(batch) == [("req-0/0", 10), ("req-1/0", 6)]  # req-1's prompt is cut at the budget
    assert batch.num_tokens == 16 and not batch.decode_only and batch.preempted == 0
    assert ids(s.running) == ["req-0", "req-1"] and ids(s.waiting) == ["req-2"]
    assert all(seq.request.first_scheduled_time is not None for seq in s.running)  # admission stamps it
    ended = record_step(s, batch)
    assert ended == []
    assert [(q.num_computed, q.num_output_tokens) for q in s.running] == [(10, 1), (6, 0)]  # a chunk samples nothing

    batch = s.schedule()  # running first (a decode, the rest of a prompt), then admission with what is left
    assert items(batch) == [("req-0/0", 1), ("req-1/0", 4), ("req-2/0", 10)]
    assert batch.num_tokens == 15
    record_step(s, batch)
    batch = s.schedule()
    assert items(batch) == [("req-0/0", 1), ("req-1/0", 1), ("req-2/0", 1)] and batch.decode_only
    check_invariants(s)


def test_admission_stops_at_the_sequence_limit():
    s = make_scheduler(max_num_seqs=2)
    add_requests(s, make_requests(3, num_tokens=4, max_tokens=2))
    batch, _ = run_step(s)
    assert items(batch) == [("req-0/0", 4), ("req-1/0", 4)] and ids(s.waiting) == ["req-2"]
    batch, ended = run_step(s)  # both sample their second and last token
    assert ids(ended) == ["req-0", "req-1"] and ids(s.waiting) == ["req-2"]  # admission comes before the end
    batch, _ = run_step(s)
    assert items(batch) == [("req-2/0", 4)]
    assert s.num_finished == 2


def test_n_sequences_of_a_request_are_scheduled_side_by_side():
    s = make_scheduler()
    (req,) = make_requests(1, num_tokens=6, n=3)
    add_requests(s, [req])
    batch = s.schedule()
    assert items(batch) == [("req-0/0", 6), ("req-0/1", 6), ("req-0/2", 6)]
    # Admitted in one step, they share no KV: a block joins the prefix cache only once computed.
    assert [seq.num_cached_tokens for seq in req.seqs] == [0, 0, 0]
    assert len({b for seq in req.seqs for b in seq.block_table}) == 6


def test_admission_is_first_come_first_served():
    s = make_scheduler(num_blocks=6)  # 5 usable blocks
    add_requests(s, make_requests(1, num_tokens=12, first=0))  # 3 blocks
    add_requests(s, make_requests(1, num_tokens=12, first=1))  # 3 more: do not fit
    add_requests(s, make_requests(1, num_tokens=4, first=2))   # would fit, but waits its turn
    batch = s.schedule()
    assert items(batch) == [("req-0/0", 12)]
    assert ids(s.waiting) == ["req-1", "req-2"]
    assert s.blocks.num_used == 3 and s.num_preemptions == 0


def test_a_long_prompt_is_prefilled_in_chunks_of_the_budget():
    s = make_scheduler(max_num_batched_tokens=8)
    (req,) = make_requests(1, num_tokens=20)
    seq = seq_of(req)
    add_requests(s, [req])
    chunks, tables = [], []
    for _ in range(3):
        batch, _ = run_step(s)
        chunks.append(items(batch))
        tables.append(len(seq.block_table))
    assert chunks == [[("req-0/0", 8)], [("req-0/0", 8)], [("req-0/0", 4)]]
    assert tables == [2, 4, 5]  # the blocks follow the chunks: ceil(computed / 4)
    assert seq.num_output_tokens == 1  # the first token comes with the prompt's last chunk
    assert len(seq.block_hashes) == 5  # every full block joined the prefix cache as it was computed
    batch, _ = run_step(s)
    assert items(batch) == [("req-0/0", 1)] and batch.decode_only


def test_a_prefix_computed_in_an_earlier_step_is_reused():
    s = make_scheduler()
    a, b, c = make_requests(3, num_tokens=10, same_prompt=True, max_tokens=1)
    add_requests(s, [a, b])
    batch = s.schedule()  # a and b in one step: b cannot reuse what a has not computed yet
    assert items(batch) == [("req-0/0", 10), ("req-1/0", 10)]
    a_blocks = list(seq_of(a).block_table)
    assert ids(record_step(s, batch)) == ["req-0", "req-1"]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)

    add_requests(s, [c])
    batch = s.schedule()
    assert items(batch) == [("req-2/0", 2)]  # two full blocks cached: only the last two tokens run
    seq = seq_of(c)
    assert c.num_cached_tokens == seq.num_computed == 8
    assert seq.block_table[:2] == a_blocks[:2]  # a's blocks: a registered them first
    assert s.blocks.stats.hit_tokens == 8 and s.blocks.stats.queried_tokens == 30


def test_when_blocks_run_out_the_newest_is_preempted_and_resumes_later():
    s = make_scheduler(num_blocks=5)  # 4 usable blocks
    (old,) = make_requests(1, num_tokens=4, max_tokens=6)
    (new,) = make_requests(1, num_tokens=4, max_tokens=20, first=1)
    add_requests(s, [old, new])
    for _ in range(5):  # 4 prompt tokens and 4 sampled each: 2 blocks each, the cache is full
        batch, ended = run_step(s)
        assert batch.preempted == 0 and ended == []
    victim = seq_of(new)
    assert s.blocks.num_free == 0 and victim.num_tokens == 9 and victim.num_computed == 8

    batch = s.schedule()  # old needs a third block for its 9th token: new gives its two back
    assert items(batch) == [("req-0/0", 1)] and batch.preempted == 1 and s.num_preemptions == 1
    assert victim.status is SeqStatus.WAITING and victim.num_computed == 0 and victim.block_table == []
    assert ids(s.waiting) == ["req-1"] and victim.output_token_ids == [SAMPLED] * 5  # its tokens are kept
    check_invariants(s)
    assert ids(record_step(s, batch)) == ["req-0"]  # old reached max_tokens: all blocks free again

    batch = s.schedule()  # new is admitted again and recomputes what it lost
    hit = victim.num_cached_tokens
    assert hit == BS  # its prompt block survived in the cache; its second block went to old
    assert items(batch) == [("req-1/0", victim.num_tokens - hit)] and victim.num_computed == hit
    record_step(s, batch)
    assert victim.num_output_tokens == 6 and victim.status is SeqStatus.RUNNING
    check_invariants(s)


def test_a_sequence_with_no_block_to_grow_into_preempts_itself():
    s = make_scheduler(num_blocks=3)  # 2 usable blocks
    add_requests(s, make_requests(1, num_tokens=8, max_tokens=4))
    run_step(s)
    batch = s.schedule()  # its 9th token needs a third block: there is none, and no one else to preempt
    assert not batch and batch.preempted == 1 and batch.num_tokens == 0
    assert s.running == [] and ids(s.waiting) == ["req-0"] and s.blocks.num_used == 0


def test_a_preempted_sequence_waits_ahead_of_new_requests():
    s = make_scheduler(num_blocks=5)
    add_requests(s, make_requests(2, num_tokens=8, max_tokens=20))
    run_step(s)  # both admitted: all 4 blocks used
    add_requests(s, make_requests(1, num_tokens=1, first=2))
    batch = s.schedule()
    assert batch.preempted == 1 and items(batch) == [("req-0/0", 1)]
    assert ids(s.waiting) == ["req-1", "req-2"]  # the preempted one goes first; nothing was admitted


def test_abort_frees_a_sequence_wherever_it_is():
    s = make_scheduler(max_num_batched_tokens=8)
    running, waiting = make_requests(2, num_tokens=12)
    add_requests(s, [running, waiting])
    run_step(s)  # running has computed its first chunk of 8; waiting waits
    assert s.blocks.num_used == 2 and ids(s.waiting) == ["req-1"]

    seq = seq_of(waiting)
    s.finish(seq)  # aborted while waiting
    assert seq.status is SeqStatus.FINISHED and len(s.waiting) == 0

    seq = seq_of(running)
    seq.abort()
    s.finish(seq)  # aborted halfway through its prompt
    assert seq.finish_reason == "abort" and seq.status is SeqStatus.FINISHED
    assert s.running == [] and seq.block_table == [] and seq.num_computed == 0
    assert s.blocks.num_used == 0 and not s.has_work and not s.schedule()
    assert s.num_finished == 2 and s.removals == (2, 0)

    # The chunk it computed stays in the prefix cache: its two full blocks.
    again = make_request(running.prompt_token_ids, "again")
    add_requests(s, [again])
    assert items(s.schedule()) == [("again/0", 4)] and again.num_cached_tokens == 8


def test_schedule_ahead_decodes_before_the_tokens_reach_the_host():
    s = make_scheduler()
    add_requests(s, make_requests(2, num_tokens=4, max_tokens=3))
    batch, _ = run_step(s)
    seqs = [seq for seq, _ in batch.items]
    # The next step, scheduled while the sampled tokens are still on the device: one each, at position
    # num_tokens, with a block for the token in flight and the next (4 prompt + 1 + 1 = 6: a second block).
    ahead = s.schedule_ahead(seqs)
    assert ahead is not None
    batch, rows = ahead
    assert items(batch) == [("req-0/0", 1), ("req-1/0", 1)] and rows == [0, 1]
    assert [len(q.block_table) for q in seqs] == [2, 2]
    record_step(s, batch)  # each has 2 of its 3 tokens; the one in flight is the last by max_tokens
    assert s.schedule_ahead(seqs) is None  # nothing to run ahead of the host

    s2 = make_scheduler()
    first = add_requests(s2, make_requests(2, num_tokens=4))
    run_step(s2)
    assert s2.schedule_ahead(first[:1]) is None  # a running sequence the step did not sample
    add_requests(s2, make_requests(1, num_tokens=4, first=2))
    assert s2.schedule_ahead(first) is None  # a request to admit: schedule() does that

    s3 = make_scheduler()
    seqs3 = add_requests(s3, make_requests(2, num_tokens=4))
    run_step(s3)
    s3.finish(seqs3[1])  # aborted while its token was in flight: the step ahead leaves it out
    batch, rows = s3.schedule_ahead(seqs3)
    assert items(batch) == [("req-0/0", 1)] and rows == [0]


def test_an_eos_ends_a_sequence_and_frees_its_blocks():
    s = make_scheduler()
    (req,) = make_requests(1, num_tokens=6, max_tokens=50)
    add_requests(s, [req])
    run_step(s)
    _, ended = run_step(s, token=EOS)
    assert ended == req.seqs and req.finished and seq_of(req).finish_reason == "stop"
    assert s.blocks.num_used == 0 and not s.has_work


def test_a_sleep_that_discards_the_cache_leaves_every_request_to_recompute():
    """mode=keep: the sleep controller preempts every running sequence, resets the prefix index and the
    pool releases the cache's memory; after the wake each request recomputes its tokens from the start."""
    s = make_scheduler(num_blocks=16, max_num_seqs=8)
    blocks = s.blocks
    blocks.residency = residency = MappedChunks((0, 4, 16))  # as build.py gives a chunked cache its KVChunks
    reqs = make_requests(3, num_tokens=6, max_tokens=20)
    add_requests(s, reqs[:2])
    run_step(s)
    run_step(s)
    add_requests(s, reqs[2:])  # waiting when the sleep comes
    assert ids(s.running) == ["req-0", "req-1"] and ids(s.waiting) == ["req-2"]
    before = {r.request_id: list(seq_of(r).token_ids) for r in reqs}

    preempted = s.preempt_all()  # core.preempt_all, for the sleep
    assert ids(preempted) == ["req-0", "req-1"]
    assert ids(s.waiting) == ["req-0", "req-1", "req-2"] and s.running == []  # in their order, ahead
    blocks.reset_prefix_cache()
    residency.ready = 0  # the pool released every chunk
    blocks.sync_mapped()
    assert blocks.num_used == 0 and blocks.num_free == 0 and blocks.block_of == {}
    check_invariants(s)
    batch = s.schedule()  # asleep: nothing fits, nothing is preempted, nothing waits on memory
    assert not batch and batch.preempted == 0 and len(s.waiting) == 3

    residency.ready, residency.arriving = 1, True  # the wake: the first chunk, the rest on its way
    batch = s.schedule()
    assert items(batch) == [(f"req-{i}/0", len(before[f"req-{i}"])) for i in range(3)]
    assert [r.num_cached_tokens for r in reqs] == [0, 0, 0]  # no prefix survives a discard
    assert {r.request_id: seq_of(r).token_ids for r in reqs} == before  # what was sampled is kept
    check_invariants(s)


def test_a_busy_cache_keeps_its_books_straight():
    """Many requests of random lengths through a small cache, with aborts: after every step the
    block counts add up, the null block is in no table, the budget and the sequence limit hold;
    in the end every request has finished and every block is free."""
    rng = random.Random(37)
    s = make_scheduler(num_blocks=24, max_num_seqs=6, max_num_batched_tokens=24)
    reqs = [make_request([rng.randrange(3, 50) for _ in range(rng.randrange(1, 30))], f"r{i}",
                         max_tokens=rng.randrange(1, 20)) for i in range(40)]
    pending = list(reqs)
    aborted = set()
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            add_requests(s, [pending.pop(0)])
        if not s.has_work and not pending:
            break
        batch, _ = run_step(s)
        assert batch.num_tokens == sum(n for _, n in batch.items) <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs
        if s.running and rng.random() < 0.05:
            victim = rng.choice(s.running)
            victim.abort()
            s.finish(victim)
            aborted.add(victim.request.request_id)
        check_invariants(s)
    assert all(r.finished for r in reqs) and not s.has_work
    assert s.blocks.num_used == 0 and s.blocks.num_free == usable_blocks(24)
    for r in reqs:
        if r.request_id not in aborted:
            assert seq_of(r).num_output_tokens == r.params.max_tokens
    assert s.num_preemptions > 0  # the cache was small enough to preempt
