"""The sampler's device time per step: the fused one-pass kernel (server/engine/fused_sample.py) against the
torch path it replaces, on the same logits, with the bytes of one pass over the logits as the reference.

Each case is a batch of rows of a 128k vocabulary (the 1B and 8B Llama shapes), as the engine samples them:
RL rollouts (temperature 1, logprobs=0), plain sampling (no log-probs), greedy with log-probs; the logits in
bfloat16 by default, as a decode graph hands them over (the torch path converts them to float32 first, the
fused one reads them as they are; --dtype float32 for an eager step's). Times are the
device's (the kernels' durations over 20 calls as torch.profiler records them, the median of 5 runs), the
host's launches not included.

    python bench/sampler.py --out $OUT
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, hardware, now_iso, table, write_json  # noqa: E402

CASES = {  # name: (temperature, logprobs)
    "rollout (T=1, logprobs=0)": (1.0, 0),
    "sampling (T=0.8, no log-probs)": (0.8, None),
    "greedy, logprobs=0": (0.0, 0),
}


def device_ms(fn, calls: int = 20, runs: int = 5) -> float:
    """The device's busy time per call: the sum of the kernels' and copies' durations that torch.profiler
    records over `calls` calls (median of `runs`). CUDA events around the calls would time the host instead
    wherever its launches are slower than the kernels (one row: ~0.2 ms a call either way, H200 2026-12-02)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        busy_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
        times.append(busy_us / 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    from server import SamplingParams
    from server.engine.sampler import SamplingMeta, sample_on_device

    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    rows = []
    for name, (temperature, logprobs) in CASES.items():
        params = SamplingParams(temperature=temperature, logprobs=logprobs, max_tokens=16)
        for batch in (int(b) for b in args.batches.split(",")):
            seqs = [SimpleNamespace(params=params, generator=None) for _ in range(batch)]
            logits = (torch.randn(batch, args.vocab, device=dev) * 3).to(getattr(torch, args.dtype))
            fused = SamplingMeta(seqs, dev)
            plain = SamplingMeta(seqs, dev)
            plain.fused_temps = None  # the torch path, on the same rows
            times = {label: device_ms(lambda m=meta: sample_on_device(logits, seqs, frozenset(), m))
                     for label, meta in (("torch", plain), ("fused", fused))}
            one_pass_ms = batch * args.vocab * logits.element_size() / bandwidth * 1e3
            rows.append({"case": name, "batch": batch, "torch_ms": times["torch"], "fused_ms": times["fused"],
                         "speedup": times["torch"] / times["fused"], "one_pass_ms": one_pass_ms,
                         "fused_path": fused.fused_temps is not None})
    write_json(args.out, "sampler", {"date": now_iso(), "hardware": hardware(dev), "vocab": args.vocab, "dtype": args.dtype,
                                     "copy_bandwidth_GBs": bandwidth / 1e9, "rows": rows})
    print(f"\nsampler device time per step (vocab {args.vocab}, {args.dtype} logits, {hardware(dev)}, {now_iso()})")
    print(table([[r["case"], r["batch"], f"{r['torch_ms']:.3f}", f"{r['fused_ms']:.3f}", f"{r['speedup']:.2f}x",
                  f"{r['one_pass_ms']:.3f}"] for r in rows],
                ["case", "rows", "torch ms", "fused ms", "torch / fused", "one pass over the logits ms"]))


if __name__ == "__main__":
    main()
