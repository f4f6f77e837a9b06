"""Why a level-1 wake can fall short of raw pinned bandwidth on one host and not another: the wake's own copies
against torch's pinned copy, on this host, with the facts that could explain a difference.

A level-1 wake copies each tag's backup (a PinnedBuffer: anonymous memory faulted in by the kernel, transparent
huge pages asked for, registered with CUDA in 1 GiB pieces, mapped) back with a kernel that reads the mapped host
memory or with the copy engines, as Copier.calibrate chose (SLEEPSERVE_WAKE_COPY=auto, the default). The H200 host
woke at 0.91 of raw pinned; one H100 host at 0.60-0.61 in three runs while sleeping at 0.98-0.99 there
(2026-12-05/06, docs/measurements.md). This times, on one buffer of --gib GiB, each way the pool can copy, beside
torch's pinned tensors (cudaHostAlloc, the raw reference), and reports the host's transparent-huge-page mode,
its NUMA nodes, the GPU's node and where the buffer's pages landed, so one run says which of them differs.
On that H100 host (2026-12-06 03:01 UTC): the kernel 34.4 GB/s, the copy engines 55.0 from the same buffer (torch
55.2), one NUMA node, the buffer all in huge pages: the kernel's reads were the difference.

    python bench/host_copies.py --out bench/results     # CUDA only
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import now_iso, write_json  # noqa: E402

GB = 1e9


def read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        return f"({type(e).__name__})"


def host_facts(device: torch.device) -> dict:
    """The host's THP mode, NUMA nodes and CPUs, and the GPU's PCI address and NUMA node (sysfs)."""
    props = torch.cuda.get_device_properties(device)
    bus = (f"{getattr(props, 'pci_domain_id', 0):04x}:{getattr(props, 'pci_bus_id', 0):02x}:"
           f"{getattr(props, 'pci_device_id', 0):02x}.0")
    return {"gpu": props.name, "pci": bus, "gpu_numa_node": read(f"/sys/bus/pci/devices/{bus}/numa_node"),
            "gpu_local_cpus": read(f"/sys/bus/pci/devices/{bus}/local_cpulist"),
            "numa_nodes": read("/sys/devices/system/node/online"),
            "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "cpus_allowed": len(os.sched_getaffinity(0))}


def where(ptr: int, nbytes: int) -> dict:
    """Where the mapping holding ptr has its pages: by NUMA node (/proc/self/numa_maps, in its page size), and
    its bytes in transparent huge pages (/proc/self/smaps)."""
    start, huge = None, None
    lines = read("/proc/self/smaps").splitlines()
    for i, line in enumerate(lines):
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= ptr < hi:
                start = f"{lo:x}"
                huge = next((int(f.split()[1]) * 1024 for f in lines[i + 1:i + 40] if f.startswith("AnonHugePages:")),
                            None)
                break
    nodes: dict[str, str] = {}
    for line in read("/proc/self/numa_maps").splitlines():
        if start is not None and line.split(" ", 1)[0] == start:
            nodes = dict(f.split("=", 1) for f in line.split()[2:] if f.startswith(("N", "kernelpagesize")))
    return {"numa": nodes, "huge_page_bytes": huge, "bytes": nbytes}


def timed(fn, rounds: int) -> float:
    """Median seconds of fn() then a device synchronize, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    from allocator.backup import Copier, PinnedBackup
    from allocator.driver import DeviceContext

    device = torch.device("cuda:0")
    nbytes = args.gib << 30
    result = {"date": now_iso(), "facts": host_facts(device), "gib": args.gib, "gbps": {}}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gbps = result["gbps"]
    gbps["torch_h2d"] = nbytes / timed(lambda: dev.copy_(host, non_blocking=True), args.rounds) / GB
    gbps["torch_d2h"] = nbytes / timed(lambda: host.copy_(dev, non_blocking=True), args.rounds) / GB
    del host
    ctx = DeviceContext(device.index)
    backup, copier = PinnedBackup(ctx), Copier(ctx)
    try:
        backup.prepare([(dev.data_ptr(), nbytes)])  # as a sleep lays out one allocation
        result["backup"] = where(backup.buffer.ptr, backup.buffer.nbytes)
        copier.kernel_restore = None  # what a pool's first sleep would choose (Copier.calibrate)
        copier.calibrate(backup)
        result["calibration"] = copier.calibration

        def save() -> None:
            copier.save_marked([backup], 0)
            copier.wait()

        def restore(kernel: bool) -> None:
            copier.kernel_restore = kernel
            copier.restore(backup, backup.layout)
            copier.wait()

        gbps["backup_d2h_engines"] = nbytes / timed(save, args.rounds) / GB
        gbps["backup_h2d_engines"] = nbytes / timed(lambda: restore(False), args.rounds) / GB
        before = copier.kernel_copies
        gbps["backup_h2d_kernel"] = nbytes / timed(lambda: restore(True), args.rounds) / GB
        result["kernel_copies_made"] = copier.kernel_copies - before
    finally:
        copier.close()
        backup.release()
        ctx.release()
    result["ratios"] = {"wake_kernel_over_torch": gbps["backup_h2d_kernel"] / gbps["torch_h2d"],
                        "wake_engines_over_torch": gbps["backup_h2d_engines"] / gbps["torch_h2d"],
                        "sleep_over_torch": gbps["backup_d2h_engines"] / gbps["torch_d2h"]}
    print(result, flush=True)
    write_json(args.out, "host_copies", result)


if __name__ == "__main__":
    main()
