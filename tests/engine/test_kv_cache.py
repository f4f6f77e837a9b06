"""The block manager (server/engine/kv_cache.py) on its own: the null block, allocation and release,
prefix-cache hits and eviction order, and what a sleep that discards the cache leaves. The scheduler's
part (Sequence.num_computed) is done by hand here, as Scheduler.advance would."""
from __future__ import annotations

import pytest

from server.engine.kv_cache import NULL_BLOCK, BlockManager, block_hash, usable_blocks
from server.engine.sequence import Sequence
from tests.engine.scheduling import BLOCK_SIZE, MappedChunks, make_request, make_requests, seq_of

BS = BLOCK_SIZE


def computed(blocks: BlockManager, seq: Sequence, num_tokens: int | None = None) -> Sequence:
    """Admit seq with whatever prefix the cache holds, mark num_tokens (default: all) computed and
    register the full blocks: a prefill that ran."""
    hits = blocks.match_prefix(seq)
    assert blocks.admit(seq, hits, seq.num_tokens)
    seq.num_computed = seq.num_tokens if num_tokens is None else num_tokens
    blocks.commit(seq)
    return seq


def test_a_cache_needs_a_block_besides_the_null_block():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockManager(1, BS)
    assert usable_blocks(2) == 1 and BlockManager(2, BS).num_free == 1


def test_the_null_block_is_never_handed_out():
    blocks = BlockManager(5, BS)
    assert blocks.num_free == 4 and blocks.num_used == 0
    seqs = [seq_of(r) for r in make_requests(4, num_tokens=BS)]
    for seq in seqs:
        assert blocks.admit(seq, [], BS)
    assert sorted(b for s in seqs for b in s.block_table) == [1, 2, 3, 4]
    assert blocks.num_free == 0 and blocks.num_used == 4

    late = seq_of(make_requests(1, num_tokens=BS, first=4)[0])
    assert not blocks.admit(late, [], BS)  # full: refused, and nothing taken
    assert late.block_table == [] and blocks.num_used == 4

    for seq in seqs:
        blocks.release(seq)
    assert blocks.num_free == 4 and blocks.ref_count == [0] * 5
    big = seq_of(make_request(list(range(100, 116)), max_tokens=1))
    assert blocks.admit(big, [], 16)  # every usable block, handed out again: still not block 0
    assert sorted(big.block_table) == [1, 2, 3, 4] and NULL_BLOCK not in big.block_table
    assert blocks.ref_count[NULL_BLOCK] == 0


def test_blocks_grow_a_block_at_a_time():
    blocks = BlockManager(8, BS)
    seq = seq_of(make_request(list(range(10))))
    assert blocks.blocks_needed(seq, 1) == 1 and blocks.blocks_needed(seq, 4) == 1
    assert blocks.blocks_needed(seq, 5) == 2 and blocks.blocks_needed(seq, 10) == 3
    assert blocks.admit(seq, [], 5)  # a first chunk of 5 tokens
    assert len(seq.block_table) == 2 and blocks.num_used == 2
    assert blocks.blocks_needed(seq, 8) == 0 and blocks.blocks_needed(seq, 9) == 1
    assert blocks.can_grow(seq, 9)
    blocks.grow(seq, 9)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert not blocks.can_grow(seq, 9 + 5 * BS)  # 5 more blocks: only 4 are free
    blocks.release(seq)
    assert seq.block_table == [] and blocks.num_used == 0 and blocks.num_free == 7


def test_a_full_computed_block_is_a_prefix_hit_for_the_next_request():
    blocks = BlockManager(16, BS)
    a, b = (seq_of(r) for r in make_requests(2, num_tokens=10, same_prompt=True))
    computed(blocks, a)
    assert len(a.block_hashes) == 2  # 10 tokens: two full blocks registered, the third is partial
    hits = blocks.match_prefix(b)
    assert hits == a.block_table[:2] and b.block_hashes == a.block_hashes
    assert blocks.admit(b, hits, b.num_tokens)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [blocks.ref_count[x] for x in b.block_table] == [2, 2, 1]
    assert blocks.num_used == 4
    assert (blocks.stats.queried_tokens, blocks.stats.hit_tokens) == (20, 8)

    blocks.release(a)  # the shared prefix stays in use by b; a's own tail is free
    assert [blocks.ref_count[x] for x in b.block_table] == [1, 1, 1] and blocks.num_used == 3


