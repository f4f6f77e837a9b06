"""Where a decode step's time goes: GPU time of the graph replay (CUDA) against the host-side work
around it (input preparation, sampling, bookkeeping), at batch 1, 64 and 256. The parts are the
engine's own step functions (EngineCore.step = scheduler.schedule -> runner.prepare ->
runner.logits -> runner.sample -> EngineCore.postprocess), called one by one and synchronized. With
--kernels N (CUDA), N more free-running steps under torch.profiler: the device's busy time a step, and the
kernels that took the most of it (graph-launched ones included), per step, to say what a batch size pays for.

    python bench/step_profile.py --out $OUT
    python bench/step_profile.py --device cpu --model llama-tiny --batches 1,64   # indicative only
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import in_thread, sync, table, write_json  # noqa: E402
from testkit.models import shape_folder  # noqa: E402


def profile(llm, batch: int, steps: int, temperature: float = 0.0, logprobs: int | None = None,
            prompt_len: int = 32, kernels: int = 0, top: int = 16) -> dict:
    from server import SamplingParams

    core, runner = llm.engine, llm.engine.runner
    dev = core.device
    cuda = dev.type == "cuda"
    params = SamplingParams(temperature=temperature, max_tokens=steps + kernels + 8, ignore_eos=True, logprobs=logprobs)
    for i in range(batch):
        core.add_request(f"p{batch}-{i}", prompt_token_ids=list(range(1000 + i, 1000 + prompt_len + i)), params=params)
    while any(r.first_token_time is None for r in core.requests.values()):
        core.step()
    # Free-running steps first: the wall time per step as the engine really runs.
    sync(dev)
    t = time.perf_counter()
    for _ in range(steps // 2):
        core.step()
    sync(dev)
    wall = (time.perf_counter() - t) / (steps // 2)
    # Then the same steps taken apart, synchronizing between the parts.
    parts = {"schedule": 0.0, "prepare": 0.0, "forward": 0.0, "sample": 0.0, "bookkeeping": 0.0}
    gpu = 0.0
    n = steps // 2
    for _ in range(n):
        t0 = time.perf_counter()
        batch_ = core.scheduler.schedule()
        t1 = time.perf_counter()
        inputs = runner.prepare(batch_)
        sync(dev)
        t2 = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        logits = runner.logits(inputs)
        if cuda:
            end.record()
        sync(dev)
        t3 = time.perf_counter()
        sampled = runner.sample(inputs, logits, core.eos_ids, core.tokenizer)
        t4 = time.perf_counter()
        core.outputs_for(core.scheduler.update_from_output(batch_, sampled))
        t5 = time.perf_counter()
        gpu += start.elapsed_time(end) / 1e3 if cuda else 0.0
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            parts[k] += v
    traced = kernel_times(core, kernels, top) if kernels and cuda else {}
    core.abort_all()
    return {"batch": batch, "prompt_len": prompt_len, "wall_ms": 1e3 * wall, "graph_gpu_ms": 1e3 * gpu / n,
            **{f"{k}_ms": 1e3 * v / n for k, v in parts.items()}, **traced}


def kernel_times(core, steps: int, top: int = 16) -> dict:
    """`steps` free-running steps under torch.profiler (device activity only): the device's busy ms and
    span a step, and the `top` kernels by device time, in microseconds a step (name, us, launches a step)."""
    from torch.profiler import ProfilerActivity, profile as traced

    from server.engine.step_profiler import device_busy

    with traced(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
        sync(core.device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy, span = device_busy(events)
    total: dict[str, list] = {}
    for e in events:
        t = total.setdefault(e.name, [0.0, 0])
        t[0] += e.time_range.end - e.time_range.start
        t[1] += 1
    ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:top]
    return {"device_busy_ms": busy / steps / 1e3, "device_span_ms": span / steps / 1e3,
            "kernels": [(name[:90], us / steps, count / steps) for name, (us, count) in ranked]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--logprobs", type=int, default=None, help="ask for log-probs on every token (RL rollouts: 0)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens: the decode steps' context (RL "
                    "rollouts: 128 prompt + up to 512 new tokens)")
    ap.add_argument("--kernels", type=int, default=0, help="trace this many more steps: the top kernels (CUDA)")
    ap.add_argument("--top", type=int, default=16, help="kernels listed a batch size (with --kernels)")
    ap.add_argument("--batch-invariant", action="store_true", help="the batch-invariant mode's step")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    from server import LLM

    folder = shape_folder(args.model, Path(tempfile.mkdtemp()))
    batches = [int(b) for b in args.batches.split(",")]
    kv = {"kv_cache_memory": "1GiB"} if args.device == "cpu" else {}
    llm = LLM(model=str(folder), device=args.device, load_format="dummy", max_num_seqs=max(batches),
              max_model_len=2048, batch_invariant=args.batch_invariant, **kv)
    # On a thread, as the server drives the engine (bench/common.in_thread says why it matters on CPU).
    rows = [in_thread(profile, llm, b, args.steps, args.temperature, args.logprobs, args.prompt_len, args.kernels,
                      args.top)
            for b in batches]
    llm.close()
    sampled = args.temperature or args.logprobs is not None
    write_json(args.out, "step_profile" + ("" if args.device == "cuda" else "-cpu") + ("-sampled" if sampled else "")
               + ("" if args.prompt_len == 32 else f"-prompt{args.prompt_len}")
               + ("-binv" if args.batch_invariant else ""),
               {"model": args.model, "batch_invariant": args.batch_invariant, "temperature": args.temperature,
                "logprobs": args.logprobs, "rows": rows})
    keys = ["wall_ms", "graph_gpu_ms", "schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "bookkeeping_ms"]
    mode = ", batch-invariant" if args.batch_invariant else ""
    print(f"\nstep profile ({args.model}{mode}, {args.device}, temperature {args.temperature}, "
          f"logprobs {args.logprobs}, {args.prompt_len}-token prompts)")
    print(table([[r["batch"]] + [f"{r[k]:.3f}" for k in keys] for r in rows], ["batch"] + keys))
    for r in rows:
        if "kernels" in r:
            print(f"\nbatch {r['batch']}: device busy {r['device_busy_ms']:.3f} of {r['device_span_ms']:.3f} ms a step; "
                  "top kernels, us a step (launches a step)")
            print(table([[name, f"{us:.1f}", f"{count:g}"] for name, us, count in r["kernels"]],
                        ["kernel", "us/step", "launches/step"]))


if __name__ == "__main__":
    main()
