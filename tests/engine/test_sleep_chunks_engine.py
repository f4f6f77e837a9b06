"""The engine with a KV cache that wakes in chunks and host backups prepared at start-up (CPU backend,
in process): requests that need blocks not mapped yet wait for them, then run with the same output."""
from __future__ import annotations

import threading

import pytest

from server import SamplingParams
from allocator.pool import MAX_PIECE_BYTES
from server.wire.tags import KV_CACHE

LONG_PROMPT = "The history of the printing press begins with movable type. " * 10  # ~120 tokens


@pytest.fixture(scope="module")
def chunked_llm(default_model_folder):
    from server import LLM

    engine = LLM(model=str(default_model_folder), device="cpu", kv_cache_memory="128MiB",
                 kv_wake_chunk="4MiB", prepare_backups="on")
    yield engine
    engine.close()


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_the_plan_splits_the_cache_in_growing_chunks(chunked_llm):
    core = chunked_llm.engine
    bounds = core.kv_plan.chunk_bounds
    assert len(bounds) >= 3 and bounds[0] == 0 and bounds[-1] == core.kv_plan.num_blocks
    sizes = [b - a for a, b in zip(bounds, bounds[1:-1])]
    assert all(b >= 4 * a for a, b in zip(sizes, sizes[1:]))
    assert core.pool.chunks_ready(KV_CACHE) == len(bounds) - 1


def test_backups_are_prepared_at_start_up(chunked_llm):
    pool = chunked_llm.engine.pool
    pool.wait_prepared()
    assert pool.prepare_error is None
    weights = pool.stats().tags["weights"].bytes
    assert pool.stats().host_backup_bytes >= weights > 100e6


def test_a_request_needing_unmapped_blocks_waits_for_them_and_gets_the_same_output(chunked_llm, monkeypatch):
    core = chunked_llm.engine
    pool, blocks = core.pool, core.blocks
    reference = chunked_llm.generate(LONG_PROMPT, greedy())[0].outputs[0].token_ids
    first_chunk_tokens = (core.kv_plan.chunk_bounds[1] - 1) * core.kv_plan.block_size
    assert len(core.encode(LONG_PROMPT)) > first_chunk_tokens  # it cannot fit in the first chunk

    steps = threading.Semaphore(0)
    real_map = pool._backend.map_pieces

    def gated_map(addresses):
        assert steps.acquire(timeout=60), "never released"
        return real_map(addresses)

    monkeypatch.setattr(pool._backend, "map_pieces", gated_map)
    waits = []
    real_wait = blocks.residency.wait_for_more

    def counted_wait():
        waits.append(pool.chunks_ready(KV_CACHE))
        return real_wait()

    monkeypatch.setattr(blocks.residency, "wait_for_more", counted_wait)
    preemptions = core.scheduler.num_preemptions

    chunked_llm.sleep(level=1)
    chunked_llm.wake_up()
    assert pool.chunks_ready(KV_CACHE) == 1  # the wake returned with the first chunk only
    releaser = threading.Timer(0.3, lambda: [steps.release() for _ in range(10_000)])
    releaser.start()
    try:
        out = chunked_llm.generate(LONG_PROMPT, greedy())[0].outputs[0].token_ids
    finally:
        releaser.join()
    assert out == reference
    assert waits and waits[0] == 1  # admission waited for the next chunk instead of failing
    assert core.scheduler.num_preemptions == preemptions
    assert pool.wait_chunks(KV_CACHE, len(core.kv_plan.chunk_bounds) - 1, timeout=30) == \
        len(core.kv_plan.chunk_bounds) - 1
    blocks.sync_mapped()  # the block manager follows the pool at its next admission
    assert blocks.num_used == 0 and blocks.num_free == core.kv_plan.num_blocks - 1


def test_chunk_bounds_fall_on_whole_granules_and_grow():
    from server.engine.memory_plan import chunk_bounds, chunk_plan
    from server.wire.stats import KVPlan

    assert chunk_bounds(100, 10, 1) == (0, 10, 50, 100)
    assert chunk_bounds(100, 200, 1) == ()  # one chunk: nothing to split
    # 24 KiB per block (every layer's K and V); 2 MiB granules -> multiples of 256 blocks.
    plan = KVPlan(num_blocks=10_001, block_size=16, bytes=10_001 * 24576, bytes_per_block=24576)
    split = chunk_plan(plan, 2 << 20, 64 << 20)
    assert split.num_blocks == 9984 and split.bytes == 9984 * 24576
    assert split.chunk_bounds == (0, 2816, 9984)  # 64 MiB = 2731 blocks, rounded up to 11 x 256
    assert all(b * 24576 % (2 << 20) == 0 for b in split.chunk_bounds)
    # 2 MiB per block (an 8B model's 32 layers x 8 KV heads x 128 in bf16): any block count works.
    big = KVPlan(num_blocks=1001, block_size=16, bytes=1001 << 21, bytes_per_block=1 << 21)
    assert chunk_plan(big, 2 << 20, 64 << 20).chunk_bounds == (0, 32, 160, 672, 1001)
    assert chunk_plan(plan, 2 << 20, 0) is plan


