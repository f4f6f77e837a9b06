"""The sleepable pool on a real GPU: cuMem mappings, pinned backups, CUDA graphs, footprint.

Run with `pytest -m gpu tests/gpu/test_pool_gpu.py` on a CUDA host. Some checks need a process
that has never touched CUDA (footprint, expandable segments): they run this file as a script in
a subprocess (`python tests/gpu/test_pool_gpu.py <scenario>`) that prints one JSON line.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from allocator import PoolError, create_pool  # noqa: E402
from testkit.cuda_pool import capture, free_bytes, host_rss  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MiB, GiB = 1 << 20, 1 << 30


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8).clone()


@pytest.fixture
def pool():
    p = create_pool("cuda")
    yield p
    p.close()
    gc.collect()
    torch.cuda.empty_cache()


class MLP(torch.nn.Module):
    def __init__(self, width: int = 1024, hidden: int = 4096) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.nn.functional.gelu(self.up(x))) + x)


# ---------------------------------------------------------------------------- in-process tests


def test_offload_restores_bit_exact_at_the_same_addresses(pool):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = pool.empty((256, MiB // 2), torch.bfloat16, "weights")  # 256 MiB
    a.copy_(torch.randn(a.shape, generator=g, device="cuda").to(torch.bfloat16))
    a[0, 0] = float("nan")
    b = pool.empty((3, 5, 7), torch.int64, "weights")
    b.copy_(torch.arange(105, device="cuda").view(3, 5, 7))
    view = a[10:20, 100:200]
    ptrs = (a.data_ptr(), b.data_ptr(), view.data_ptr())
    before = [raw(a), raw(b), raw(view)]

    free0 = free_bytes()
    report = pool.sleep(offload_tags=["weights"])
    assert report.bytes_offloaded >= 256 * MiB
    assert free_bytes() - free0 >= 0.95 * report.bytes_offloaded
    assert pool.tag_state("weights") == "offloaded"
    assert pool.stats().host_backup_bytes >= report.bytes_offloaded

    wake = pool.wake_up()
    assert wake.bytes_restored == report.bytes_offloaded
    assert (a.data_ptr(), b.data_ptr(), view.data_ptr()) == ptrs
    for t, expected in zip((a, b, view), before):
        assert torch.equal(raw(t), expected)


def test_discard_releases_device_memory_and_the_tag_is_usable_after_wake(pool):
    kv = pool.empty((2 * GiB,), torch.uint8, "kv_cache")
    kv.fill_(1)
    free0 = free_bytes()
    report = pool.sleep(discard_tags=["kv_cache"])
    assert report.bytes_discarded >= 2 * GiB
    asleep_free = free_bytes()
    assert asleep_free - free0 >= 2 * GiB - 64 * MiB
    pool.wake_up(["kv_cache"])
    assert asleep_free - free_bytes() >= 2 * GiB - 64 * MiB
    kv.fill_(3)
    assert int(kv[:: 4 * MiB].sum()) == 3 * (2 * GiB // (4 * MiB))


def test_use_routes_every_torch_allocation_and_tags_never_mix(pool):
    # Small tensors of two tags, interleaved: torch packs small blocks into shared 2 MiB
    # segments, so mixing would show up here.
    with pool.use("weights"):
        w = [torch.full((1000,), float(i), device="cuda") for i in range(20)]
        prod = w[0].view(10, 100) @ w[1].view(100, 10)
    with pool.use("kv_cache"):
        kv = [torch.full((1000,), -float(i), device="cuda") for i in range(20)]
        with pool.use("scratch"):  # nesting: the innermost tag wins
            s = torch.ones(10, device="cuda")
        k2 = torch.zeros(10, device="cuda")
    outside = torch.ones(10, device="cuda")
    assert {pool.tag_of(t) for t in w + [prod]} == {"weights"}
    assert {pool.tag_of(t) for t in kv + [k2]} == {"kv_cache"}
    assert pool.tag_of(s) == "scratch" and pool.tag_of(outside) is None
    pool._backend.verify(["weights", "kv_cache", "scratch"])  # torch's view of each MemPool agrees

    pool.sleep(discard_tags=["weights"])
    for i, t in enumerate(kv):  # another tag's memory stayed mapped and intact
        assert torch.equal(t, torch.full((1000,), -float(i), device="cuda"))
        t.add_(1)
    pool.wake_up()
    torch.cuda.synchronize()


def test_adopt_keeps_module_outputs(pool):
    torch.manual_seed(0)
    model = MLP().cuda().eval()
    x = torch.randn(8, 1024, device="cuda")
    with torch.no_grad():
        reference = model(x)
        pool.adopt(model, "weights")
        assert all(pool.tag_of(p) == "weights" for p in model.parameters())
        assert torch.equal(model(x), reference)
        pool.sleep(offload_tags=["weights"])
        pool.wake_up()
        assert torch.equal(model(x), reference)


def test_cuda_graph_memory_lives_in_the_pool_and_replays_after_wake(pool):
    torch.manual_seed(0)
    model = MLP().cuda().to(torch.bfloat16).eval()
    pool.adopt(model, "weights")
    host_weights = {n: p.detach().cpu() for n, p in model.named_parameters()}
    graph, static_x, static_y = capture(pool, model, (16, 1024))
    reference = static_y.clone()
    assert pool.tag_of(static_y) == "cuda_graph"
    assert pool.stats().tags["cuda_graph"].bytes > static_x.numel() * 2
    pool._backend.verify(["weights", "cuda_graph"])  # the capture's segments are all recorded as ours

    # Level 1: weights offloaded, graph memory offloaded, KV discarded.
    kv = pool.empty((GiB,), torch.uint8, "kv_cache")
    pool.sleep(offload_tags=["weights", "cuda_graph"], discard_tags=["kv_cache"])
    pool.wake_up()
    static_y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, reference)

    # Level 2: weights discarded, then reloaded in place (RLHF weight update) before replay.
    pool.sleep(offload_tags=["cuda_graph"], discard_tags=["weights", "kv_cache"])
    pool.wake_up(["weights"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(host_weights[name])
    pool.wake_up()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, reference)
    del kv


def test_pipelined_groups_restore_bit_exact(pool):
    backend = pool._backend
    backend.group_bytes = 24 * MiB  # several groups released (and mapped) while other copies run
    g = torch.Generator(device="cuda").manual_seed(1)
    weights = [pool.empty((n,), torch.uint8, "weights") for n in [8 * MiB] * 12 + [100 * MiB, 3 * MiB + 5]]
    for t in weights:
        t.copy_(torch.randint(0, 256, t.shape, generator=g, device="cuda", dtype=torch.uint8))
    graph_mem = pool.empty((2 * MiB,), torch.uint8, "cuda_graph")
    graph_mem.fill_(7)
    kv = pool.empty((256 * MiB,), torch.uint8, "kv_cache")
    expected = [raw(t) for t in weights]
    ptrs = [t.data_ptr() for t in weights]
    free0 = free_bytes()
    for _ in range(2):
        report = pool.sleep(offload_tags=["weights", "cuda_graph"], discard_tags=["kv_cache"])
        assert report.bytes_discarded >= 256 * MiB
        assert free_bytes() - free0 >= 0.95 * (report.bytes_offloaded + report.bytes_discarded)
        assert not any(a.mapped for a in backend._lib.list(backend._ns))  # every byte released
        pool.wake_up()
        kv.fill_(1)
        assert [t.data_ptr() for t in weights] == ptrs
        assert all(torch.equal(raw(t), e) for t, e in zip(weights, expected))
        assert int(graph_mem[:: 64 * 1024].sum()) == 7 * 32


def test_unmap_ptrs_refuses_foreign_addresses_before_releasing_anything(pool):
    w = pool.empty((4 * MiB,), torch.uint8, "weights")
    lib = pool._backend._lib
    with pytest.raises(PoolError, match="not an allocation of this pool"):
        lib.unmap_ptrs([w.data_ptr(), 0x1000])
    assert all(a.mapped for a in lib.list(pool._backend._ns))
    w.fill_(1)
    torch.cuda.synchronize()


def test_sleep_gives_back_grown_local_memory_and_wake_restores_it(pool):
    ctx = pool._backend._ctx
    base = pool._backend._stack_base
    w = pool.empty((64 * MiB,), torch.uint8, "weights")
    ctx.set_stack_size(8 * 1024)  # what the driver does when a kernel needs a deep stack
    w.fill_(3)
    grown_free = free_bytes()
    pool.sleep(offload_tags=["weights"])
    assert ctx.stack_size() == base
    # (8 KiB - base) for every thread the device can hold: far more than the 64 MiB offloaded.
    assert free_bytes() - grown_free >= 64 * MiB + 16 * MiB
    pool.wake_up()
    assert ctx.stack_size() == 8 * 1024
    assert abs(free_bytes() - grown_free) <= 8 * MiB
    assert int(w[:: MiB].sum()) == 3 * 64
    ctx.set_stack_size(base)


def test_failed_wake_rolls_back_and_a_later_wake_succeeds(pool):
    weights = pool.empty((512 * MiB,), torch.uint8, "weights")
    weights.copy_(torch.randint(0, 256, weights.shape, device="cuda", dtype=torch.uint8))
    expected = raw(weights)
    free0 = free_bytes()
    kv = pool.empty((free0 // 4,), torch.uint8, "kv_cache")
    pool.sleep(offload_tags=["weights"], discard_tags=["kv_cache"])
    asleep_free = free_bytes()

    # Something else takes the memory while the pool sleeps: room for weights, not for kv.
    hog = torch.empty((asleep_free - kv.numel() // 2,), dtype=torch.uint8, device="cuda")
    with pytest.raises(PoolError, match="OUT_OF_MEMORY") as info:
        pool.wake_up()  # weights map and restore first, then kv fails
    assert "rolled back" in str(info.value)
    assert pool.sleeping_tags() == {"weights": "offloaded", "kv_cache": "discarded"}
    del hog
    torch.cuda.empty_cache()
    assert free_bytes() >= asleep_free - 64 * MiB  # the weights mapped before the failure were released

    pool.wake_up()
    assert torch.equal(raw(weights), expected)
    kv.fill_(1)
    torch.cuda.synchronize()


def test_keep_backups_false_frees_pinned_memory_after_wake():
    pool = create_pool("cuda", keep_backups=False)
    try:
        w = pool.empty((64 * MiB,), torch.uint8, "weights")
        w.fill_(9)
        pool.sleep(offload_tags=["weights"])
        assert pool.stats().host_backup_bytes >= 64 * MiB
        pool.wake_up()
        assert pool.stats().host_backup_bytes == 0
        assert int(w[:: MiB].sum()) == 9 * 64
    finally:
        pool.close()


def test_stats_on_cuda(pool):
    w = pool.empty((100 * MiB,), torch.uint8, "weights")
    stats = pool.stats()
    assert stats.backend == "cuda-vmm" and stats.device.startswith("cuda")
    assert stats.tags["weights"].bytes >= 100 * MiB and stats.tags["weights"].allocations >= 1
    assert 0 < stats.device_free < stats.device_total
    json.dumps(stats.as_dict())
    pool.sleep(discard_tags=["weights"])
    assert pool.stats().tags["weights"].state == "discarded"
    pool.wake_up()
    del w


def test_fifty_cycles_leak_nothing_on_device_or_host(pool):
    weights = pool.empty((256 * MiB,), torch.uint8, "weights")
    weights.copy_(torch.randint(0, 256, weights.shape, device="cuda", dtype=torch.uint8))
    expected = raw(weights).cpu()
    kv = pool.empty((GiB,), torch.uint8, "kv_cache")
    # Alive through every cycle, outside the pool (as an engine's small eager tensors are): sleep must
    # not count the segment it keeps as torch's cache to give back on wake, or each wake grows torch's
    # cache by that segment's size (with the old accounting: 20 MiB or more a cycle).
    outside = torch.ones(4 * MiB, dtype=torch.uint8, device="cuda")

    def cycle() -> None:
        pool.sleep(offload_tags=["weights"], discard_tags=["kv_cache"])
        pool.wake_up()
        kv.fill_(1)
        torch.cuda.synchronize()

    for _ in range(2):
        cycle()
    gc.collect()
    device0, host0 = free_bytes(), host_rss()
    reserved0, pool0 = torch.cuda.memory_reserved(), pool.stats().tags
    lost = []  # device bytes lost every 10 cycles: a one-off step and a steady leak look different
    for i in range(50):
        cycle()
        if i % 10 == 9:
            lost.append((device0 - free_bytes()) // MiB)
    gc.collect()
    # Said on failure: whether torch's caching allocator or the pool's own tags grew, or neither
    # (then the driver or a library outside both holds the bytes).
    where = (f"MiB lost after 10..50 cycles {lost}; torch reserved {reserved0 // MiB} -> "
             f"{torch.cuda.memory_reserved() // MiB} MiB; pool tags before {pool0} after {pool.stats().tags}")
    assert device0 - free_bytes() < 8 * MiB, f"device memory leaked over 50 cycles: {where}"
    assert torch.cuda.memory_reserved() - reserved0 < 8 * MiB, f"torch's cache grew: {where}"
    assert int(outside.sum()) == 4 * MiB
    assert host_rss() - host0 < 64 * MiB, "host memory leaked over 50 cycles"
    assert torch.equal(raw(weights).cpu(), expected)


# ---------------------------------------------------------------------------- subprocess tests


def run_scenario(name: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, name], cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, f"scenario {name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_full_sleep_leaves_no_more_than_a_process_that_ran_the_same_kernels():
    """Invariant 1, measured against the right floor. A process that ran cuBLAS GEMMs and a CUDA
    graph holds ~230 MiB more than a bare context on an H200 even with every tensor freed (kernel
    code loaded on first use, cuBLAS handles, the graph): nothing a sleep can release while the
    context lives. What the sleeping pool holds beyond that process is what this test bounds;
    `overhead` (against a bare context) is in the message for the record."""
    result = run_scenario("footprint")
    assert result["pool_overhead"] <= 64 * MiB, result
    assert result["asleep_free"] - result["awake_free"] >= 3 * GiB  # the pool really held memory


def test_expandable_segments_env_still_pools_everything():
    result = run_scenario("expandable", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert result["tags"] == ["cuda_graph", "weights"], result
    assert result["freed"] >= 0.95 * result["pooled"], result
    assert result["bit_exact"] and result["graph_equal"], result


def reference_kernels(index: int):
    """scenario_footprint's kernels without a pool (for footprint.reference_process_used)."""
    torch.manual_seed(0)
    model = MLP(2048, 8192).cuda(index).to(torch.bfloat16).eval()
    with torch.no_grad():
        model(torch.randn(64, 2048, device=f"cuda:{index}", dtype=torch.bfloat16))
    graph, _, _ = capture(None, model, (32, 2048))
    return graph


