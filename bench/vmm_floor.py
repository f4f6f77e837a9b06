"""The driver's floor for a level-2 sleep (gpu-check stage `vmmfloor`): what releasing device memory
costs per GiB, by handle size and by number of threads, and what re-creating it costs right after.

For each handle size, --gib of physical memory is created in handles of that size and mapped at one
reserved range (like the pool's allocations); then, timed:
  - release: cuMemUnmap + cuMemRelease of every handle, spread over T threads (1, 2, 4, 8), with the
    time of each kind of call summed;
  - re-create at once: cuMemCreate + cuMemMap + cuMemSetAccess of the same handles right after the
    release (what a wake right after a sleep pays), and again after a 1 s pause.
With --touch every handle is written (a memset) before each release, as a KV cache is before a sleep
(written or not, the driver's rate moves from call to call: 0.30-0.79 ms/GiB in the engine's sleeps of one
H200 run).
Calls go through ctypes to libcuda, which drops the GIL, so threads really overlap in the driver.
Prints a table (ms per GiB) and the best release of --gib, and writes vmm-floor.json under --out.
--aftermath instead measures what the driver's work on that memory costs the kernels running next: a
1 GiB device-to-device copy (HBM-bound) timed back to back for 400 ms after creating --gib in 2 GiB
handles, and after releasing them (H200: after a release of 100 GiB the copy runs ~10% slower for
200-300 ms while the driver clears the memory); then the same for a train of 64 tiny kernels (launch- and
latency-bound, like a small model's decode step).
--contention instead times trains of tiny kernels from the host (launch and wait, like an eager
prefill) right after a release of --gib, alone and beside a thread that creates and maps that memory
again in pieces of 2 GiB or 256 MiB at full speed (what a wake's background KV mapper does).
--age instead releases --gib in 2 GiB handles at several times after creating (and writing) them, and
times writing each handle's memory right after it was created against 1 s later.
The figures of each mode's runs: docs/measurements.md (2026-11-30 and 2026-12-02, 08:54-09:40 UTC).

    python bench/vmm_floor.py --gib 100 --out $OUT/results
    python bench/vmm_floor.py --gib 100 --aftermath
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import now_iso, table, write_json  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20


class Driver:
    """The handful of VMM calls, through ctypes (no GIL while the driver works)."""

    def __init__(self, device: int = 0) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuMemUnmap.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
        self.lib.cuMemRelease.argtypes = [ctypes.c_uint64]
        self.lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        self.lib.cuCtxSynchronize.argtypes = []
        for fn in (self.lib.cuMemUnmap, self.lib.cuMemRelease, self.lib.cuCtxSetCurrent, self.lib.cuCtxSynchronize):
            fn.restype = ctypes.c_int
        self._check(cu.cuInit(0))
        dev = self._check(cu.cuDeviceGet(device))
        self.ctx = self._check(cu.cuDevicePrimaryCtxRetain(dev))
        self._check(cu.cuCtxSetCurrent(self.ctx))
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = device
        self.access = cu.CUmemAccessDesc()
        self.access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.access.location.id = device
        self.access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.gran = int(self._check(cu.cuMemGetAllocationGranularity(
            self.prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))

    def _check(self, result):
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver error {err}")
        return values[0] if len(values) == 1 else (tuple(values) if values else None)

    def set_current(self) -> None:
        assert self.lib.cuCtxSetCurrent(ctypes.c_void_p(int(self.ctx))) == 0

    def free_bytes(self) -> int:
        return int(self._check(self.cu.cuMemGetInfo())[0])

    def reserve(self, size: int) -> int:
        return int(self._check(self.cu.cuMemAddressReserve(size, self.gran, 0, 0)))

    def touch(self, pieces: list[tuple[int, int, int]]) -> None:
        """Write every byte of every piece (as a KV cache is written before a sleep) and wait."""
        for va, size, _ in pieces:
            self._check(self.cu.cuMemsetD8(self.cu.CUdeviceptr(va), 1, size))
        assert self.lib.cuCtxSynchronize() == 0

    def create_map(self, va: int, size: int) -> int:
        cu = self.cu
        h = self._check(cu.cuMemCreate(size, self.prop, 0))
        self._check(cu.cuMemMap(cu.CUdeviceptr(va), size, 0, h, 0))
        self._check(cu.cuMemSetAccess(cu.CUdeviceptr(va), size, [self.access], 1))
        return int(h)

    def unmap_release(self, va: int, size: int, handle: int, times: list[float]) -> None:
        t = time.perf_counter()
        assert self.lib.cuMemUnmap(va, size) == 0
        t2 = time.perf_counter()
        assert self.lib.cuMemRelease(handle) == 0
        times[0] += t2 - t
        times[1] += time.perf_counter() - t2


def release(drv: Driver, pieces: list[tuple[int, int, int]], threads: int) -> dict:
    """Unmap and release every (va, size, handle), split over threads; returns seconds."""
    sums = [[0.0, 0.0] for _ in range(threads)]
    parts = [pieces[i::threads] for i in range(threads)]

    def work(i: int) -> None:
        drv.set_current()
        for va, size, h in parts[i]:
            drv.unmap_release(va, size, h, sums[i])

    drv.lib.cuCtxSynchronize()
    t = time.perf_counter()
    if threads == 1:
        work(0)
    else:
        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
    wall = time.perf_counter() - t
    return {"wall_s": wall, "unmap_s": sum(s[0] for s in sums), "release_s": sum(s[1] for s in sums)}


def recreate(drv: Driver, pieces: list[tuple[int, int, int]]) -> tuple[list[tuple[int, int, int]], float]:
    t = time.perf_counter()
    out = [(va, size, drv.create_map(va, size)) for va, size, _ in pieces]
    return out, time.perf_counter() - t


def by_window(rows: list[tuple[float, float]], seconds: float) -> dict[str, tuple[float, float]]:
    """(mean, largest) of the values of (ms since the start, value) rows, by window of time since the start."""
    windows = {}
    for lo, hi in ((0, 20), (20, 50), (50, 100), (100, 200), (200, seconds * 1e3)):
        values = [v for t, v in rows if lo <= t < hi]
        if values:
            windows[f"{lo}-{hi:.0f} ms"] = (statistics.mean(values), max(values))
    return windows


def copy_bandwidth_after(label: str, seconds: float = 0.4) -> dict:
    """GB/s of a 1 GiB device copy run back to back for `seconds`, by window of time since the call."""
    import torch

    src = torch.ones(GiB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    rows, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        rows.append(((time.perf_counter() - t0) * 1e3, start.elapsed_time(end)))
    # bytes read + written over the mean and the slowest copy
    windows = {w: (2 * GiB / 1e6 / mean, 2 * GiB / 1e6 / slowest)
               for w, (mean, slowest) in by_window(rows, seconds).items()}
    print(f"{label}: copy GB/s mean/worst " + " | ".join(f"{w} {m:.0f}/{lo:.0f}" for w, (m, lo) in windows.items()),
          flush=True)
    return windows


def tiny_kernels_after(label: str, seconds: float = 0.4, train: int = 64, host: bool = False) -> dict:
    """Microseconds per kernel of trains of `train` tiny kernels, by window of time since the call: their
    device time (CUDA events), or with host=True the host's time to launch them and wait for them."""
    import torch

    x = torch.zeros(4096, device="cuda")
    rows, t0 = [], time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        if not host:
            start.record()
        for _ in range(train):
            x.add_(1.0)
        if host:
            torch.cuda.synchronize()
            rows.append(((t - t0) * 1e3, (time.perf_counter() - t) * 1e6 / train))
        else:
            end.record()
            end.synchronize()
            rows.append(((time.perf_counter() - t0) * 1e3, start.elapsed_time(end) * 1e3 / train))
    windows = by_window(rows, seconds)
    print(f"{label}: {'host us per tiny kernel' if host else 'tiny kernel us'} mean/worst "
          + " | ".join(f"{w} {m:.1f}/{hi:.1f}" for w, (m, hi) in windows.items()), flush=True)
    return windows


