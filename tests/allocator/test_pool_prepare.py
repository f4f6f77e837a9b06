"""Host backups prepared ahead of the first sleep, in the background (MemoryPool.prepare_backups), on
the real CPU backend: unlinked backup files whose disk blocks are reserved before the first sleep."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from allocator import MemoryPool, PoolError
from allocator.host import HostBackend

MiB = 1 << 20


class GatedBackend(HostBackend):
    """The real CPU backend whose background preparation waits for a gate, so a test can sleep
    while a preparation is still running."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail: PoolError | None = None

    def prepare_backup(self, tag: str) -> int:
        self.entered.set()
        self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return super().prepare_backup(tag)


def weights(pool: MemoryPool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = []
    for shape in ((300, 257), (4 * MiB // 4,)):
        t = pool.empty(shape, torch.float32, "weights")
        t.copy_(torch.randn(shape, generator=g))
        out.append(t)
    return out


def test_prepared_backup_is_reserved_before_the_first_sleep_and_restores_bit_exact(tmp_path):
    pool = MemoryPool(HostBackend(tmp_path))
    try:
        tensors = weights(pool)
        expected = [t.clone() for t in tensors]
        nbytes = pool.prepare_backups(["weights", "never_allocated"], only_if_room=False)
        assert nbytes == pool.stats().tags["weights"].bytes
        pool.wait_prepared()
        assert pool.prepare_error is None
        assert pool.stats().host_backup_bytes >= nbytes  # the file's blocks are taken already
        pool.sleep(offload_tags=["weights"])
        pool.wake_up()
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
    finally:
        pool.close()


def test_a_sleep_during_the_preparation_waits_for_it_and_is_correct(tmp_path):
    backend = GatedBackend(tmp_path)
    pool = MemoryPool(backend)
    try:
        tensors = weights(pool)
        expected = [t.clone() for t in tensors]
        assert pool.prepare_backups(["weights"], only_if_room=False) > 0
        assert backend.entered.wait(30)
        done = threading.Event()
        errors: list[BaseException] = []

        def sleep() -> None:
            try:
                pool.sleep(offload_tags=["weights"])
            except BaseException as e:  # reported below
                errors.append(e)
            done.set()

        sleeper = threading.Thread(target=sleep)
        sleeper.start()
        # The preparation holds its gate: the sleep must not have used the half-made backup.
        assert not done.wait(0.3)
        assert pool.tag_state("weights") == "awake"
        backend.gate.set()
        sleeper.join(30)
        assert done.is_set() and not errors
        assert pool.tag_state("weights") == "offloaded"
        pool.wake_up()
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
    finally:
        backend.gate.set()
        pool.close()


def test_a_failed_preparation_leaves_the_work_to_the_first_sleep(tmp_path):
    backend = GatedBackend(tmp_path)
    backend.fail = PoolError("no room for the backup")
    backend.gate.set()
    pool = MemoryPool(backend)
    try:
        tensors = weights(pool)
        expected = [t.clone() for t in tensors]
        pool.prepare_backups(["weights"], only_if_room=False)
        pool.wait_prepared()
        assert isinstance(pool.prepare_error, PoolError)
        pool.sleep(offload_tags=["weights"])
        pool.wake_up()
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
    finally:
        pool.close()


def test_auto_prepares_only_when_the_host_has_room(tmp_path, monkeypatch):
    backend = HostBackend(tmp_path)
    pool = MemoryPool(backend, keep_backups=True)
    try:
        kept = weights(pool)  # noqa: F841 (the arenas live as long as their tensors)
        need = pool.stats().tags["weights"].bytes
        monkeypatch.setattr(backend, "backup_room", lambda: int(need / MemoryPool.ROOM_SHARE) - 1)
        assert pool.prepare_backups(["weights"]) == 0
        assert pool.stats().host_backup_bytes == 0
        monkeypatch.setattr(backend, "backup_room", lambda: int(need / MemoryPool.ROOM_SHARE) + 4096)
        assert pool.prepare_backups(["weights"]) == need
        pool.wait_prepared()
        assert pool.stats().host_backup_bytes >= need
    finally:
        pool.close()


def test_auto_does_not_prepare_for_a_pool_that_frees_backups_after_wake(tmp_path):
    pool = MemoryPool(HostBackend(tmp_path), keep_backups=False)  # the CPU default
    try:
        kept = weights(pool)  # noqa: F841
        assert pool.prepare_backups(["weights"]) == 0
        assert pool.prepare_backups(["weights"], only_if_room=False) > 0
    finally:
        pool.close()


def test_asleep_tags_are_not_prepared(tmp_path):
    pool = MemoryPool(HostBackend(tmp_path))
    try:
        kept = weights(pool)  # noqa: F841
        pool.sleep(discard_tags=["weights"])
        assert pool.tag_state("weights") == "discarded"
        assert pool.prepare_backups(["weights"], only_if_room=False) == 0
    finally:
        pool.close()


@pytest.mark.parametrize("value", ["auto", "on", "off"])
def test_engine_config_accepts_prepare_backups(value):
    from server.config import EngineConfig

    assert EngineConfig(prepare_backups=value).prepare_backups == value
    with pytest.raises(ValueError, match="prepare_backups"):
        EngineConfig(prepare_backups="sometimes")


def test_pinned_copies_never_cross_a_registered_piece():
    """PinnedBuffer.spans splits a backup range into copies that each stay inside one registration
    (arithmetic only: the buffer itself needs CUDA)."""
    from allocator.hostmem import PinnedBuffer

    buf = object.__new__(PinnedBuffer)
    buf.ptr, buf.piece_bytes, buf.nbytes = 1 << 40, 8 * MiB, 64 * MiB
    for offset, nbytes in ((0, 20 * MiB), (6 * MiB, 3 * MiB), (7 * MiB, 17 * MiB + 4096), (16 * MiB, 8 * MiB)):
        spans = list(buf.spans(offset, nbytes, chunk_bytes=3 * MiB))
        assert sum(n for _, _, n in spans) == nbytes
        at = offset
        for host, start, n in spans:
            assert host == buf.ptr + at and start == at - offset and 0 < n <= 3 * MiB
            assert (at // buf.piece_bytes) == ((at + n - 1) // buf.piece_bytes)
            at += n
