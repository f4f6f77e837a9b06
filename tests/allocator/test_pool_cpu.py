"""The sleepable pool's state machine on its CPU backend (real mmap arenas, real RSS, real files)."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch

from allocator import MemoryPool, PoolError, create_pool

MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for bit-exact comparisons (NaN payloads and -0.0 included)."""
    return t.contiguous().view(-1).view(torch.uint8).clone()


@pytest.fixture
def pool(tmp_path: Path):
    p = create_pool("cpu", backup_dir=tmp_path / "backups")
    yield p
    p.close()


def fill(pool: MemoryPool, tag: str, shape, dtype, seed: int) -> torch.Tensor:
    t = pool.empty(shape, dtype, tag)
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t.copy_(torch.randn(shape, generator=g).to(dtype))
    else:
        t.copy_(torch.randint(-100, 100, shape, generator=g).to(dtype))
    return t


def test_offloaded_tensors_keep_addresses_and_come_back_bit_exact(pool):
    tensors = [
        fill(pool, "weights", (257, 129), torch.float32, 0),
        fill(pool, "weights", (1000,), torch.bfloat16, 1),
        fill(pool, "weights", (33, 7), torch.int64, 2),
        fill(pool, "weights", (5,), torch.uint8, 3),
    ]
    tensors[0][0, 0] = float("nan")
    tensors[0][0, 1] = -0.0
    view = tensors[0][10:20, 3:9]  # a view must survive too
    ptrs = [t.data_ptr() for t in tensors] + [view.data_ptr()]
    before = [raw(t) for t in tensors] + [raw(view)]

    report = pool.sleep(offload_tags=["weights"])
    assert report.bytes_offloaded >= sum(t.numel() * t.element_size() for t in tensors)
    assert report.bytes_discarded == 0
    assert pool.tag_state("weights") == "offloaded"
    assert pool.sleeping_tags() == {"weights": "offloaded"}

    wake = pool.wake_up()
    assert wake.bytes_restored == report.bytes_offloaded
    assert pool.tag_state("weights") == "awake"
    assert [t.data_ptr() for t in tensors] + [view.data_ptr()] == ptrs
    for t, b in zip(tensors + [view], before):
        assert torch.equal(raw(t), b)


def test_discarded_tag_is_released_and_wakes_as_zeros(pool):
    kv = fill(pool, "kv_cache", (64, 1024), torch.float16, 4)
    ptr = kv.data_ptr()
    report = pool.sleep(discard_tags="kv_cache")
    assert report.bytes_discarded >= kv.numel() * 2 and report.bytes_offloaded == 0
    assert pool.tag_state("kv_cache") == "discarded"
    assert pool.stats().host_backup_bytes == 0  # nothing was backed up
    pool.wake_up(["kv_cache"])
    assert kv.data_ptr() == ptr
    assert torch.count_nonzero(kv) == 0


def test_rss_falls_by_at_least_90_percent_of_slept_bytes(pool):
    size = 256 * MiB
    weights = pool.empty(size, torch.uint8, "weights")
    kv = pool.empty(size, torch.uint8, "kv_cache")
    pages = weights.view(-1, 4096)  # touch every page with content that differs per page
    pages.copy_(torch.arange(4096, dtype=torch.int32).to(torch.uint8).expand_as(pages))
    pages[:, 0] = torch.arange(pages.shape[0], dtype=torch.int32).to(torch.uint8)
    pages[:, 1] = (torch.arange(pages.shape[0], dtype=torch.int32) >> 8).to(torch.uint8)
    kv.fill_(7)
    checksum = int(weights.view(torch.int64).sum())
    sample = raw(pages[::97])
    gc.collect()

    before = rss()
    pool.sleep(offload_tags=["weights"], discard_tags=["kv_cache"])
    after = rss()
    assert before - after >= 0.9 * 2 * size, f"RSS fell {(before - after) / MiB:.0f} MiB of {2 * size / MiB:.0f}"

    pool.wake_up()
    assert int(weights.view(torch.int64).sum()) == checksum
    assert torch.equal(raw(pages[::97]), sample)
    assert rss() - after >= 0.9 * size  # the offloaded tag is resident again


