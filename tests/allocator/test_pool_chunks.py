"""Chunked tensors (MemoryPool.empty_chunked) on the real CPU backend: after a discard, a wake maps the
first chunk before it returns and the rest in the background, and a chunk that is not mapped yet is
PROT_NONE: touching it faults, so nothing can read memory the pool has not handed back."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import allocator.pool as pool_module
from allocator import MemoryPool, PoolError
from allocator.host import PAGE, HostBackend

REPO = Path(__file__).resolve().parents[2]
BLOCKS, ROWS, WIDTH = 8, 3, PAGE // 4  # float32: a block is 3 pages
BOUNDS = [0, 2, 5, 8]


class SteppedBackend(HostBackend):
    """The real CPU backend whose background mapping maps one chunk (one piece) per step()."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.steps = threading.Semaphore(0)

    def step(self, chunks: int = 1) -> None:
        for _ in range(chunks):
            self.steps.release()

    def map_pieces(self, addresses):
        assert self.steps.acquire(timeout=60), "the test never released this chunk"
        return super().map_pieces(addresses)


def chunked(pool: MemoryPool) -> torch.Tensor:
    return pool.empty_chunked((BLOCKS, ROWS, WIDTH), torch.float32, "kv_cache", bounds=BOUNDS)


def test_bounds_must_fall_on_the_granularity(tmp_path):
    pool = MemoryPool(HostBackend(tmp_path))
    try:
        with pytest.raises(PoolError, match="rise strictly"):
            pool.empty_chunked((BLOCKS, ROWS, WIDTH), torch.float32, "kv_cache", bounds=[0, 5, 5, 8])
        with pytest.raises(PoolError, match="granularity"):
            pool.empty_chunked((BLOCKS, ROWS, 16), torch.float32, "kv_cache", bounds=[0, 4, 8])
        t = chunked(pool)
        assert pool.chunks_ready("kv_cache") == 3 and pool.tag_of(t) == "kv_cache"
        # Chunked along dim 0: each chunk is one contiguous range, one piece of memory (chunks this
        # small are below MAX_PIECE_BYTES).
        assert pool._chunks["kv_cache"].pieces == [[t[b].data_ptr()] for b in BOUNDS[:-1]]
        with pytest.raises(PoolError, match="already has a chunked tensor"):
            chunked(pool)
        with pytest.raises(PoolError, match="only be discarded"):
            pool.sleep(offload_tags=["kv_cache"])
    finally:
        pool.close()


def test_wake_maps_the_first_chunk_and_the_rest_in_order_in_the_background(tmp_path):
    backend = SteppedBackend(tmp_path)
    pool = MemoryPool(backend)
    try:
        t = chunked(pool)
        ptr = t.data_ptr()
        t.fill_(7.0)
        pool.sleep(discard_tags=["kv_cache"])
        assert pool.chunks_ready("kv_cache") == 0
        pool.wake_up()
        assert pool.tag_state("kv_cache") == "awake" and pool.chunks_ready("kv_cache") == 1
        first = t[:BOUNDS[1]]
        assert torch.count_nonzero(first) == 0  # discarded: zero pages, usable at once
        first.fill_(1.0)
        assert pool.wait_chunks("kv_cache", 2, timeout=0.2) == 1  # chunk 1 waits for its step
        backend.step()
        assert pool.wait_chunks("kv_cache", 2, timeout=30) >= 2
        t[BOUNDS[1]:BOUNDS[2]].fill_(2.0)
        backend.step()
        assert pool.wait_chunks("kv_cache", 3, timeout=30) == 3
        t[BOUNDS[2]:].fill_(3.0)
        assert t.data_ptr() == ptr and t.sum().item() == ROWS * WIDTH * (2 * 1 + 3 * 2 + 3 * 3)
    finally:
        backend.step(4)
        pool.close()


def test_a_sleep_during_the_background_mapping_stops_it_and_the_next_wake_starts_over(tmp_path):
    backend = SteppedBackend(tmp_path)
    pool = MemoryPool(backend)
    try:
        t = chunked(pool)
        pool.sleep(discard_tags=["kv_cache"])
        pool.wake_up()
        backend.step()
        pool.wait_chunks("kv_cache", 2, timeout=30)
        backend.step()  # the mapper may or may not map chunk 2 before the sleep stops it
        pool.sleep(discard_tags=["kv_cache"])
        assert pool.tag_state("kv_cache") == "discarded" and pool.chunks_ready("kv_cache") == 0
        assert pool.wait_chunks("kv_cache", 3, timeout=0.1) == 0  # nothing more comes while asleep
        backend.step(2)
        pool.wake_up()
        assert pool.wait_chunks("kv_cache", 3, timeout=30) == 3
        t.fill_(5.0)
        assert torch.all(t == 5.0)
    finally:
        backend.step(4)
        pool.close()


