"""Sleep and wake of whole engines (in process), for ~1B and ~8B models with random weights.

Per model: sleep and wake seconds for levels 1 and 2 over several cycles (cycle 1 pins the host
backup; later cycles reuse it), the effective GB/s of level 1 beside the raw pinned copy GB/s
measured in this run, device memory in use while asleep beside a bare CUDA process, time to first
token before sleep and right after wake, and a plot of device memory over one level-1 cycle.

    python bench/sleep_wake.py --device cuda --out $OUT
    python bench/sleep_wake.py --device cpu           # the CPU backend: RSS instead of device memory
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import hardware, now_iso, table, write_json  # noqa: E402
from testkit.models import model_folder  # noqa: E402

MiB, GB = 1 << 20, 1e9


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def used(device: torch.device) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    return rss()


def raw_pinned_gbps(nbytes: int = 4 << 30) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[name] = nbytes / statistics.median(times) / GB
    del host, dev
    torch.cuda.empty_cache()
    return out


class Sampler(threading.Thread):
    """Device memory in use every few milliseconds, for the plot."""

    def __init__(self, device: torch.device, period: float = 0.005):
        super().__init__(daemon=True)
        self.device, self.period, self.points, self.stop_flag = device, period, [], False
        self.t0 = time.perf_counter()

    def run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        while not self.stop_flag:
            self.points.append((time.perf_counter() - self.t0, used(self.device) / GB))
            time.sleep(self.period)


def ttft(llm) -> float:
    from server import SamplingParams

    t = time.perf_counter()
    llm.generate("The quick brown fox jumps over the lazy dog. " * 8, SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - t


def bench_model(name: str, device: torch.device, cycles: int) -> dict:
    from server import LLM

    if device.type == "cuda":
        folder = model_folder(name, Path(tempfile.mkdtemp()), max_position_embeddings=131072)
        llm = LLM(model=str(folder), device="cuda", load_format="dummy", max_model_len=4096)
    else:
        llm = LLM(device="cpu", kv_cache_memory="512MiB")
    core = llm.engine
    weight_bytes = sum(p.numel() * p.element_size() for p in core.model.parameters())
    stats = core.pool.stats().as_dict()["tags"]
    res = {"model": name, "parameters": sum(p.numel() for p in core.model.parameters()),
           "weight_bytes": weight_bytes, "pool_bytes": {t: v["bytes"] for t, v in stats.items()}}
    ttft(llm)
    res["ttft_before_s"] = statistics.median(ttft(llm) for _ in range(3))
    for level in (1, 2):
        rows = []
        for c in range(cycles):
            awake = used(device)
            s = llm.sleep(level=level)
            asleep = used(device)
            t = time.perf_counter()
            llm.wake_up()
            wake_s = time.perf_counter() - t
            if level == 2:
                llm.update_weights()
            first = ttft(llm)
            rows.append({"sleep_s": s.seconds, "wake_s": wake_s, "awake_used": awake, "asleep_used": asleep,
                         "ttft_after_wake_s": first})
        later = rows[1:] or rows
        summary = {"cycles": rows, "sleep_s_cycle1": rows[0]["sleep_s"], "wake_s_cycle1": rows[0]["wake_s"],
                   "sleep_s": statistics.median(r["sleep_s"] for r in later),
                   "wake_s": statistics.median(r["wake_s"] for r in later),
                   "asleep_used": statistics.median(r["asleep_used"] for r in later),
                   "ttft_after_wake_s": statistics.median(r["ttft_after_wake_s"] for r in later)}
        if level == 1:
            summary["sleep_gbps"] = weight_bytes / summary["sleep_s"] / GB
            summary["wake_gbps"] = weight_bytes / summary["wake_s"] / GB
        res[f"level{level}"] = summary
    # One more level-1 cycle, sampled, for the plot.
    sampler = Sampler(device)
    sampler.start()
    time.sleep(0.05)
    marks = {}
    marks["sleep"] = time.perf_counter() - sampler.t0
    llm.sleep(level=1)
    time.sleep(0.3)
    marks["wake_up"] = time.perf_counter() - sampler.t0
    llm.wake_up()
    marks["generate"] = time.perf_counter() - sampler.t0
    ttft(llm)
    time.sleep(0.05)
    sampler.stop_flag = True
    sampler.join()
    res["timeline"] = {"points": sampler.points, "marks": marks}
    llm.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def plot(models: list[dict], path: Path, device: torch.device) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 3.6), squeeze=False)
    for ax, m in zip(axes[0], models):
        pts = m["timeline"]["points"]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.5)
        for label, x in m["timeline"]["marks"].items():
            ax.axvline(x, color="grey", ls=":", lw=1)
            ax.text(x, ax.get_ylim()[1] * 0.95, label, rotation=90, va="top", fontsize=8)
        ax.set_xlabel("seconds")
        ax.set_ylabel("device memory in use (GB)" if device.type == "cuda" else "process RSS (GB)")
        ax.set_title(f"{m['model']}: level-1 sleep / wake / generate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--models", default="llama-1b,llama-8b")
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    device = torch.device(args.device)
    result = {"date": now_iso(), "hardware": hardware(device)}
    if device.type == "cuda":
        from testkit.footprint import bare_process_used
        result["bare_process_used"] = bare_process_used(device.index or 0)
        result["raw_pinned_gbps"] = raw_pinned_gbps()
        names = args.models.split(",")
    else:
        names = ["SmolLM2-135M"]
    models = [bench_model(n, device, args.cycles) for n in names]
    result["models"] = models
    write_json(args.out, f"sleep-wake-{device.type}", result)
    plot(models, args.out / f"sleep-wake-{device.type}.png", device)

    raw = result.get("raw_pinned_gbps", {})
    bare = result.get("bare_process_used")
    rows = []
    for m in models:
        l1, l2 = m["level1"], m["level2"]
        over = [f"{(l['asleep_used'] - bare) / MiB:+.0f} MiB" if bare else f"{l['asleep_used'] / MiB:.0f} MiB RSS"
                for l in (l1, l2)]
        rows.append([m["model"], f"{m['weight_bytes'] / GB:.2f} GB",
                     f"{l1['sleep_s'] * 1e3:.0f} ms ({l1['sleep_gbps']:.1f} GB/s"
                     + (f", {100 * l1['sleep_gbps'] / raw['d2h']:.0f}%)" if raw else ")"),
                     f"{l1['wake_s'] * 1e3:.0f} ms ({l1['wake_gbps']:.1f} GB/s"
                     + (f", {100 * l1['wake_gbps'] / raw['h2d']:.0f}%)" if raw else ")"),
                     f"{l2['sleep_s'] * 1e3:.1f} ms", f"{l2['wake_s'] * 1e3:.1f} ms", over[0], over[1],
                     f"{m['ttft_before_s'] * 1e3:.1f} -> {l1['ttft_after_wake_s'] * 1e3:.1f} ms "
                     f"({l1['ttft_after_wake_s'] / m['ttft_before_s']:.2f}x)"])
    print(f"\nsleep/wake ({result['hardware']}, {result['date']}; cycles >= 2, median)")
    if raw:
        print(f"raw pinned copy: D2H {raw['d2h']:.1f} GB/s, H2D {raw['h2d']:.1f} GB/s; "
              f"bare CUDA process {bare / MiB:.0f} MiB")
    print(table(rows, ["model", "weights", "L1 sleep", "L1 wake", "L2 sleep", "L2 wake", "asleep vs bare (L1)",
                       "asleep vs bare (L2)", "TTFT before -> after L1 wake"]))


if __name__ == "__main__":
    main()
