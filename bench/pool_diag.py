"""Where the sleepable pool's time and footprint go, on a real GPU (the pool table's companion).

    python bench/pool_diag.py --out DIR [--parts perf,footprint] [--weights-gib 8 --kv-gib 40]

perf: the pool table's layout (32 MiB weight tensors, 1 GiB KV tensors, a CUDA graph), then
  sleep/wake cycles with the wall-clock phases and the driver calls' counts and milliseconds of
  each call (backend.last_timings): group sizes of the pipelined copies, discard-only and
  copy-only cycles (per-handle costs), and a pause before re-mapping (does the driver still scrub?).
footprint: fresh processes that record device memory in use against a bare process after each
  first use of a kernel family (elementwise, casts, RNG, cuBLAS handle, GEMMs, a graph), with
  module loading lazy (torch's default) and eager (all of torch's code loaded at once: how big
  the code is); and pinned host memory (cuMemHostAlloc against cuMemCreate on the host node):
  the device memory its GPU mapping costs, the time to allocate it, copy bandwidth.
Everything goes to DIR/diag.json (rewritten after each part) and a summary is printed.

What it found on H200s (the orders, worker threads and group sizes it compared, since removed
from the library): docs/results/pool-findings.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MiB, GiB = 1 << 20, 1 << 30
RESULTS: dict = {}


def save(out: Path) -> None:
    (out / "diag.json").write_text(json.dumps(RESULTS, indent=1, default=str))


# ---------------------------------------------------------------------------- perf


def perf(args: argparse.Namespace, out: Path) -> None:
    import torch

    from allocator import create_pool
    from bench.pool_table import Model, raw_pinned_bandwidth
    from testkit.cuda_pool import capture

    index = 0
    torch.cuda.set_device(index)
    raw_d2h, raw_h2d = raw_pinned_bandwidth(index, 2 * GiB)
    res = RESULTS.setdefault("perf", {})
    res["raw_gbps"] = {"d2h": raw_d2h, "h2d": raw_h2d}
    print(f"raw pinned: D2H {raw_d2h:.1f} H2D {raw_h2d:.1f} GB/s", flush=True)

    pool = create_pool(f"cuda:{index}")
    be = pool._backend
    weights, kv = [], []
    chunk = 32 * MiB
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(int(args.weights_gib * GiB) // chunk):
        t = pool.empty((chunk,), torch.uint8, "weights")
        t.copy_(torch.randint(0, 256, (chunk,), generator=gen, device="cuda", dtype=torch.uint8))
        weights.append(t)
    for _ in range(int(args.kv_gib)):
        kv.append(pool.empty((GiB,), torch.uint8, "kv_cache"))
    torch.manual_seed(0)
    model = Model().cuda().to(torch.bfloat16).eval()
    pool.adopt(model, "weights")
    with torch.no_grad():
        model(torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16))
    graph, _, static_y = capture(pool, model, (8, 4096))
    graph_ref = static_y.clone()
    reference = [t.cpu() for t in weights[:: max(1, len(weights) // 16)]]
    sampled = weights[:: max(1, len(weights) // 16)]
    usage = be.usage()
    res["layout"] = {t: {"bytes": u.bytes, "allocations": u.allocations} for t, u in usage.items()}
    print(f"layout: {res['layout']}", flush=True)

    def touch() -> None:
        for t in kv:
            t.fill_(1)
        torch.cuda.synchronize()

    default_group = be.group_bytes

    def cycle(label: str, offload: list[str], discard: list[str], n: int = 2, pause: float = 0.0,
              wake_tags=None, group_bytes: int = default_group) -> None:
        be.group_bytes = group_bytes
        runs = []
        for _ in range(n):
            try:
                t0 = time.perf_counter()
                s = pool.sleep(offload_tags=offload, discard_tags=discard)
                s_wall = time.perf_counter() - t0
                st = dict(be.last_timings)
                free_now = torch.cuda.mem_get_info(index)[0]
                if pause:
                    time.sleep(pause)
                free_later = torch.cuda.mem_get_info(index)[0]
                t0 = time.perf_counter()
                w = pool.wake_up(wake_tags)
                w_wall = time.perf_counter() - t0
                wt = dict(be.last_timings)
                if wake_tags is not None:
                    pool.wake_up()
                touch()
                runs.append({"sleep_ms": s.seconds * 1e3, "sleep_wall_ms": s_wall * 1e3,
                             "sleep_copy_ms": s.copy_seconds * 1e3, "wake_ms": w.seconds * 1e3,
                             "wake_wall_ms": w_wall * 1e3, "wake_copy_ms": w.copy_seconds * 1e3,
                             "offloaded": s.bytes_offloaded, "discarded": s.bytes_discarded,
                             "free_growth_after_return_mib": (free_later - free_now) / MiB,
                             "sleep": st, "wake": wt})
            except Exception as err:  # keep the other experiments
                runs.append({"error": repr(err)})
                try:
                    pool.wake_up()
                except Exception:
                    pass
        res.setdefault("cycles", {})[label] = runs
        ok = [r for r in runs if "error" not in r]
        if ok:
            sm = statistics.median(r["sleep_ms"] for r in ok)
            wm = statistics.median(r["wake_ms"] for r in ok)
            off = ok[-1]["offloaded"]
            print(f"{label:34s} sleep {sm:7.1f} ms ({off / sm / 1e6 if off else 0:5.1f} GB/s)  "
                  f"wake {wm:7.1f} ms ({off / wm / 1e6 if off else 0:5.1f} GB/s)  "
                  f"| sleep {fmt(ok[-1]['sleep'])} | wake {fmt(ok[-1]['wake'])}", flush=True)
        else:
            print(f"{label}: {runs[-1]['error']}", flush=True)
        if ok:
            print(f"{'':34s} each: " + ", ".join(f"{r['sleep_ms']:.0f}/{r['wake_ms']:.0f}" for r in ok), flush=True)
        save(out)

    L1 = (["weights", "cuda_graph"], ["kv_cache"])
    L2 = (["cuda_graph"], ["weights", "kv_cache"])
    # pause: seconds between a sleep's return and the wake (the pool table uses none).
    cycle("first (pins backups)", *L1, n=1)
    if args.experiments == "full":
        cycle("L1 p0", *L1, n=3)
        cycle("L1 p0.2", *L1, n=2, pause=0.2)
        cycle("L1 group128 p0", *L1, n=2, group_bytes=128 * MiB)
        cycle("L1 group2048 p0", *L1, n=2, group_bytes=2048 * MiB)
        cycle("copy-only p0", ["weights", "cuda_graph"], [], n=2)
    else:
        cycle("L1 p0", *L1, n=4)
        cycle("L1 p0.5", *L1, n=2, pause=0.5)
    be.group_bytes = default_group
    # Level-1 cycles restore the weights: check them and the graph before level 2 discards them.
    res["bit_exact_sampled"] = all(torch.equal(t.cpu(), r) for t, r in zip(sampled, reference))
    static_y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    res["graph_equal_after_l1"] = bool(torch.equal(static_y, graph_ref))
    res["stack"] = {"base": be._stack_base, "now": be._ctx.stack_size()}
    print(f"after L1 experiments: bit-exact (sampled) {res['bit_exact_sampled']}, graph equal "
          f"{res['graph_equal_after_l1']}, stack {res['stack']}", flush=True)
    save(out)
    if args.experiments == "full":
        cycle("L2 p0", *L2, n=4)
        cycle("L2 p0.2", *L2, n=2, pause=0.2)
        cycle("kv only p0", [], ["kv_cache"], n=2)
        cycle("weights discard only p0", [], ["weights"], n=2)
    else:
        cycle("L2 p0", *L2, n=5)
        cycle("L2 p0.5", *L2, n=2, pause=0.5)
    pool.close()
    save(out)


def fmt(t: dict) -> str:
    if not t:
        return "-"
    ph = " ".join(f"{k}={v:.1f}" for k, v in t.get("phases_ms", {}).items() if v >= 0.3)
    dr = " ".join(f"{k}:{v['calls']}x={v['ms']:.1f}(max {v.get('longest_ms', 0):.1f})"
                  for k, v in t.get("driver", {}).items() if v["ms"] >= 0.3)
    return f"{ph} [{dr}]"


# ---------------------------------------------------------------------------- footprint


_OPS = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
mode = sys.argv[2]
import torch
from testkit.footprint import bare_process_used
bare = bare_process_used(0)
steps = []
torch.cuda.init(); torch.cuda.set_device(0)
from allocator import driver
from cuda.bindings import driver as cu
ctx = driver.DeviceContext(0)
def snap(name):
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(0)
    steps.append({"step": name, "over_bare_mib": (total - free - bare) / 2**20,
                  "torch_reserved_mib": torch.cuda.memory_reserved(0) / 2**20, "stack": ctx.stack_size()})
snap("context")
extra = {"loading_mode": str(cu.cuModuleGetLoadingMode()[1]), "env": os.environ.get("CUDA_MODULE_LOADING")}
dev = "cuda:0"
if mode in ("ops", "eager"):
    x = torch.ones(1 << 20, device=dev); snap("ones (fill kernel)")
    if mode == "ops":
        x.add_(1); snap("add_")
        xb = x.to(torch.bfloat16); snap("to(bfloat16)")
        r = torch.randn(1 << 20, device=dev); snap("randn")
        gen = torch.Generator(device=dev).manual_seed(0)
        ri = torch.randint(0, 256, (1 << 20,), generator=gen, device=dev, dtype=torch.uint8); snap("randint")
        torch.cuda.current_blas_handle(); snap("cuBLAS handle created")
        a = torch.randn(64, 4096, device=dev); m = torch.randn(4096, 4096, device=dev)
        (a @ m); snap("fp32 matmul 64x4096x4096")
        a16, m16 = a.to(torch.bfloat16), m.to(torch.bfloat16)
        torch.nn.functional.linear(a16, m16); snap("bf16 linear batch 64")
        torch.nn.functional.linear(a16[:8], m16); snap("bf16 linear batch 8")
        torch.nn.functional.silu(a16); snap("silu")
        torch.equal(a16, a16.clone()); snap("equal+clone")
        s2 = torch.cuda.Stream(); s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s2):
            torch.nn.functional.linear(a16[:8], m16)
        torch.cuda.current_stream().wait_stream(s2); snap("bf16 linear on a second stream")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s2):
            y = torch.nn.functional.silu(torch.nn.functional.linear(a16[:8], m16))
        g.replay(); snap("graph captured+replayed")
        del x, xb, r, ri, a, m, a16, m16, y
        getattr(torch._C, "_cuda_clearCublasWorkspaces")(); torch.cuda.empty_cache(); snap("tensors+caches freed, graph kept")
        del g; torch.cuda.empty_cache(); snap("graph destroyed")
elif mode == "hostmem":
    size = 8 << 30
    t0 = time.perf_counter(); p = driver.host_alloc(ctx, size); t_alloc = time.perf_counter() - t0
    snap("8 GiB cuMemHostAlloc")
    stream = driver.Stream(ctx)
    d = torch.empty(2 << 30, dtype=torch.uint8, device=dev); d.fill_(1)
    def bw(fn):
        rates = []
        for _ in range(3):
            torch.cuda.synchronize(); t = time.perf_counter(); fn(); stream.synchronize()
            rates.append((2 << 30) / (time.perf_counter() - t) / 1e9)
        return sorted(rates)[1]
    with ctx.current():
        hostalloc = {"alloc_s": t_alloc,
                     "d2h_gbps": bw(lambda: driver.copy_to_host_async(p, d.data_ptr(), 2 << 30, stream)),
                     "h2d_gbps": bw(lambda: driver.copy_to_device_async(d.data_ptr(), p, 2 << 30, stream))}
    driver.host_free(ctx, p); snap("freed")
    # The same bytes as VMM host memory (cuMemCreate on the host NUMA node, mapped for the device
    # in 2 MiB granules): fewer GPU page-table entries than 4 KiB pinned pages, if it works.
    vmm = {}
    try:
        with ctx.current():
            prop = cu.CUmemAllocationProp()
            prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
            prop.location.id = 0
            gran = driver.check(cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "gran")
            t0 = time.perf_counter()
            h = driver.check(cu.cuMemCreate(size, prop, 0), "cuMemCreate host")
            va = driver.check(cu.cuMemAddressReserve(size, 0, 0, 0), "reserve")
            driver.check(cu.cuMemMap(va, size, 0, h, 0), "map")
            desc = cu.CUmemAccessDesc()
            desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = 0
            desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            driver.check(cu.cuMemSetAccess(va, size, [desc], 1), "access")
            vmm["alloc_s"] = time.perf_counter() - t0
            vmm["granularity"] = int(gran)
        snap("8 GiB cuMemCreate(HOST_NUMA) mapped")
        with ctx.current():
            vmm["d2h_gbps"] = bw(lambda: driver.check(cu.cuMemcpyDtoDAsync(va, cu.CUdeviceptr(d.data_ptr()), 2 << 30, stream.handle), "d2h"))
            vmm["h2d_gbps"] = bw(lambda: driver.check(cu.cuMemcpyDtoDAsync(cu.CUdeviceptr(d.data_ptr()), va, 2 << 30, stream.handle), "h2d"))
            driver.check(cu.cuMemUnmap(va, size), "unmap"); driver.check(cu.cuMemRelease(h), "release")
            driver.check(cu.cuMemAddressFree(va, size), "free")
        snap("freed")
    except Exception as err:
        vmm["error"] = repr(err)
    extra.update({"cuMemHostAlloc": hostalloc, "vmm_host": vmm})
print(json.dumps({"bare": bare, "steps": steps, **extra}))
"""


