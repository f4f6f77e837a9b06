"""Tensor parallelism on a multi-GPU host: TP=N against TP=1 on an 8B-shape model (random weights).

Per world size: decode tok/s at batch 1 and 64, sleep and wake seconds per level, greedy tokens before
and after each level (they must be identical: the stage fails otherwise), and each GPU's memory in use
while asleep beside three references measured first on the same GPUs, one process per GPU: a plain
CUDA process (one small tensor), a process that initialised NCCL and ran one all-reduce (group alive),
and the same after destroy_process_group (what NCCL leaves once initialised: the floor a sleeping
rank, whose group is destroyed, can reach). Device memory is read with nvidia-smi, so no extra CUDA
context is created in the measuring process on the other GPUs.

    python bench/tensor_parallel.py --world 2 --out $OUT
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20
PROMPT = "The quick brown fox jumps over the lazy dog. "


def gpu_used(count: int) -> list[int]:
    """Bytes in use on GPUs 0..count-1, whole device (every process), from nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout.split()
    return [int(v) * MiB for v in out[:count]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hold(kind: str, rank: int, world: int, port: int) -> None:
    """A reference process: set itself up on GPU `rank`, print 'ready', wait until stdin closes."""
    import torch

    torch.cuda.set_device(rank)
    x = torch.ones(1024, device="cuda")
    if kind.startswith("nccl"):
        import torch.distributed as dist

        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
        dist.all_reduce(x)
        torch.cuda.synchronize()
        if kind == "nccl-destroyed":
            dist.destroy_process_group()
    torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.read()


def reference(kind: str, world: int) -> list[int]:
    """GPU memory one reference process per GPU holds (device used minus idle)."""
    idle = gpu_used(world)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--hold", kind, "--rank", str(r), "--world", str(world),
                               "--port", str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for r in range(world if kind.startswith("nccl") else world)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready", f"{kind} reference failed"
        time.sleep(0.5)
        used = gpu_used(world)
    finally:
        for p in procs:
            p.communicate(timeout=60)
    return [u - i for u, i in zip(used, idle)]


def tokens(llm, prompts: list[str], max_tokens: int = 32) -> list[list[int]]:
    from server import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def decode_tps(llm, batch: int, max_tokens: int) -> float:
    from server import SamplingParams

    prompts = [PROMPT + str(i) for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    times = []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(prompts, params)
        times.append(time.perf_counter() - t)
    return batch * max_tokens / statistics.median(times)


def bench_world(folder: Path, world: int, idle: list[int], kv: str, max_tokens: int) -> dict:
    from server import LLM

    t = time.perf_counter()
    llm = LLM(model=str(folder), device="cuda", load_format="dummy", max_model_len=4096, kv_cache_memory=kv,
              tensor_parallel_size=world)
    res: dict = {"world": world, "start_s": time.perf_counter() - t,
                 "awake_used": [u - i for u, i in zip(gpu_used(world), idle)]}
    prompts = [PROMPT * 3, "def fibonacci(n):", "Once upon a time"]
    before = tokens(llm, prompts)
    res["tokens"] = before
    res["decode_tok_s"] = {str(b): decode_tps(llm, b, max_tokens) for b in (1, 64)}
    # Progress lines: a run cut short by a time limit still leaves these figures in the log.
    print(f"TP={world}: started in {res['start_s']:.1f} s, decode tok/s {res['decode_tok_s']}", flush=True)
    for level in (1, 2):
        rows = []
        for _ in range(3):
            s = llm.sleep(level=level)
            time.sleep(0.5)
            asleep = [u - i for u, i in zip(gpu_used(world), idle)]
            t = time.perf_counter()
            llm.wake_up()
            wake_s = time.perf_counter() - t
            if level == 2:
                llm.update_weights()  # the same seeded dummy weights
            rows.append({"sleep_s": s.seconds, "wake_s": wake_s, "asleep_used": asleep,
                         "identical": tokens(llm, prompts) == before})
        res[f"level{level}"] = {"cycles": rows, "sleep_s": statistics.median(r["sleep_s"] for r in rows[1:]),
                                "wake_s": statistics.median(r["wake_s"] for r in rows[1:]),
                                "asleep_used": rows[-1]["asleep_used"],
                                "identical": all(r["identical"] for r in rows)}
        print(f"TP={world} level {level}: {res[f'level{level}']}", flush=True)
    llm.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--kv-cache-memory", default="16GiB")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--hold", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hold:
        hold(args.hold, args.rank, args.world, args.port)
        return

    import torch

    from bench.common import hardware, now_iso, table, write_json
    from tests.models import model_folder

    world = args.world
    if torch.cuda.device_count() < world:
        sys.exit(f"needs {world} GPUs, this host has {torch.cuda.device_count()}")
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    idle = gpu_used(world)
    refs = {kind: reference(kind, world) for kind in ("cuda", "nccl", "nccl-destroyed")}
    print(f"references (bytes per GPU): {refs}", flush=True)
    folder = model_folder(args.model, Path(tempfile.mkdtemp()), max_position_embeddings=131072)
    runs = [bench_world(folder, w, idle, args.kv_cache_memory, args.max_tokens) for w in (1, world)]
    result = {"date": now_iso(), "hardware": hardware(torch.device("cuda")), "nccl": nccl, "model": args.model,
              "references_used": refs, "runs": runs,
              "tp_tokens_equal_tp1": runs[1]["tokens"] == runs[0]["tokens"]}
    one, tp = runs
    result["speedup"] = {b: tp["decode_tok_s"][b] / one["decode_tok_s"][b] for b in one["decode_tok_s"]}
    write_json(args.out, f"tensor-parallel-{world}", result)

    print(f"\ntensor parallel ({result['hardware']}, NCCL {nccl}, {result['date']}; {args.model} dummy weights)")
    print(f"references per GPU: plain CUDA {[round(v / MiB) for v in refs['cuda']]} MiB, NCCL initialised "
          f"{[round(v / MiB) for v in refs['nccl']]} MiB, NCCL after destroy_process_group "
          f"{[round(v / MiB) for v in refs['nccl-destroyed']]} MiB")
    rows = []
    for r in runs:
        for level in (1, 2):
            lv = r[f"level{level}"]
            rows.append([f"TP={r['world']}", f"{r['decode_tok_s']['1']:.1f}", f"{r['decode_tok_s']['64']:.0f}",
                         f"L{level}", f"{lv['sleep_s'] * 1e3:.0f} ms", f"{lv['wake_s'] * 1e3:.0f} ms",
                         " / ".join(f"{(u - c) / MiB:+.0f}" for u, c in zip(lv["asleep_used"], refs["nccl-destroyed"])),
                         " / ".join(f"{(u - c) / MiB:+.0f}" for u, c in zip(lv["asleep_used"], refs["cuda"])),
                         "yes" if lv["identical"] else "NO"])
    print(table(rows, ["run", "bs1 tok/s", "bs64 tok/s", "level", "sleep", "wake",
                       "asleep - NCCL-once ref (MiB/rank)", "asleep - CUDA ref (MiB/rank)", "greedy identical"]))
    print(f"TP={world} / TP=1 decode: batch 1 {result['speedup']['1']:.2f}x, batch 64 {result['speedup']['64']:.2f}x; "
          f"TP={world} tokens equal TP=1's: {result['tp_tokens_equal_tp1']}")
    if not all(r[f"level{lv}"]["identical"] for r in runs for lv in (1, 2)):
        sys.exit("greedy outputs changed after a sleep/wake cycle")


if __name__ == "__main__":
    main()