def scenario_footprint() -> dict:
    from testkit import footprint as probe

    index = 0
    bare_alone = probe.bare_process_used(index)  # before this process touches CUDA
    reference_alone = probe.reference_process_used(index, "test_pool_gpu", "reference_kernels",
                                                   [str(Path(__file__).resolve().parent), str(REPO)])
    pool = create_pool(f"cuda:{index}")
    torch.manual_seed(0)
    model = MLP(2048, 8192).cuda().to(torch.bfloat16).eval()
    pool.adopt(model, "weights")
    with pool.use("weights"):
        big = torch.empty((GiB,), dtype=torch.uint8, device="cuda")
    kv = pool.empty((2 * GiB,), torch.uint8, "kv_cache")
    with torch.no_grad():
        eager = model(torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16))  # cuBLAS, default pool
    graph, _, _ = capture(pool, model, (32, 2048))
    del eager
    torch.cuda.synchronize()
    awake_free = torch.cuda.mem_get_info(index)[0]
    pool.sleep(offload_tags=["weights", "cuda_graph"], discard_tags=["kv_cache"])
    fp = probe.footprint(index, bare_alone, reference_alone)
    asleep_free = torch.cuda.mem_get_info(index)[0]
    pool.wake_up()
    graph.replay()
    torch.cuda.synchronize()
    del big, kv
    return {**fp.as_dict(), "awake_free": awake_free, "asleep_free": asleep_free}


