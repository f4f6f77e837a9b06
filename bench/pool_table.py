"""The sleepable pool's GPU table: 8 GiB of `weights` + 40 GiB of `kv_cache` (+ a CUDA graph).

    python bench/pool_table.py --out bench/results/pool [--weights-gib 8 --kv-gib 40]

Measures, in one run and against references taken in that same run:
  - device free memory before sleep, after sleep and after wake;
  - device memory in use after a full sleep against a bare CUDA process, and against a process
    that ran the same kernels without a pool (testkit/footprint.py);
  - sleep and wake seconds for level 1 (offload weights + graph, discard KV) and level 2 (discard
    weights and KV, offload graph), cycle 1 and the median of cycles >= 2;
  - level-1 effective GB/s (offloaded bytes / whole call) beside the raw pinned copy GB/s;
  - bit-exact restore, CUDA-graph replay identical after wake, and 50 cycles leaking nothing.
Writes pool_table.json and pool_table.md under --out; prints the table. Exit status 1 when a
correctness check fails, and also when a performance target is missed with --strict.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from allocator import MemoryPool, create_pool  # noqa: E402
from testkit import footprint as probe  # noqa: E402
from testkit.cuda_pool import capture, free_bytes, host_rss  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
TARGET_BANDWIDTH_FRACTION = 0.85
TARGET_LEVEL2_SECONDS = 0.050
TARGET_OVERHEAD_BYTES = 64 * MiB


def raw_pinned_bandwidth(index: int, nbytes: int, repeats: int = 5) -> tuple[float, float]:
    """(device->host, host->device) GB/s of one large copy between a device buffer and pinned
    host memory, on a stream of our own: the ceiling the pool's copies are judged against."""
    from allocator import driver

    ctx = driver.DeviceContext(index)
    stream = driver.Stream(ctx)
    host = driver.host_alloc(ctx, nbytes)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
    dev.fill_(1)
    torch.cuda.synchronize(index)
    rates = {"d2h": [], "h2d": []}
    try:
        with ctx.current():
            for _ in range(repeats):
                for kind in ("d2h", "h2d"):
                    start = time.perf_counter()
                    if kind == "d2h":
                        driver.copy_to_host_async(host, dev.data_ptr(), nbytes, stream)
                    else:
                        driver.copy_to_device_async(dev.data_ptr(), host, nbytes, stream)
                    stream.synchronize()
                    rates[kind].append(nbytes / (time.perf_counter() - start) / 1e9)
    finally:
        driver.host_free(ctx, host)
        stream.destroy()
        ctx.release()
        del dev
        torch.cuda.empty_cache()
    return statistics.median(rates["d2h"]), statistics.median(rates["h2d"])


class Model(torch.nn.Module):
    def __init__(self, width: int = 4096) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width, bias=False)
        self.down = torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x))) + x


def reference_workload(index: int):
    """The kernels this benchmark runs, without a pool, for probe.reference_process_used: what
    running them costs a process by itself (module code, cuBLAS handles, the graph it keeps)."""
    dev = f"cuda:{index}"
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.empty(32 * MiB, dtype=torch.uint8, device=dev)
    w.fill_(1)
    w.copy_(torch.randint(0, 256, (32 * MiB,), generator=gen, device=dev, dtype=torch.uint8))
    torch.manual_seed(0)
    model = Model().to(dev).to(torch.bfloat16).eval()
    with torch.no_grad():
        model(torch.randn(64, 4096, device=dev, dtype=torch.bfloat16))
    graph, _, out = capture(None, model, (8, 4096))
    torch.equal(out, out.clone())
    w.cpu()
    return graph


@dataclass
class Cycle:
    sleep_s: float
    wake_s: float
    sleep_copy_s: float
    wake_copy_s: float
    offloaded: int
    restored: int
    free_after_sleep: int
    free_after_wake: int
    sleep_timings: dict
    wake_timings: dict


def run_cycles(pool: MemoryPool, index: int, n: int, offload: list[str], discard: list[str], touch) -> list[Cycle]:
    cycles = []
    backend = pool._backend  # phases and driver-call totals of the last sleep/wake, for the record
    for _ in range(n):
        s = pool.sleep(offload_tags=offload, discard_tags=discard)
        sleep_timings = dict(getattr(backend, "last_timings", {}))
        free_asleep = free_bytes(index)
        w = pool.wake_up()
        wake_timings = dict(getattr(backend, "last_timings", {}))
        free_awake = free_bytes(index)
        touch()
        cycles.append(Cycle(s.seconds, w.seconds, s.copy_seconds, w.copy_seconds,
                            s.bytes_offloaded, w.bytes_restored, free_asleep, free_awake,
                            sleep_timings, wake_timings))
    return cycles


