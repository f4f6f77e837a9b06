"""Device-memory probes for invariant 1 (docs/architecture.md): after a full sleep, this process
should hold no more device memory than a process that ran the same kernels without a pool.
Measurement tooling, not library code: tests/gpu/test_pool_gpu.py and the GPU benchmarks use it.

A process that has run kernels holds more than a bare one even with every tensor freed: the code
of each kernel module it loaded (lazily, on first use; loaded code stays until the context dies),
cuBLAS/cuBLASLt handles, CUDA graphs it keeps. None of that is pool memory, and none of it can be
released while the context lives. reference_process_used() measures it: a fresh process runs the
same kernels without a pool, frees its tensors and caches, and reports what it still holds.

Device-wide "used" (total - free) also counts other processes and the driver's own share, which
nobody here controls. Both cancel out of

    overhead = used while the pool sleeps  -  used while only a bare probe process runs

when the bare probe runs before this process touches CUDA, in the same run, on an otherwise idle
GPU. A second probe spawned while the pool sleeps measures the bare context's own size
(used with it - used without it), reported as a sanity check of the first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass

_BARE = """
import json, sys, torch
i = int(sys.argv[1])
torch.cuda.init()
torch.cuda.set_device(i)
free, total = torch.cuda.mem_get_info(i)  # creates the primary context, nothing else
print(json.dumps({"free": free, "total": total}))
"""


_ONE_KERNEL = """
import json, sys, torch
i = int(sys.argv[1])
torch.cuda.init()
torch.cuda.set_device(i)
x = torch.ones(1024, device="cuda"); x.add_(1); torch.cuda.synchronize()
del x; torch.cuda.empty_cache()
free, total = torch.cuda.mem_get_info(i)
print(json.dumps({"free": free, "total": total}))
"""


_REFERENCE = """
import importlib, json, sys, torch
i, module, function = int(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path[:0] = sys.argv[4:]
torch.cuda.init()
torch.cuda.set_device(i)
keep = getattr(importlib.import_module(module), function)(i)  # e.g. CUDA graphs, kept like a server keeps them
torch.cuda.synchronize(i)
getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
torch.cuda.empty_cache()
free, total = torch.cuda.mem_get_info(i)
print(json.dumps({"free": free, "total": total}))
"""


def _probe_used(code: str, index: int, what: str, timeout: float, *args: str) -> int:
    """Device bytes in use (total - free) as the probe `code` (run in a fresh process with index and args)
    reports them."""
    out = subprocess.run([sys.executable, "-c", code, str(index), *args], capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{what} CUDA probe failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
    info = json.loads(out.stdout.strip().splitlines()[-1])
    return int(info["total"]) - int(info["free"])


def reference_process_used(index: int, module: str, function: str, paths: list[str] | None = None,
                           timeout: float = 300.0) -> int:
    """Device bytes in use (total - free) while a fresh process that ran `module.function(index)`
    (the kernels the measured process runs, without a pool) holds what it returned, every tensor
    and cache freed. Run it before this process touches CUDA, like bare_process_used."""
    return _probe_used(_REFERENCE, index, "reference", timeout, module, function, *(paths or []))


def bare_process_used(index: int, timeout: float = 120.0) -> int:
    """Device bytes in use (total - free) as seen from a fresh process that only created a
    CUDA context on device `index`."""
    return _probe_used(_BARE, index, "bare", timeout)


def one_kernel_process_used(index: int, timeout: float = 120.0) -> int:
    """Device bytes in use (total - free) while a fresh process that ran one elementwise kernel on device
    `index` (and freed its tensor and torch's cache) holds its context: issue 16's floor for a sleeping
    server ("asleep minus a bare process that ran one kernel")."""
    return _probe_used(_ONE_KERNEL, index, "one-kernel", timeout)


def server_device_used(client) -> int:
    """Device bytes in use (total - free) as a server started with --dev-mode reads them from the driver in
    its engine process (GET /memory), through an httpx client of it."""
    r = client.get("/memory")
    assert r.status_code == 200, r.text
    m = r.json()
    return int(m["device_total"]) - int(m["device_free"])


def device_used(index: int) -> int:
    import torch

    free, total = torch.cuda.mem_get_info(index)
    return int(total) - int(free)


@dataclass(frozen=True)
class Footprint:
    bare_alone_used: int  # device used while only the bare probe ran (before this process used CUDA)
    asleep_used: int  # device used while this process's pool sleeps
    bare_context_bytes: int  # a bare context's own size, measured while the pool sleeps
    overhead: int  # asleep_used - bare_alone_used: what the sleeping process holds beyond bare
    # device used while only the reference probe ran (same kernels, no pool), when measured
    reference_alone_used: int | None = None

    @property
    def kernels_overhead(self) -> int | None:
        """What running the kernels costs by itself (reference - bare): code and handles."""
        return None if self.reference_alone_used is None else self.reference_alone_used - self.bare_alone_used

    @property
    def pool_overhead(self) -> int | None:
        """What the sleeping process holds beyond a process that ran the same kernels."""
        return None if self.reference_alone_used is None else self.asleep_used - self.reference_alone_used

    def as_dict(self) -> dict[str, int | None]:
        return {**asdict(self), "kernels_overhead": self.kernels_overhead, "pool_overhead": self.pool_overhead}


def footprint(index: int, bare_alone_used: int, reference_alone_used: int | None = None) -> Footprint:
    """Call while the pool sleeps, with bare_process_used(index) (and reference_process_used)
    taken before this process initialized CUDA."""
    asleep = device_used(index)
    with_probe = bare_process_used(index)
    return Footprint(bare_alone_used, asleep, with_probe - asleep, asleep - bare_alone_used, reference_alone_used)