def test_100_cycles_grow_rss_by_less_than_32_mib(pool):
    weights = fill(pool, "weights", (2 * MiB,), torch.float32, 5)  # 8 MiB offloaded per cycle
    kv = pool.empty((32 * MiB,), torch.uint8, "kv_cache")  # 32 MiB discarded per cycle
    expected = raw(weights)

    def cycle() -> None:
        pool.sleep(offload_tags=["weights"], discard_tags=["kv_cache"])
        pool.wake_up()
        kv.fill_(1)  # the engine writes the KV cache again after each wake

    for _ in range(3):  # let allocator caches and the backup file reach their steady state
        cycle()
    gc.collect()
    start = rss()
    for _ in range(100):
        cycle()
    gc.collect()
    growth = rss() - start
    assert growth < 32 * MiB, f"RSS grew {growth / MiB:.1f} MiB over 100 cycles"
    assert torch.equal(raw(weights), expected)


def test_backups_have_no_name_and_survive_a_cleaned_folder(pool, tmp_path):
    a = fill(pool, "weights", (300, 300), torch.float32, 6)
    b = fill(pool, "lora", (100, 300), torch.float32, 7)
    a_bytes, b_bytes = raw(a), raw(b)
    pool.sleep(offload_tags=["weights", "lora"])

    # Nothing in the folder to find, follow or delete; a temp cleaner removes the folder itself.
    backups = tmp_path / "backups"
    assert not list(backups.iterdir())
    held = [os.readlink(f"/proc/self/fd/{b.fd}") for b in pool._backend.backups.values()]
    assert len(held) == 2 and all(t.startswith(str(backups)) and "(deleted)" in t for t in held), held
    backups.rmdir()
    pool.wake_up()
    assert torch.equal(raw(a), a_bytes) and torch.equal(raw(b), b_bytes)
    assert pool.stats().host_backup_bytes == 0  # CPU pools keep no backup while awake


