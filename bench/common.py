"""Helpers shared by the benchmarks: timing, result files, tables, the machine's description."""
from __future__ import annotations

import datetime as dt
import json
import platform
import time
from pathlib import Path

import torch


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    import os
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def graph_ms(fn, device: torch.device, replays: int = 10, per_replay: int = 1) -> float:
    """Median milliseconds of fn's work as a decode step runs it: fn() warmed (compiled) on a side stream,
    captured in one CUDA graph, replayed `replays` times, each replay timed with CUDA events and divided by
    per_replay (the calls fn makes per capture)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # compile, pick cuBLAS's kernels, outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / per_replay)
    del graph
    return sorted(times)[len(times) // 2]


def gpu_clocks() -> dict | None:
    """The GPU's SM clock and temperature now (nvidia-smi), or None where there is none:
    beside a timing that a run compares with another taken minutes apart (a warm GPU may clock lower)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    fields = "clocks.sm,temperature.gpu"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    values = [v.strip() for v in line.split(",")]
    return dict(zip(("sm_mhz", "temperature_c"), values)) if len(values) == 2 else None


def write_json(out: Path, name: str, data: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def table(rows: list[list], header: list[str]) -> str:
    cells = [[str(c) for c in r] for r in [header] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = int(gib * (1 << 30)) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / times[len(times) // 2]


def in_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a fresh thread, as the server drives its engine; its result or its
    exception. On a busy CPU host, torch's intra-op thread team is much slower from the main thread
    (measured: llama-tiny, 2 cores under load 7, 8 steps 6.8 s on the main thread, 0.9 s on a thread)."""
    import threading

    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="bench-engine")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def server_steps(url: str, api_key: str) -> int | None:
    """Engine steps the server has run (vllm:iteration_tokens_total's count on /metrics; None without it)."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=30).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("vllm:iteration_tokens_total_count"):
            return int(float(line.rsplit(" ", 1)[1]))
    return None