def test_a_hit_leaves_at_least_one_token_to_compute():
    blocks = BlockManager(16, BS)
    computed(blocks, seq_of(make_request(list(range(12)), "a")))
    # The last prompt token's logits give the first sample: 8 identical tokens hit one block, not two.
    assert len(blocks.match_prefix(seq_of(make_request(list(range(8)), "b")))) == 1
    assert len(blocks.match_prefix(seq_of(make_request(list(range(9)), "c")))) == 2
    assert len(blocks.match_prefix(seq_of(make_request(list(range(13)), "d")))) == 3


def test_a_block_hash_covers_every_token_before_it():
    blocks = BlockManager(16, BS)
    a = computed(blocks, seq_of(make_request(list(range(9)), "a")))
    # The same four tokens as a's second block, after a different first block: not a's block.
    other = seq_of(make_request([99, 98, 97, 96, 4, 5, 6, 7, 8], "b"))
    assert blocks.match_prefix(other) == []
    assert a.block_hashes[1] == block_hash(a.block_hashes[0], [4, 5, 6, 7])
    assert a.block_hashes[1] != block_hash(b"", [4, 5, 6, 7])
    # A partial block (not yet full of computed tokens) is never registered.
    partial = computed(blocks, seq_of(make_request(list(range(200, 210)), "c")), num_tokens=7)
    assert len(partial.block_hashes) == 1


def test_released_blocks_keep_their_prefix_until_handed_out_again():
    """Eviction order: never-used (fresh) blocks first, then released ones, least recently released
    first and a sequence's tail before its head (a shared prefix is worth more than a private tail)."""
    blocks = BlockManager(7, BS)  # 6 usable
    a = computed(blocks, seq_of(make_request(list(range(12)), "a")))
    assert a.block_table == [1, 2, 3] and len(a.block_hashes) == 3
    blocks.release(a)
    probe = seq_of(make_request(list(range(13)), "probe"))  # a's 12 tokens and one more
    assert blocks.match_prefix(probe) == [1, 2, 3]

    c = seq_of(make_request(list(range(500, 512)), "c"))
    assert blocks.admit(c, [], 12)
    assert c.block_table == [4, 5, 6]  # fresh blocks go first: a's prefix is untouched
    assert blocks.match_prefix(probe) == [1, 2, 3]

    for i, left in ((0, [1, 2]), (1, [1]), (2, [])):
        d = seq_of(make_request([700 + i] * 4, f"d{i}"))
        assert blocks.admit(d, [], 4)
        assert d.block_table == [3 - i]  # a's tail goes first
        assert blocks.match_prefix(probe) == left
    assert blocks.num_free == 0


def test_a_refused_admission_keeps_the_cached_prefix():
    blocks = BlockManager(6, BS)  # 5 usable
    a = computed(blocks, seq_of(make_request(list(range(9)), "a")))
    blocks.release(a)
    long = seq_of(make_request(list(range(30)), "long"))  # 8 blocks: more than the cache
    hits = blocks.match_prefix(long)
    assert len(hits) == 2
    assert not blocks.admit(long, hits, long.num_tokens)
    assert long.block_table == [] and blocks.num_used == 0 and blocks.num_free == 5
    assert blocks.match_prefix(seq_of(make_request(list(range(9)), "again"))) == hits


