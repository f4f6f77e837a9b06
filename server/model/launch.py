"""How the Triton kernels are launched: Triton's CPU interpreter or a GPU, and programmatic dependent launch.

Programmatic dependent launch (Hopper and newer) lets a kernel start before the one before it in the stream has
finished: the new kernel runs what does not depend on its predecessor (small_gemm.py loads weights), then
waits in-kernel for it (griddepcontrol.wait, Triton's gdc_wait) before reading its output or writing anything.
Each chained kernel also lets its successor launch at once (gdc_launch_dependents). The order of the stream is
kept: every chained kernel waits for the one before it to complete, so each waits, transitively, for all before.
A kernel launched the ordinary way (cuBLAS, torch) still waits for the whole of the one before.

SLEEPSERVE_DEPENDENT_LAUNCH=0 turns it off (read at the first launch): every kernel then starts after the one before
has ended, so a profile's kernel durations are each kernel's own (with it on, a chained kernel's span includes the
wait for its predecessor, which runs meanwhile), and the step's time with and without it shows what the chains save.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def _interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET: 1, true, on...), as Triton reads
    it; it is read when a kernel is defined, so it is fixed for the process."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


INTERPRETED = _interpreted()


@functools.cache
def dependent_launch_on(device: torch.device) -> bool:
    """Programmatic dependent launch needs NVIDIA's Hopper or newer, and a real GPU (not Triton's interpreter;
    not ROCm, whose devices torch also calls "cuda")."""
    return (device.type == "cuda" and not INTERPRETED and torch.version.hip is None
            and os.environ.get("SLEEPSERVE_DEPENDENT_LAUNCH", "1") != "0"
            and torch.cuda.get_device_capability(device) >= (9, 0))


@triton.jit
def chain_in(GDC: tl.constexpr):
    """A chained kernel's prologue (GDC: launched with gdc_launch(True)): let the next kernel in the stream launch
    now, then wait until the one before has completed and its writes are visible. Called before the first load
    of anything a kernel before may write (small_gemm.py loads its weights first), and before any store."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


def gdc_launch(on: bool) -> dict:
    """A kernel's launch arguments for a chain: its GDC flag (the in-kernel wait), and the launch attribute
    that lets it start before the kernel before it ends."""
    return {"GDC": True, "launch_pdl": True} if on else {"GDC": False}
