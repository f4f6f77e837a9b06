"""torch.profiler over the engine's steps, on demand: vLLM's VLLM_TORCH_PROFILER_DIR with POST /start_profile
and /stop_profile (and LLM.start_profile() / stop_profile() in process).

Why: a benchmark through HTTP cannot see inside the engine process. Tracing a few steps of it says whether
the device waits for the host between steps (its busy share of the traced span) and which kernels and host
calls fill a step. The 1B rollout's in-process trace found the collector's cost that way (2026-12-01).
The engine thread starts and stops it (torch.profiler wants one thread for both). Its trace is written as a
gzipped Chrome trace (open it in ui.perfetto.dev). Only the engine's rank 0 is traced. Not for production:
profiling slows every step.
"""
from __future__ import annotations

import gzip
import os
import shutil
import time
from pathlib import Path

import torch

def device_busy(events) -> tuple[float, float]:
    """(microseconds the device was busy, microseconds from its first event to its last) over a profile's
    events: the union of the kernels' and copies' intervals. (0, 0) without device events (a CPU engine)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return 0.0, 0.0
    busy, end = 0.0, spans[0][0]
    for lo, hi in spans:
        busy += max(0, hi - max(lo, end))
        end = max(end, hi)
    return busy, spans[-1][1] - spans[0][0]


def write_trace(prof, raw: Path) -> Path:
    """A stopped torch.profiler's Chrome trace, gzipped beside where `raw` would be (tens of MB as JSON); the
    raw file is removed whatever happens. Returns the .gz path."""
    packed = raw.with_name(raw.name + ".gz")
    try:
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(packed, "wb") as dst:
            shutil.copyfileobj(src, dst)
    finally:
        raw.unlink(missing_ok=True)
    return packed


class StepProfiler:
    """One trace at a time into `folder`: start(), then stop() writes it and says where."""

    def __init__(self, folder: Path, device: torch.device):
        self.folder = folder
        self.device = device
        self._prof = None
        self._started = 0.0

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        """Start tracing (a no-op while a trace runs, as vLLM's). The folder is made now: a trace that could
        not be written is refused before it costs anything."""
        if self._prof is not None:
            return
        from torch.profiler import ProfilerActivity, profile

        self.folder.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities)
        prof.start()  # may raise (another profiler running): then nothing is running here either
        self._prof, self._started = prof, time.time()

    def stop(self) -> dict:
        """Stop, write the trace, and report it: its path, its length, the device's busy share of the span
        its events cover (None on a CPU engine). {"trace": None} when no trace was running."""
        prof, self._prof = self._prof, None
        if prof is None:
            return {"trace": None}
        prof.stop()
        stamp = time.strftime('%Y%m%d-%H%M%S', time.gmtime(self._started))
        trace = write_trace(prof, self.folder / f"engine-{os.getpid()}-{stamp}.json")  # the folder made by start()
        busy, span = device_busy(prof.events())
        return {"trace": str(trace), "seconds": time.time() - self._started,
                "device_busy_share": busy / span if span else None}
