"""Where a decode step's time goes (CUDA): GPU time of the graph replay against the host-side work
around it (input preparation, sampling, bookkeeping), at batch 1 and 64. The parts are the
engine's own step functions (EngineCore.step = scheduler.schedule -> runner.prepare ->
runner.logits -> runner.sample -> EngineCore.postprocess), called one by one and synchronized.

    python bench/step_profile.py --out $OUT
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import table, write_json  # noqa: E402
from tests.models import model_folder  # noqa: E402


def profile(llm, batch: int, steps: int) -> dict:
    from server import SamplingParams

    core, runner = llm.engine, llm.engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"p{batch}-{i}", prompt_token_ids=list(range(1000 + i, 1032 + i)), params=params)
    while any(r.first_token_time is None for r in core.requests.values()):
        core.step()
    # Free-running steps first: the wall time per step as the engine really runs.
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps // 2):
        core.step()
    torch.cuda.synchronize()
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
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = runner.logits(inputs)
        end.record()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        sampled = runner.sample(inputs, logits, core.eos_ids, core.tokenizer)
        t4 = time.perf_counter()
        core.postprocess(batch_, sampled)
        t5 = time.perf_counter()
        gpu += start.elapsed_time(end) / 1e3
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            parts[k] += v
    core.abort_all()
    return {"batch": batch, "wall_ms": 1e3 * wall, "graph_gpu_ms": 1e3 * gpu / n,
            **{f"{k}_ms": 1e3 * v / n for k, v in parts.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    from server import LLM

    folder = model_folder(args.model, Path(tempfile.mkdtemp()), max_position_embeddings=131072)
    llm = LLM(model=str(folder), device="cuda", load_format="dummy", max_num_seqs=64, max_model_len=2048)
    rows = [profile(llm, b, args.steps) for b in (1, 64)]
    llm.close()
    write_json(args.out, "step_profile", {"model": args.model, "rows": rows})
    keys = ["wall_ms", "graph_gpu_ms", "schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "bookkeeping_ms"]
    print(f"\nstep profile ({args.model})")
    print(table([[r["batch"]] + [f"{r[k]:.3f}" for k in keys] for r in rows], ["batch"] + keys))


if __name__ == "__main__":
    main()
