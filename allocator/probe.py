"""Device-memory probes for invariant 1: after a full sleep, this process should hold no more
device memory than a bare CUDA process (one that only created a context).

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


def bare_process_used(index: int, timeout: float = 120.0) -> int:
    """Device bytes in use (total - free) as seen from a fresh process that only created a
    CUDA context on device `index`."""
    out = subprocess.run([sys.executable, "-c", _BARE, str(index)], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"bare CUDA probe failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
    info = json.loads(out.stdout.strip().splitlines()[-1])
    return int(info["total"]) - int(info["free"])


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

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def footprint(index: int, bare_alone_used: int) -> Footprint:
    """Call while the pool sleeps, with bare_process_used(index) taken before this process
    initialized CUDA."""
    asleep = device_used(index)
    with_probe = bare_process_used(index)
    return Footprint(bare_alone_used, asleep, with_probe - asleep, asleep - bare_alone_used)