def aftermath(drv: Driver, total: int, touch: bool) -> dict:
    size = 2 * GiB
    va = drv.reserve(total)
    pieces = [(va + i * size, size, 0) for i in range(total // size)]
    for _ in range(3):
        copy_bandwidth_after("warm-up", 0.1)
    out = {"baseline": copy_bandwidth_after("baseline")}
    pieces, s = recreate(drv, pieces)
    print(f"create+map {total / GiB:.0f} GiB: {s * 1e3:.1f} ms")
    out["after create"] = copy_bandwidth_after("after create+map")
    if touch:
        drv.touch(pieces)
    rel = release(drv, pieces, 1)
    print(f"unmap+release: {rel['wall_s'] * 1e3:.1f} ms")
    out["after release"] = copy_bandwidth_after("after release")
    out["0.4 s after release"] = copy_bandwidth_after("0.4 s after release")
    for _ in range(3):
        tiny_kernels_after("warm-up", 0.05)
    out["tiny kernels, baseline"] = tiny_kernels_after("baseline")
    pieces, s = recreate(drv, pieces)
    if touch:
        drv.touch(pieces)
    time.sleep(1.0)
    out["tiny kernels, before release"] = tiny_kernels_after("1 s after create+map")
    rel = release(drv, pieces, 1)
    print(f"unmap+release: {rel['wall_s'] * 1e3:.1f} ms")
    out["tiny kernels, after release"] = tiny_kernels_after("after release")
    out["tiny kernels, 0.4 s after release"] = tiny_kernels_after("0.4 s after release")
    return out


def contention(drv: Driver, total: int) -> dict:
    """Tiny kernels right after a release: alone, and beside a thread re-creating the memory in pieces."""
    va = drv.reserve(total)
    out = {}
    for _ in range(3):
        tiny_kernels_after("warm-up", 0.05, host=True)
    out["baseline"] = tiny_kernels_after("baseline", 0.3, host=True)
    for label, piece in (("alone", 0), ("beside re-creating in 2 GiB pieces", 2 * GiB),
                         ("beside re-creating in 256 MiB pieces", 256 * MiB), ("alone, again", 0)):
        size = piece or 2 * GiB
        pieces, _ = recreate(drv, [(va + i * size, size, 0) for i in range(total // size)])
        drv.touch(pieces)
        time.sleep(1.0)
        release(drv, pieces, 1)
        created: list = []
        mapper = None
        if piece:
            def remap() -> None:
                drv.set_current()
                created.extend(recreate(drv, pieces)[0])
            mapper = threading.Thread(target=remap)
            mapper.start()
        out[label] = tiny_kernels_after(f"after release, {label}", 0.3, host=True)
        if mapper is not None:
            mapper.join()
            release(drv, created, 1)
        time.sleep(1.0)
    return out


def by_age(drv: Driver, total: int, ages: list[float], repeats: int) -> dict:
    """ms/GiB of releasing 2 GiB handles `age` seconds after they were created and written, and ms/GiB
    of writing them right after creating against 1 s later."""
    size = 2 * GiB
    va = drv.reserve(total)
    pieces = [(va + i * size, size, 0) for i in range(total // size)]
    gib = len(pieces) * size / GiB
    rows = []
    for age in ages:
        release_ms, fresh_ms, settled_ms = [], [], []
        for _ in range(repeats):
            time.sleep(1.0)  # the previous release's aftermath is over
            pieces, _ = recreate(drv, pieces)
            t = time.perf_counter()
            drv.touch(pieces)
            fresh_ms.append((time.perf_counter() - t) * 1e3 / gib)
            time.sleep(age)
            release_ms.append(release(drv, pieces, 1)["wall_s"] * 1e3 / gib)
        time.sleep(1.0)
        pieces, _ = recreate(drv, pieces)
        time.sleep(1.0)
        t = time.perf_counter()
        drv.touch(pieces)
        settled_ms.append((time.perf_counter() - t) * 1e3 / gib)
        release(drv, pieces, 1)
        row = {"age_s": age, "release_ms_per_gib": statistics.median(release_ms),
               "write_fresh_ms_per_gib": statistics.median(fresh_ms), "write_after_1s_ms_per_gib": settled_ms[0]}
        rows.append(row)
        print(row, flush=True)
    return {"handle_bytes": size, "gib": gib, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=100.0)
    ap.add_argument("--sizes", default="2MiB,64MiB,512MiB,2GiB,8GiB,whole")
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--aftermath", action="store_true", help="the copy bandwidth after creating and releasing")
    ap.add_argument("--touch", action="store_true", help="write every handle before each release")
    ap.add_argument("--contention", action="store_true", help="tiny kernels after a release, beside re-creating")
    ap.add_argument("--age", default="", help="e.g. 0,0.1,0.4,1: release times by seconds since creation")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    drv = Driver()
    total = int(args.gib * GiB) // drv.gran * drv.gran
    if args.aftermath:
        write_json(args.out, "vmm-aftermath" + "-touched" * args.touch,
                   {"date": now_iso(), "gib": total / GiB, "touched": args.touch, **aftermath(drv, total, args.touch)})
        return
    if args.contention:
        write_json(args.out, "vmm-contention", {"date": now_iso(), "gib": total / GiB, **contention(drv, total)})
        return
    if args.age:
        ages = [float(a) for a in args.age.split(",")]
        write_json(args.out, "vmm-age", {"date": now_iso(), **by_age(drv, total, ages, args.repeats)})
        return
    free0 = drv.free_bytes()
    result = {"date": now_iso(), "gib": total / GiB, "granularity": drv.gran, "free_before": free0,
              "touched": args.touch, "rows": []}
    name = "vmm-floor" + "-touched" * args.touch
    va = drv.reserve(total)
    units = {"MiB": MiB, "GiB": GiB}
    for size_text in args.sizes.split(","):
        if size_text == "whole":
            size = total
        else:
            size = int(float(size_text[:-3]) * units[size_text[-3:]])
        if size == 2 * MiB and total > 16 * GiB:
            n_total = 16 * GiB  # 2 MiB handles of 100 GiB would take minutes: measure 16 GiB of them
        else:
            n_total = total
        n = max(1, n_total // size)
        pieces = [(va + i * size, size, 0) for i in range(n)]
        pieces, first_create = recreate(drv, pieces)
        gib = n * size / GiB
        for threads in [int(x) for x in args.threads.split(",")]:
            rel, now, later = [], [], []
            for _ in range(args.repeats):
                if args.touch:
                    drv.touch(pieces)
                rel.append(release(drv, pieces, threads))
                pieces, s = recreate(drv, pieces)  # right after the release: a wake right after a sleep
                now.append(s)
                release(drv, pieces, 1)
                time.sleep(1.0)
                pieces, s = recreate(drv, pieces)  # a second later
                later.append(s)
            row = {"handle_bytes": size, "handles": n, "gib": gib, "threads": threads,
                   "release_ms_per_gib": statistics.median(r["wall_s"] for r in rel) * 1e3 / gib,
                   "unmap_ms_per_gib": statistics.median(r["unmap_s"] for r in rel) * 1e3 / gib,
                   "release_call_ms_per_gib": statistics.median(r["release_s"] for r in rel) * 1e3 / gib,
                   "recreate_now_ms_per_gib": statistics.median(now) * 1e3 / gib,
                   "recreate_after_1s_ms_per_gib": statistics.median(later) * 1e3 / gib,
                   "first_create_ms_per_gib": first_create * 1e3 / gib}
            result["rows"].append(row)
            print(row, flush=True)
        release(drv, pieces, 1)
        write_json(args.out, name, result)
    best = min(result["rows"], key=lambda r: r["release_ms_per_gib"])
    result["best"] = best
    write_json(args.out, name, result)
    print(f"\nVMM floor ({result['date']}; {total / GiB:.0f} GiB{', written before each release' * args.touch}, granularity {drv.gran // MiB} MiB; "
          "ms per GiB, median)")
    print(table([[f"{r['handle_bytes'] / MiB:.0f} MiB", r["handles"], r["threads"],
                  f"{r['release_ms_per_gib']:.3f}", f"{r['unmap_ms_per_gib']:.3f}", f"{r['release_call_ms_per_gib']:.3f}",
                  f"{r['recreate_now_ms_per_gib']:.2f}", f"{r['recreate_after_1s_ms_per_gib']:.2f}"]
                 for r in result["rows"]],
                ["handle", "handles", "threads", "unmap+release (wall)", "unmap calls", "release calls",
                 "re-create at once", "re-create after 1 s"]))
    print(f"best release: {best['release_ms_per_gib']:.3f} ms/GiB ({best['handle_bytes'] / MiB:.0f} MiB handles, "
          f"{best['threads']} threads) -> {best['release_ms_per_gib'] * 120:.0f} ms for 120 GiB")


if __name__ == "__main__":
    main()