def test_a_chunk_that_is_not_mapped_yet_cannot_be_read():
    """In a child process: reading the third chunk before the pool maps it kills the reader with
    SIGSEGV; reading the first one works."""
    code = textwrap.dedent(f"""
        import sys, threading, tempfile
        sys.path.insert(0, {str(REPO)!r})
        import torch
        from tests.allocator.test_pool_chunks import SteppedBackend, chunked, BOUNDS
        from allocator import MemoryPool
        from pathlib import Path
        backend = SteppedBackend(Path(tempfile.mkdtemp()))
        pool = MemoryPool(backend)
        t = chunked(pool)
        pool.sleep(discard_tags=["kv_cache"])
        pool.wake_up()
        print("first", float(t[:BOUNDS[1]].sum()), flush=True)
        print("third", float(t[BOUNDS[2]:].sum()), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "first 0.0" in out.stdout, out.stderr[-2000:]
    assert "third" not in out.stdout
    assert out.returncode == -11, (out.returncode, out.stderr[-2000:])


def test_the_mapper_gives_way_while_busy_unless_someone_waits(tmp_path):
    """yield_mapping_while: while busy() the background mapper holds back entirely,
    a thread waiting for chunks makes it map at once, and once idle it maps the rest."""
    pool = MemoryPool(HostBackend(tmp_path))
    busy = threading.Event()
    busy.set()
    pool.yield_mapping_while(busy.is_set)
    try:
        t = chunked(pool)
        pool.sleep(discard_tags=["kv_cache"])
        pool.wake_up()
        time.sleep(0.3)  # a mapper that did not hold back would have mapped both chunks by now
        assert pool.chunks_ready("kv_cache") == 1
        assert pool.wait_chunks("kv_cache", 2, timeout=30) >= 2  # a waiter: mapped while busy
        busy.clear()
        assert pool.wait_chunks("kv_cache", 3, timeout=30) == 3
        t.fill_(4.0)
        assert torch.all(t == 4.0)
    finally:
        pool.close()


class ClearingBackend(HostBackend):
    """The real CPU backend, as if the device went on clearing released memory for `seconds`."""

    def __init__(self, folder: Path, seconds: float) -> None:
        super().__init__(folder)
        self.seconds = seconds

    def clearing_seconds(self, nbytes: int) -> float:
        return self.seconds if nbytes else 0.0


def test_the_mapper_starts_once_the_device_cleared_what_the_sleep_released(tmp_path):
    """A wake right after a sleep maps its first chunk at once and the rest only after the device's
    clearing of the released memory (backend.clearing_seconds from the sleep's end), unless a thread
    waits for chunks, which gets them at once."""
    backend = ClearingBackend(tmp_path, 0.8)
    pool = MemoryPool(backend)
    try:
        t = chunked(pool)
        pool.sleep(discard_tags=["kv_cache"])
        slept = time.perf_counter()
        pool.wake_up()
        time.sleep(0.3)
        assert pool.chunks_ready("kv_cache") == 1
        deadline = time.monotonic() + 30
        while pool.chunks_ready("kv_cache") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # polled: wait_chunks would make the mapper start at once
        assert pool.chunks_ready("kv_cache") == 3
        assert time.perf_counter() - slept >= 0.8
        backend.seconds = 60.0
        pool.sleep(discard_tags=["kv_cache"])
        pool.wake_up()
        assert pool.wait_chunks("kv_cache", 2, timeout=30) >= 2  # a waiter does not wait for the clearing
        assert pool.wait_chunks("kv_cache", 3, timeout=30) == 3
        t.fill_(6.0)
        assert torch.all(t == 6.0)
    finally:
        pool.close()


def test_a_chunk_above_the_largest_piece_is_several_pieces_mapped_in_order(tmp_path, monkeypatch):
    """A chunk bigger than MAX_PIECE_BYTES is made of pieces of at most that size (CUDA: the driver
    releases huge handles slower per GiB, and the background mapper can only give way between pieces);
    the chunk is ready once all of its pieces are mapped, and the wake maps all of chunk 0's."""
    monkeypatch.setattr(pool_module, "MAX_PIECE_BYTES", 2 * PAGE)
    backend = SteppedBackend(tmp_path)
    pool = MemoryPool(backend)
    try:
        t = chunked(pool)  # chunks of 2, 3 and 3 blocks of 3 pages: 6 and 9 pages
        pieces = pool._chunks["kv_cache"].pieces
        sizes = [[backend._piece_owner(a).pieces[a][0] for a in chunk] for chunk in pieces]
        assert sizes == [[2 * PAGE] * 3, [2 * PAGE] * 4 + [PAGE], [2 * PAGE] * 4 + [PAGE]]
        block = ROWS * WIDTH * 4
        for c, (lo, hi) in enumerate(zip(BOUNDS, BOUNDS[1:])):
            starts = [t.data_ptr() + lo * block + sum(sizes[c][:i]) for i in range(len(sizes[c]))]
            assert pieces[c] == starts and sum(sizes[c]) == (hi - lo) * block
        t.fill_(7.0)
        pool.sleep(discard_tags=["kv_cache"])
        pool.wake_up()  # chunk 0's three pieces, not through the stepped background mapper
        assert pool.chunks_ready("kv_cache") == 1
        t[:BOUNDS[1]].fill_(1.0)
        backend.step(4)  # four of chunk 1's five pieces: not ready yet
        assert pool.wait_chunks("kv_cache", 2, timeout=0.2) == 1
        backend.step(1 + 5)
        assert pool.wait_chunks("kv_cache", 3, timeout=30) == 3
        t.fill_(2.0)  # every piece is mapped
        assert torch.all(t == 2.0)
    finally:
        pool.close()


class RecordingBackend(HostBackend):
    """The real CPU backend, recording when each background piece starts and making usage() (what stats()
    reads) take 50 ms, as a foreground call that waits on the registry while the mapper holds it would."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.piece_starts: list[float] = []
        self.usage_spans: list[tuple[float, float]] = []

    def map_pieces(self, addresses):
        self.piece_starts.append(time.perf_counter())
        time.sleep(0.005)
        return super().map_pieces(addresses)

    def usage(self):
        start = time.perf_counter()
        time.sleep(0.05)
        try:
            return super().usage()
        finally:
            self.usage_spans.append((start, time.perf_counter()))


def test_the_mapper_starts_no_piece_while_a_foreground_call_runs(tmp_path, monkeypatch):
    """A foreground pool call (stats, sleep, wake) does not share the backend with a stream of background
    pieces: the mapper finishes the piece at hand and starts the next once the call returned. Calls back to
    back do not starve it either: it maps a piece after each, so a call waits for one piece at most."""
    monkeypatch.setattr(pool_module, "MAX_PIECE_BYTES", PAGE)  # chunks 1 and 2: 9 pieces each
    backend = RecordingBackend(tmp_path)
    pool = MemoryPool(backend)
    try:
        t = chunked(pool)
        pool.sleep(discard_tags=["kv_cache"])
        pool.wake_up()
        backend.usage_spans.clear()
        while pool._chunks["kv_cache"].active:  # foreground reads for as long as the mapper runs
            pool.stats()
        assert pool.chunks_ready("kv_cache") == 3 and len(backend.usage_spans) >= 2
        most = max(sum(a < p < b for p in backend.piece_starts) for a, b in backend.usage_spans)
        assert most <= 1, f"{most} pieces started during one foreground call"
        t.fill_(3.0)
        assert torch.all(t == 3.0)
    finally:
        pool.close()


def test_a_mapper_held_back_by_a_busy_engine_still_waits_for_the_foreground_call_running(tmp_path, monkeypatch):
    """The engine turns idle while a foreground call runs: the mapper, held back until then, waits for that
    call to end before its next piece."""
    monkeypatch.setattr(pool_module, "MAX_PIECE_BYTES", PAGE)
    backend = RecordingBackend(tmp_path)
    pool = MemoryPool(backend)
    busy = threading.Event()
    busy.set()
    pool.yield_mapping_while(busy.is_set)
    try:
        t = chunked(pool)
        pool.sleep(discard_tags=["kv_cache"])
        pool.wake_up()  # chunk 0; the mapper is held back by busy()
        started = len(backend.piece_starts)
        backend.usage_spans.clear()
        threading.Timer(0.02, busy.clear).start()  # the engine turns idle during the call below
        pool.stats()  # 50 ms
        (a, b), = backend.usage_spans
        assert not [p for p in backend.piece_starts[started:] if a < p < b]
        assert pool.wait_chunks("kv_cache", 3, timeout=30) == 3  # and then it maps the rest
        t.fill_(5.0)
        assert torch.all(t == 5.0)
    finally:
        pool.close()