def test_failure_half_way_releases_the_tags_already_restored(pool, tmp_path):
    a = fill(pool, "weights", (512, 1024), torch.float32, 8)  # 2 MiB
    b = fill(pool, "lora", (256, 1024), torch.float32, 9)
    a_bytes, b_bytes = raw(a), raw(b)
    pool.sleep(offload_tags=["weights", "lora"])

    lora_file = Path(f"/proc/self/fd/{pool._backend.backups['lora'].fd}")  # the unlinked backup file
    saved = lora_file.read_bytes()
    os.truncate(lora_file, len(saved) // 2)  # truncated behind our back
    gc.collect()
    asleep_rss = rss()
    with pytest.raises(PoolError, match="ends .* bytes early"):
        pool.wake_up(["weights", "lora"])  # weights restores first, then lora fails
    assert pool.tag_state("weights") == "offloaded" and pool.tag_state("lora") == "offloaded"
    assert rss() - asleep_rss < MiB  # weights' restored pages were released again

    with open(lora_file, "r+b") as f:
        f.write(saved)
    report = pool.wake_up(["weights", "lora"])
    assert report.bytes_restored >= a.numel() * 4 + b.numel() * 4
    assert torch.equal(raw(a), a_bytes) and torch.equal(raw(b), b_bytes)


def test_sleeping_a_sleeping_tag_and_waking_an_awake_one_are_noops(pool):
    w = fill(pool, "weights", (64, 64), torch.float32, 10)
    expected = raw(w)
    assert pool.wake_up(["weights"]).bytes_mapped == 0  # awake already
    pool.sleep(offload_tags=["weights"])
    again = pool.sleep(offload_tags=["weights"])
    assert (again.bytes_offloaded, again.bytes_discarded) == (0, 0)
    assert pool.sleep(discard_tags=["weights"]).bytes_discarded == 0  # no state change either
    assert pool.tag_state("weights") == "offloaded"
    pool.wake_up()
    assert pool.wake_up().bytes_mapped == 0
    assert torch.equal(raw(w), expected)

    # Tags without allocations: harmless, and they stay awake.
    assert pool.sleep(offload_tags=["cuda_graph"], discard_tags=["nothing"]).bytes_discarded == 0
    assert pool.tag_state("cuda_graph") == "awake" and pool.tag_state("never_used") == "awake"
    assert pool.wake_up(["cuda_graph"]).bytes_mapped == 0


def test_adopt_moves_parameters_and_buffers_and_keeps_outputs(pool):
    torch.manual_seed(0)
    embed = torch.nn.Embedding(50, 32)
    head = torch.nn.Linear(32, 50, bias=False)
    head.weight = embed.weight  # tied
    model = torch.nn.Sequential(embed, torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.GELU(), head)
    model.eval()
    x = torch.randint(0, 50, (8,))
    reference = model(x)
    params = list(model.parameters())

    pool.adopt(model, "weights")
    assert list(model.parameters()) == params  # same Parameter objects
    assert model[0].weight is model[4].weight  # still tied
    assert torch.equal(model(x), reference)
    n_tensors = len(params) + 3  # BatchNorm buffers: running_mean, running_var, num_batches_tracked
    stats = pool.stats().tags["weights"]
    assert stats.allocations == n_tensors
    assert all(pool.tag_of(b) == "weights" for b in model[2].buffers())  # buffers moved too

    pool.sleep(offload_tags=["weights"])
    pool.wake_up()
    assert torch.equal(model(x), reference)


def test_stats_report_bytes_allocations_states_and_backups(tmp_path):
    pool = create_pool("cpu", backup_dir=tmp_path, keep_backups=True)
    try:
        # Held: an arena lives exactly as long as a tensor views it.
        held = [
            pool.empty((1024, 1024), torch.float32, "weights"),  # 4 MiB
            pool.empty((10,), torch.float32, "weights"),  # one page
            pool.empty((3 * MiB,), torch.uint8, "kv_cache"),
        ]
        for t in held:
            t.fill_(5)
        stats = pool.stats()
        assert stats.backend == "cpu-mmap" and stats.device == "cpu"
        assert stats.tags["weights"].bytes == 4 * MiB + os.sysconf("SC_PAGESIZE")
        assert stats.tags["weights"].allocations == 2
        assert stats.tags["kv_cache"].bytes == 3 * MiB
        assert 0 < stats.device_free <= stats.device_total
        json.dumps(stats.as_dict())  # JSON-friendly for GET /memory

        pool.sleep(offload_tags=["weights"], discard_tags=["kv_cache"])
        stats = pool.stats()
        assert stats.tags["weights"].state == "offloaded"
        assert stats.tags["kv_cache"].state == "discarded"
        assert stats.tags["weights"].bytes == 4 * MiB + os.sysconf("SC_PAGESIZE")  # still reserved
        assert stats.host_backup_bytes == stats.tags["weights"].bytes

        pool.wake_up()
        assert pool.stats().host_backup_bytes == stats.host_backup_bytes  # kept for the next sleep
        pool.release_backups()
        assert pool.stats().host_backup_bytes == 0 and not list(tmp_path.iterdir())
        # Releasing the backups of awake tags leaves their memory alone: weights restored, KV zeroed.
        assert [pool.tag_of(t) for t in held] == ["weights", "weights", "kv_cache"]
        assert all(bool((t == 5).all()) for t in held[:2]) and not held[2].any()
    finally:
        pool.close()


def test_keep_backups_false_frees_them_after_wake(tmp_path):
    pool = create_pool("cpu", backup_dir=tmp_path, keep_backups=False)
    try:
        w = fill(pool, "weights", (256, 256), torch.float32, 11)
        expected = raw(w)
        pool.sleep(offload_tags=["weights"])
        assert pool.stats().host_backup_bytes > 0
        pool.wake_up()
        assert pool.stats().host_backup_bytes == 0 and not list(tmp_path.iterdir())
        assert torch.equal(raw(w), expected)
    finally:
        pool.close()


def test_use_sets_the_default_tag_of_empty(pool):
    with pytest.raises(PoolError, match="needs a tag"):
        pool.empty((4,), torch.float32)
    with pool.use("weights"):
        a = pool.empty((4,), torch.float32)
        with pool.use("kv_cache"):
            b = pool.empty((4,), torch.float32)
        c = pool.empty((4,), torch.float32)
    tags = pool.stats().tags
    assert tags["weights"].allocations == 2 and tags["kv_cache"].allocations == 1
    assert [pool.tag_of(t) for t in (a, b, c)] == ["weights", "kv_cache", "weights"]
    assert pool.tag_of(a[2:]) == "weights"  # views too
    assert pool.tag_of(torch.zeros(4)) is None  # ordinary memory is not pool memory


def test_asleep_tags_refuse_new_allocations_and_open_uses_block_sleep(pool):
    held = pool.empty((4,), torch.float32, "weights")
    with pool.use("weights"):
        with pytest.raises(PoolError, match="still open"):
            pool.sleep(discard_tags=["weights"])
    pool.sleep(discard_tags=["weights"])
    with pytest.raises(PoolError, match="asleep"):
        pool.empty((4,), torch.float32, "weights")
    with pytest.raises(PoolError, match="wake_up"):
        with pool.use("weights"):
            pass
    pool.wake_up()
    assert pool.empty((4,), torch.float32, "weights").data_ptr() != held.data_ptr()


def test_argument_errors_are_explicit(pool):
    held = pool.empty((4,), torch.float32, "weights")  # noqa: F841 (keeps the tag populated)
    with pytest.raises(PoolError, match="both offloaded and discarded"):
        pool.sleep(offload_tags=["weights"], discard_tags=["weights"])
    with pytest.raises(PoolError, match="invalid tag"):
        pool.empty((4,), torch.float32, "weights/../x")
    with pytest.raises(PoolError, match="CUDA backend"):
        pool.graph_pool("cuda_graph")
    with pytest.raises(PoolError, match="unknown device"):
        create_pool("tpu:banana")


def test_a_dropped_tensor_returns_its_memory(pool):
    keep = pool.empty((MiB,), torch.uint8, "weights")
    keep.fill_(7)
    t = pool.empty((64 * MiB,), torch.uint8, "weights")
    t.fill_(1)
    gc.collect()
    before = rss()
    del t
    gc.collect()
    assert before - rss() >= 60 * MiB
    assert pool.stats().tags["weights"].allocations == 1
    assert pool.sleep(offload_tags=["weights"]).bytes_offloaded == MiB  # only the live tensor
    pool.wake_up()
    assert pool.tag_of(keep) == "weights" and bool((keep == 7).all())


def test_close_releases_everything(tmp_path):
    pool = create_pool("cpu", backup_dir=tmp_path)
    t = pool.empty((32 * MiB,), torch.uint8, "weights")
    t.fill_(3)
    pool.sleep(offload_tags=["weights"])
    backup_fd = pool._backend.backups["weights"].fd
    assert os.readlink(f"/proc/self/fd/{backup_fd}").startswith(str(tmp_path))
    pool.close()
    assert not Path(f"/proc/self/fd/{backup_fd}").exists() or not os.readlink(
        f"/proc/self/fd/{backup_fd}").startswith(str(tmp_path))
    with pytest.raises(PoolError, match="closed"):
        pool.empty((4,), torch.float32, "weights")
    pool.close()  # idempotent