def test_reset_forgets_every_hash_and_keeps_blocks_in_use():
    blocks = BlockManager(16, BS)
    a = computed(blocks, seq_of(make_request(list(range(10)), "a")))
    held = list(a.block_table)
    blocks.reset_prefix_cache()
    assert blocks.block_of == {} and set(blocks.hash_of) == {None}
    assert blocks.match_prefix(seq_of(make_request(list(range(10)), "b"))) == []
    assert a.block_table == held and [blocks.ref_count[x] for x in held] == [1, 1, 1]


def test_without_prefix_caching_nothing_is_registered_or_hit():
    blocks = BlockManager(16, BS, enable_prefix_caching=False)
    computed(blocks, seq_of(make_request(list(range(10)), "a")))
    assert blocks.block_of == {}
    b = seq_of(make_request(list(range(10)), "b"))
    assert blocks.match_prefix(b) == [] and b.block_hashes == []
    assert (blocks.stats.queried_tokens, blocks.stats.hit_tokens) == (0, 0)


def test_prompt_logprobs_compute_every_position():
    blocks = BlockManager(16, BS)
    computed(blocks, seq_of(make_request(list(range(10)), "a")))
    scored = seq_of(make_request(list(range(10)), "scored", prompt_logprobs=1))
    assert scored.request.prompt_logprobs_pending
    assert blocks.match_prefix(scored) == [] and scored.block_hashes == []


# -- a KV cache whose memory a sleep discards and a wake maps back in chunks --------------------

def chunked_cache(bounds: tuple[int, ...] = (0, 4, 16)) -> tuple[BlockManager, MappedChunks]:
    blocks = BlockManager(bounds[-1], BS)
    blocks.residency = residency = MappedChunks(bounds)
    return blocks, residency


def test_a_discarded_cache_wakes_empty_with_no_prefix():
    blocks, residency = chunked_cache()
    a = computed(blocks, seq_of(make_request(list(range(10)), "a")))
    blocks.release(a)
    assert blocks.block_of  # a's prefix is cached

    residency.ready = 0  # the sleep released every chunk (every block was free)
    blocks.sync_mapped()
    assert blocks.mapped == 0 and blocks.num_free == 0 and blocks.num_used == 0
    assert blocks.block_of == {} and set(blocks.hash_of) == {None} and len(blocks.free) == 0
    waiting = seq_of(make_request(list(range(10)), "b"))
    assert not blocks.admit(waiting, [], 10)  # no memory, and none is coming: refused, not blocked

    residency.ready = len(residency.bounds) - 1  # the wake mapped every chunk
    assert blocks.match_prefix(waiting) == []  # the KV those hashes named is gone
    assert blocks.admit(waiting, [], 10)
    assert waiting.block_table == [1, 2, 3]  # every block came back fresh, from the first
    assert blocks.num_free == usable_blocks(16) - 3


def test_a_wake_maps_chunks_in_order_and_admission_waits_for_them():
    blocks, residency = chunked_cache()
    residency.ready = 0
    blocks.sync_mapped()
    residency.ready = 1  # the wake mapped the first chunk: blocks [0, 4)
    small = seq_of(make_request(list(range(8)), "small"))
    assert blocks.admit(small, [], 8)
    assert small.block_table == [1, 2] and blocks.num_free == 1 and residency.waits == 0

    big = seq_of(make_request(list(range(100, 120)), "big"))  # 5 blocks: more than chunk one has
    assert not blocks.admit(big, [], 20)  # no chunk on its way: refused at once
    assert big.block_table == [] and residency.waits == 1
    residency.arriving = True  # the rest is being mapped in the background: wait for it
    assert blocks.admit(big, [], 20)
    assert residency.waits == 2 and blocks.mapped == 16
    assert big.block_table == [3, 4, 5, 6, 7] and blocks.num_free == usable_blocks(16) - 7


def test_blocks_in_use_must_not_lose_their_memory():
    blocks, residency = chunked_cache()
    a = seq_of(make_request(list(range(20)), "a"))
    assert blocks.admit(a, [], 20)  # blocks 1..5: the last two lie in the second chunk
    residency.ready = 1
    with pytest.raises(RuntimeError, match="in use"):
        blocks.sync_mapped()