def summary(cycles: list[Cycle], field: str) -> dict[str, float]:
    values = [getattr(c, field) for c in cycles]
    later = values[1:] or values
    return {"cycle1": values[0], "median_after_1": statistics.median(later)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "pool")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--weights-gib", type=float, default=8.0)
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--cycles", type=int, default=5, help="cycles per level (cycle 1 + median of the rest)")
    ap.add_argument("--leak-cycles", type=int, default=50)
    ap.add_argument("--strict", action="store_true", help="exit 1 when a performance target is missed")
    args = ap.parse_args(argv)
    index = args.device
    args.out.mkdir(parents=True, exist_ok=True)

    # Reference 1: a bare CUDA process, measured before this process touches CUDA; and one that
    # ran this benchmark's kernels without a pool (what kernels cost a process by themselves).
    bare_alone = probe.bare_process_used(index)
    reference_alone = probe.reference_process_used(index, "bench.pool_table", "reference_workload", [str(REPO)])
    torch.cuda.set_device(index)
    # Reference 2: raw pinned copy bandwidth, one 2 GiB copy each way.
    raw_d2h, raw_h2d = raw_pinned_bandwidth(index, 2 * GiB)
    print(f"raw pinned copy: D2H {raw_d2h:.1f} GB/s, H2D {raw_h2d:.1f} GB/s", flush=True)

    pool = create_pool(f"cuda:{index}")
    weights, kv = [], []
    chunk = 32 * MiB  # 256 tensors for 8 GiB: the shape of a real checkpoint's layers
    gen = torch.Generator(device=f"cuda:{index}").manual_seed(0)
    for _ in range(int(args.weights_gib * GiB) // chunk):
        t = pool.empty((chunk,), torch.uint8, "weights")
        t.copy_(torch.randint(0, 256, (chunk,), generator=gen, device="cuda", dtype=torch.uint8))
        weights.append(t)
    kv_total = int(args.kv_gib * GiB)
    layer_kv = min(GiB, kv_total)  # one tensor per layer, as a paged KV cache keeps them
    for _ in range(kv_total // layer_kv):
        kv.append(pool.empty((layer_kv,), torch.uint8, "kv_cache"))
    reference = [t.cpu() for t in weights]

    torch.manual_seed(0)
    model = Model().cuda().to(torch.bfloat16).eval()
    pool.adopt(model, "weights")
    model_host = {n: p.detach().cpu() for n, p in model.named_parameters()}
    with torch.no_grad():
        model(torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16))  # eager cuBLAS: cached outside the pool
    graph, _, static_y = capture(pool, model, (8, 4096))
    graph_reference = static_y.clone()
    weight_bytes = pool.stats().tags["weights"].bytes

    def touch_kv() -> None:
        # Serving between cycles. Synchronized, so that this 40 GiB fill (~12 ms of kernels) is
        # not billed to the next sleep, whose first step waits for the device.
        for t in kv:
            t.fill_(1)
        torch.cuda.synchronize(index)

    def weights_exact() -> bool:
        return all(torch.equal(t.cpu(), r) for t, r in zip(weights, reference))

    def graph_identical() -> bool:
        static_y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return bool(torch.equal(static_y, graph_reference))

    gc.collect()
    free_before = free_bytes(index)
    stats_awake = pool.stats().as_dict()
    print(f"pool: {weight_bytes / GiB:.2f} GiB weights, {pool.stats().tags['kv_cache'].bytes / GiB:.2f} GiB kv, "
          f"{pool.stats().tags['cuda_graph'].bytes / MiB:.1f} MiB graph; device free {free_before / GiB:.2f} GiB", flush=True)

    # Level 1: cycle 1 pins the backup buffers, later cycles reuse them.
    level1 = run_cycles(pool, index, args.cycles, ["weights", "cuda_graph"], ["kv_cache"], touch_kv)
    exact = weights_exact()
    graph_ok = graph_identical()
    # Full sleep footprint against the bare process.
    pool.sleep(offload_tags=["weights", "cuda_graph"], discard_tags=["kv_cache"])
    footprint = probe.footprint(index, bare_alone, reference_alone)
    stats_asleep = pool.stats().as_dict()
    pool.wake_up()
    touch_kv()

    # Level 2: weights and KV discarded; the graph's own memory is still backed up.
    level2 = run_cycles(pool, index, args.cycles, ["cuda_graph"], ["weights", "kv_cache"], touch_kv)
    pool.sleep(offload_tags=["cuda_graph"], discard_tags=["weights", "kv_cache"])
    footprint2 = probe.footprint(index, bare_alone, reference_alone)
    pool.wake_up(["weights"])
    with torch.no_grad():  # the RLHF weight update: new values in place, graph stays valid
        for t, r in zip(weights, reference):
            t.copy_(r)
        for n, p in model.named_parameters():
            p.copy_(model_host[n])
    pool.wake_up()
    touch_kv()
    exact_after_reload = weights_exact()
    graph_ok_after_level2 = graph_identical()

    # Leaks: steady state after two cycles, then many more.
    run_cycles(pool, index, 2, ["weights", "cuda_graph"], ["kv_cache"], touch_kv)
    gc.collect()
    device0, host0 = free_bytes(index), host_rss()
    run_cycles(pool, index, args.leak_cycles, ["weights", "cuda_graph"], ["kv_cache"], touch_kv)
    gc.collect()
    device_leak, host_leak = device0 - free_bytes(index), host_rss() - host0
    exact_after_leak_cycles = weights_exact()
    pool.close()

    l1_sleep, l1_wake = summary(level1, "sleep_s"), summary(level1, "wake_s")
    l2_sleep, l2_wake = summary(level2, "sleep_s"), summary(level2, "wake_s")
    offloaded = level1[-1].offloaded
    l1_sleep_gbps = offloaded / l1_sleep["median_after_1"] / 1e9
    l1_wake_gbps = offloaded / l1_wake["median_after_1"] / 1e9
    overhead = max(footprint.overhead, footprint2.overhead)
    pool_overhead = max(footprint.pool_overhead, footprint2.pool_overhead)
    checks = {
        "bit_exact_restore": exact and exact_after_leak_cycles,
        "weights_reload_after_level2": exact_after_reload,
        "graph_identical_after_level1_wake": graph_ok,
        "graph_identical_after_level2_wake": graph_ok_after_level2,
    }
    targets = {
        "overhead_vs_bare_le_64MiB": overhead <= TARGET_OVERHEAD_BYTES,
        "overhead_vs_same_kernels_le_64MiB": pool_overhead <= TARGET_OVERHEAD_BYTES,
        "level1_sleep_ge_85pct_raw": l1_sleep_gbps >= TARGET_BANDWIDTH_FRACTION * raw_d2h,
        "level1_wake_ge_85pct_raw": l1_wake_gbps >= TARGET_BANDWIDTH_FRACTION * raw_h2d,
        "level2_sleep_le_50ms": l2_sleep["median_after_1"] <= TARGET_LEVEL2_SECONDS,
        "level2_wake_le_50ms": l2_wake["median_after_1"] <= TARGET_LEVEL2_SECONDS,
        "no_device_leak": device_leak <= 2 * MiB,
        "no_host_leak": host_leak <= 64 * MiB,
    }
    result = {
        "device": torch.cuda.get_device_name(index),
        "torch": torch.__version__,
        "group_bytes": pool._backend.group_bytes,
        "weights_bytes": weight_bytes,
        "kv_bytes": len(kv) * layer_kv,
        "raw_pinned_gbps": {"d2h": raw_d2h, "h2d": raw_h2d},
        "device_free": {"before_sleep": free_before, "after_sleep": level1[1 if len(level1) > 1 else 0].free_after_sleep,
                        "after_wake": level1[-1].free_after_wake},
        "footprint_level1": footprint.as_dict(),
        "footprint_level2": footprint2.as_dict(),
        "level1": {"sleep_s": l1_sleep, "wake_s": l1_wake, "sleep_gbps": l1_sleep_gbps, "wake_gbps": l1_wake_gbps,
                   "cycles": [c.__dict__ for c in level1]},
        "level2": {"sleep_s": l2_sleep, "wake_s": l2_wake, "cycles": [c.__dict__ for c in level2]},
        "leak": {"cycles": args.leak_cycles, "device_bytes": device_leak, "host_bytes": host_leak},
        "stats_awake": stats_awake,
        "stats_asleep": stats_asleep,
        "checks": checks,
        "targets": targets,
    }
    (args.out / "pool_table.json").write_text(json.dumps(result, indent=2))
    table = render(result)
    (args.out / "pool_table.md").write_text(table + "\n")
    print(table)
    if not all(checks.values()):
        print("FAILED checks: " + ", ".join(k for k, v in checks.items() if not v), file=sys.stderr)
        return 1
    if args.strict and not all(targets.values()):
        print("missed targets: " + ", ".join(k for k, v in targets.items() if not v), file=sys.stderr)
        return 1
    return 0


def render(r: dict) -> str:
    def gib(b: float) -> str:
        return f"{b / GiB:.2f} GiB"

    def ms(s: float) -> str:
        return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"

    def ok(key: str) -> str:
        return "yes" if r["targets"][key] else "**MISSED**"

    raw = r["raw_pinned_gbps"]
    l1, l2, fp = r["level1"], r["level2"], r["footprint_level1"]
    fp2 = r["footprint_level2"]
    rows = [
        ("device free before sleep", gib(r["device_free"]["before_sleep"]), ""),
        ("device free after sleep (level 1)", gib(r["device_free"]["after_sleep"]), ""),
        ("device free after wake", gib(r["device_free"]["after_wake"]), ""),
        ("in use after full sleep vs bare CUDA process",
         f"{fp['overhead'] / MiB:+.1f} MiB (L1), {fp2['overhead'] / MiB:+.1f} MiB (L2); bare {fp['bare_alone_used'] / MiB:.0f} MiB, "
         f"bare context {fp['bare_context_bytes'] / MiB:.0f} MiB",
         f"<= 64 MiB: {ok('overhead_vs_bare_le_64MiB')}"),
        ("... of which a process that ran the same kernels without a pool holds (module code, cuBLAS, graph)",
         f"{fp['kernels_overhead'] / MiB:+.1f} MiB", "cannot be released while the context lives"),
        ("in use after full sleep vs that same-kernels process",
         f"{fp['pool_overhead'] / MiB:+.1f} MiB (L1), {fp2['pool_overhead'] / MiB:+.1f} MiB (L2)",
         f"<= 64 MiB: {ok('overhead_vs_same_kernels_le_64MiB')}"),
        ("raw pinned copy D2H / H2D", f"{raw['d2h']:.1f} / {raw['h2d']:.1f} GB/s", ""),
        ("level-1 sleep: cycle 1 / median of cycles >= 2",
         f"{ms(l1['sleep_s']['cycle1'])} / {ms(l1['sleep_s']['median_after_1'])} = {l1['sleep_gbps']:.1f} GB/s "
         f"({100 * l1['sleep_gbps'] / raw['d2h']:.0f}% of raw)",
         f">= 85%: {ok('level1_sleep_ge_85pct_raw')}"),
        ("level-1 wake: cycle 1 / median of cycles >= 2",
         f"{ms(l1['wake_s']['cycle1'])} / {ms(l1['wake_s']['median_after_1'])} = {l1['wake_gbps']:.1f} GB/s "
         f"({100 * l1['wake_gbps'] / raw['h2d']:.0f}% of raw)",
         f">= 85%: {ok('level1_wake_ge_85pct_raw')}"),
        ("level-2 sleep: cycle 1 / median of cycles >= 2",
         f"{ms(l2['sleep_s']['cycle1'])} / {ms(l2['sleep_s']['median_after_1'])}", f"<= 50 ms: {ok('level2_sleep_le_50ms')}"),
        ("level-2 wake: cycle 1 / median of cycles >= 2",
         f"{ms(l2['wake_s']['cycle1'])} / {ms(l2['wake_s']['median_after_1'])}", f"<= 50 ms: {ok('level2_wake_le_50ms')}"),
        ("bit-exact restore of offloaded weights", "yes" if r["checks"]["bit_exact_restore"] else "**NO**", ""),
        ("CUDA graph (memory in `cuda_graph`) replays identically after wake",
         "yes" if r["checks"]["graph_identical_after_level1_wake"] and r["checks"]["graph_identical_after_level2_wake"] else "**NO**", ""),
        (f"{r['leak']['cycles']} cycles: device / host growth",
         f"{r['leak']['device_bytes'] / MiB:+.1f} / {r['leak']['host_bytes'] / MiB:+.1f} MiB",
         f"none: {ok('no_device_leak')} / {ok('no_host_leak')}"),
    ]
    head = (f"Sleepable pool on {r['device']} (torch {r['torch']}): {gib(r['weights_bytes'])} `weights` + "
            f"{gib(r['kv_bytes'])} `kv_cache` + a CUDA graph; copies pipelined in groups of "
            f"{r['group_bytes'] / MiB:.0f} MiB\n\n| measure | value | target |\n| --- | --- | --- |")
    return head + "\n" + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows)


if __name__ == "__main__":
    sys.exit(main())