def scenario_expandable() -> dict:
    pool = create_pool("cuda")
    torch.manual_seed(0)
    model = MLP().cuda().eval()
    pool.adopt(model, "weights")
    w = pool.empty((512 * MiB,), torch.uint8, "weights")
    w.copy_(torch.randint(0, 256, w.shape, device="cuda", dtype=torch.uint8))
    expected = raw(w)
    graph, _, static_y = capture(pool, model, (16, 1024), torch.float32)
    reference = static_y.clone()
    tags = sorted(t for t, s in pool.stats().tags.items() if s.bytes > 0)
    pooled = sum(s.bytes for s in pool.stats().tags.values())
    free0 = free_bytes()
    pool.sleep(offload_tags=["weights", "cuda_graph"])
    freed = free_bytes() - free0
    pool.wake_up()
    static_y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return {
        "tags": tags,
        "pooled": pooled,
        "freed": freed,
        "bit_exact": bool(torch.equal(raw(w), expected)),
        "graph_equal": bool(torch.equal(static_y, reference)),
    }


if __name__ == "__main__":
    scenarios = {"footprint": scenario_footprint, "expandable": scenario_expandable}
    print(json.dumps(scenarios[sys.argv[1]]()))


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel-copy", "copy-engine"])
def test_wake_restores_every_byte_by_kernel_or_copy_engine(pool, kernel):
    """A wake's host-to-device copies run as a kernel reading the mapped pinned backup (the default:
    the copy engines slow down right after a big release) or by the copy engines
    (SLEEPSERVE_WAKE_COPY=engine); both restore every byte, big and small allocations alike."""
    copier = pool._backend._copier
    copier.kernel_restore = kernel
    sizes = [96 * MiB + 4096, 2 * MiB, 130 * MiB, 1]
    ws = [pool.empty((n,), torch.uint8, "weights") for n in sizes]
    for w in ws:
        w.copy_(torch.randint(0, 256, w.shape, device="cuda", dtype=torch.uint8))
    expected = [raw(w).cpu() for w in ws]
    for _ in range(2):
        pool.sleep(offload_tags=["weights"])
        pool.wake_up()
        for w, e in zip(ws, expected):
            assert torch.equal(raw(w).cpu(), e)
    # The kernel path really ran (not a silent fall-back to the copy engines), and only when asked.
    assert (copier.kernel_copies > 0) == kernel


def test_the_wake_copy_is_chosen_once_by_timing_both(pool):
    """Copier.calibrate (SLEEPSERVE_WAKE_COPY=auto, the default): it times 256 MiB of a backup into scratch device
    memory by the copy kernel and by the copy engines, keeps the kernel by kernel_reads_fast_enough's rule, leaves
    the wakes' kernel-copy count alone and measures only once."""
    from allocator.backup import Copier, PinnedBackup, kernel_reads_fast_enough

    ctx = pool._backend._ctx
    backup, copier = PinnedBackup(ctx), Copier(ctx)
    copier.kernel_restore = None  # auto, whatever this environment sets
    try:
        backup.reserve(256 * MiB)
        copier.calibrate(backup)
        measured = copier.calibration
        assert measured is not None and measured["kernel_gbps"] > 1 and measured["engines_gbps"] > 1, measured
        assert copier.kernel_restore == kernel_reads_fast_enough(measured["kernel_gbps"], measured["engines_gbps"])
        assert copier.kernel_copies == 0
        copier.calibrate(backup)
        assert copier.calibration is measured
        print(measured)
    finally:
        copier.close()
        backup.release()