def test_each_chunk_is_contiguous_pool_pieces_with_those_blocks_of_every_layer(chunked_llm):
    """The cache is block-major (server/model/kv_layout.py): a chunk of blocks is one contiguous range,
    made of pool pieces of at most MAX_PIECE_BYTES (physical handles on CUDA), and every layer's K and V
    of those blocks lie inside it, so nothing a chunk's blocks hold is left in another chunk's memory."""
    core = chunked_llm.engine
    kv, bounds, per_block = core.runner.kv_cache, core.kv_plan.chunk_bounds, core.kv_plan.bytes_per_block
    layers = core.model.model.layers
    assert kv.shape[:3] == (core.kv_plan.num_blocks, len(layers), 2) and kv.is_contiguous()
    assert kv.shape[1:].numel() * kv.element_size() == per_block
    pool = core.pool
    pieces = pool._chunks[KV_CACHE].pieces  # the addresses of each chunk's pieces
    assert len(pieces) == len(bounds) - 1
    for c, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        start, at = pieces[c][0], pieces[c][0]
        for address in pieces[c]:  # contiguous pieces of at most MAX_PIECE_BYTES (here: one per chunk)
            piece_size = pool._backend._piece_owner(address).pieces[address][0]
            assert address == at and piece_size <= MAX_PIECE_BYTES
            at += piece_size
        size = at - start
        assert (start, size) == (kv.data_ptr() + lo * per_block, (hi - lo) * per_block)
        for layer in layers:
            for view in (layer.self_attn.k_cache, layer.self_attn.v_cache):
                assert view.shape[0] == core.kv_plan.num_blocks and view.untyped_storage().data_ptr() == \
                    kv.untyped_storage().data_ptr()  # a view of the cache, no copy
                first, last = view[lo], view[hi - 1]
                end = last.data_ptr() + last.numel() * last.element_size()
                assert start <= first.data_ptr() and end <= start + size, (c, first.data_ptr(), end)


def test_reports_say_how_far_the_background_mapping_got(chunked_llm, monkeypatch):
    """A sleep that comes while the last wake still maps chunks stops the mapper; its report says how far
    the mapper got, and the pool's stats follow the mapping (GET /memory `chunks`)."""
    core = chunked_llm.engine
    pool, total = core.pool, len(core.kv_plan.chunk_bounds) - 1
    gate = threading.Semaphore(0)
    real_map = pool._backend.map_pieces

    def gated_map(addresses):
        assert gate.acquire(timeout=60), "never released"
        return real_map(addresses)

    monkeypatch.setattr(pool._backend, "map_pieces", gated_map)
    chunked_llm.sleep(level=1)
    chunked_llm.wake_up()
    now = pool.stats().chunks[KV_CACHE]
    assert now["ready"] == 1 and now["total"] == total and now["mapping"] and now["chunk_ready_ms"] == []
    # The mapper waits at its first piece until the gate opens; the sleep below must wait for that piece.
    opener = threading.Timer(1.0, lambda: [gate.release() for _ in range(10_000)])
    opener.start()
    try:
        report = chunked_llm.sleep(level=1)
    finally:
        opener.join()
    found = report.timings["pool"]["kv_mapper"][KV_CACHE]
    assert found["ready"] == 1 and found["mapping"] and found["total"] == total
    assert {"stop_kv_mapper", "state"} <= set(report.timings["pool"]["phases_ms"])
    assert pool.stats().chunks[KV_CACHE]["ready"] == 0 and not pool.stats().chunks[KV_CACHE]["mapping"]

    chunked_llm.wake_up()
    assert pool.wait_chunks(KV_CACHE, total + 1, timeout=30) == total  # returns once the mapper ended
    done = pool.stats().chunks[KV_CACHE]
    assert not done["mapping"] and done["error"] is None
    assert len(done["chunk_ready_ms"]) == total - 1 and done["ran_ms"] + 1e-3 >= done["chunk_ready_ms"][-1]


def test_chunks_joining_keep_the_prefix_cache_and_every_block_comes_back(chunked_llm, monkeypatch):
    """After a wake, blocks of chunks mapped later join as fresh blocks without disturbing those a request
    already used: a cached prefix still hits once every chunk is in, and every block is free again."""
    core = chunked_llm.engine
    pool, blocks, total = core.pool, core.blocks, len(core.kv_plan.chunk_bounds) - 1
    prompt = ("The printing press spread across Europe within fifty years of its invention, and books that "
              "had been copied by hand for centuries became cheap enough for")  # over 2 blocks of 16 tokens
    reference = chunked_llm.generate(prompt, greedy())[0].outputs[0].token_ids
    gate = threading.Event()
    real_map = pool._backend.map_pieces

    def gated_map(addresses):
        assert gate.wait(timeout=60), "never opened"
        return real_map(addresses)

    monkeypatch.setattr(pool._backend, "map_pieces", gated_map)
    chunked_llm.sleep(level=1)
    chunked_llm.wake_up()
    try:
        assert chunked_llm.generate(prompt, greedy())[0].outputs[0].token_ids == reference
        assert pool.chunks_ready(KV_CACHE) == 1  # it ran in the first chunk alone
    finally:
        gate.set()
    assert pool.wait_chunks(KV_CACHE, total + 1, timeout=30) == total
    hits = blocks.stats.hit_tokens
    assert chunked_llm.generate(prompt, greedy())[0].outputs[0].token_ids == reference
    assert blocks.stats.hit_tokens >= hits + core.kv_plan.block_size  # the prefix cached in chunk 0 hit
    assert blocks.mapped == core.kv_plan.num_blocks
    assert blocks.num_used == 0 and blocks.num_free == core.kv_plan.num_blocks - 1