def footprint(out: Path) -> None:
    res = RESULTS.setdefault("footprint", {})
    for mode, env in (("ops", {}), ("eager", {"CUDA_MODULE_LOADING": "EAGER"}), ("hostmem", {})):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _OPS, str(REPO), mode], capture_output=True, text=True,
                              timeout=150, env={**os.environ, **env})
        if proc.returncode != 0:
            res[mode] = {"error": proc.stderr[-3000:]}
            print(f"footprint {mode}: FAILED {proc.stderr[-1500:]}", flush=True)
        else:
            res[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
            info = {k: v for k, v in res[mode].items() if k not in ("steps",)}
            print(f"footprint {mode} ({time.perf_counter() - t0:.0f} s): {info}", flush=True)
            for st in res[mode]["steps"]:
                print(f"   {st['step']:40s} {st['over_bare_mib']:+8.1f} MiB  torch {st['torch_reserved_mib']:7.1f}  "
                      f"stack {st['stack']}", flush=True)
        save(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "pool")
    ap.add_argument("--parts", default="perf,footprint")
    ap.add_argument("--weights-gib", type=float, default=8.0)
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--experiments", choices=["full", "final"], default="final",
                    help="full: group sizes, pauses, discard-only and copy-only cycles; final: "
                         "levels 1 and 2 with and without a pause")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    parts = args.parts.split(",")
    if "footprint" in parts:
        footprint(args.out)
    if "perf" in parts:
        perf(args, args.out)
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
