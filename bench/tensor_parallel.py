"""Tensor parallelism on a multi-GPU host: TP=N against TP=1 on an 8B-shape model (random weights).

Per run (TP=1, then TP=N with each --tp-all-reduce backend asked, nccl and symm by default): decode
step time and tok/s at batch 1, 8 and 64, decode only (the difference between a 16- and a 144-token
generate, so prefill cancels out), with each rank's step lag (how long after rank 0 sent a step each
rank launched it, and whether any step ran without its CUDA graph); sleep and wake seconds per level,
greedy tokens before and after each level (they must be identical: the stage fails otherwise), and
each GPU's memory in use while asleep beside three references measured first on the same GPUs, one process per GPU: a plain
CUDA process (one small tensor), a process that initialised NCCL and ran one all-reduce (group alive),
and the same after destroy_process_group (what NCCL leaves once initialised: the floor a sleeping
rank, whose group is destroyed, can reach). Device memory is read with nvidia-smi, so no extra CUDA
context is created in the measuring process on the other GPUs.

A last run repeats the last backend with workers that block in recv at once (no spin-poll) and no
sleep cycles: the difference is what the spin buys.

--async-scheduling off,on measures each run's decode steps both ways on the same engine (switched between
steps: same weights, same graphs): on, step t+1 is launched on every rank before t's tokens reach rank 0's
host (rank 0 broadcasts them on the device communicator); each row is labelled with its mode, and the
speed-ups are against TP=1 with async off and with the same mode.

    python bench/tensor_parallel.py --world 2 --out $OUT
    python bench/tensor_parallel.py --world 2 --profile          # each rank's top GPU kernels at batch 64
    python bench/tensor_parallel.py --world 2 --all-reduce nccl --async-scheduling off,on --no-spin-run \
        --no-cycles --no-references                             # async off vs on only (make gpu-check ARGS=tp-async)
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


def decode(llm, batch: int, short: int, long: int) -> dict:
    """Decode only: generate `short` and `long` new tokens (ignore_eos, same prompts, their prefill
    cached after the first call) and divide the difference by the extra tokens, so the prefill and
    the request's set-up cancel out. With tensor parallelism, also each rank's StepLag over the
    timed steps (parallel/steps.py: how long after rank 0's send each rank launched a step)."""
    from server import SamplingParams

    prompts = [PROMPT + str(i) for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up, prefix cached
    runner = llm.engine.runner
    lagged = hasattr(runner, "step_lag")
    if lagged:
        runner.step_lag()  # clear
    times: dict[int, list[float]] = {short: [], long: []}
    for _ in range(3):
        for n in (short, long):
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            times[n].append(time.perf_counter() - t)
    t_short, t_long = statistics.median(times[short]), statistics.median(times[long])
    step = (t_long - t_short) / (long - short)
    res = {"step_ms": step * 1e3, "tok_s": batch / step, "short_s": t_short, "long_s": t_long}
    if lagged:
        res["lag"] = {str(r): v for r, v in runner.step_lag().items()}
    return res


def lag_text(lag: dict | None) -> str:
    """'rank 1 recv 21/35 us, launch 48/70 (rank 0 launch 30/41)' (median/p90), eager steps when any."""
    if not lag:
        return ""
    parts = []
    for rank, v in sorted(lag.items(), key=lambda kv: int(kv[0])):
        if not v:
            continue
        text = f"rank {rank}"
        if "recv_us" in v:
            text += f" recv {v['recv_us']['median']:.0f}/{v['recv_us']['p90']:.0f} us,"
        text += f" launch {v['launch_us']['median']:.0f}/{v['launch_us']['p90']:.0f} us"
        if v.get("eager_steps"):
            text += f" ({v['eager_steps']} eager steps!)"
        parts.append(text)
    return "; ".join(parts)


def mode_label(mode: str, args) -> str:
    """' async on' / ' async off' when both modes run, else nothing (the labels of a one-mode run as before)."""
    return f" async {mode}" if len(args.asyncs) > 1 or mode == "on" else ""


def bench_world(folder: Path, label: str, world: int, all_reduce: str, idle: list[int], args, cycles: bool) -> dict:
    from server import LLM

    t = time.perf_counter()
    llm = LLM(model=str(folder), device="cuda", load_format="dummy", max_model_len=4096,
              kv_cache_memory=args.kv_cache_memory, tensor_parallel_size=world, tp_all_reduce=all_reduce)
    ranks = llm.engine.runner.ranks()
    res: dict = {"label": label, "world": world, "all_reduce_asked": all_reduce,
                 "all_reduce": [r.get("all_reduce", "-") for r in ranks], "start_s": time.perf_counter() - t,
                 "awake_used": [u - i for u, i in zip(gpu_used(world), idle)]}
    print(f"{label}: started in {res['start_s']:.1f} s, all-reduce per rank {res['all_reduce']}", flush=True)
    prompts = [PROMPT * 3, "def fibonacci(n):", "Once upon a time"]
    before = tokens(llm, prompts)
    res["tokens"] = before
    res["decode_async"] = {}
    for mode in args.asyncs:
        llm.engine.set_async_scheduling(mode == "on")
        if mode == "on" and not llm.engine.async_scheduling:
            sys.exit(f"{label}: async scheduling did not turn on")
        ahead = llm.engine.steps_ahead
        res["decode_async"][mode] = {}
        for b in args.batches:
            d = res["decode_async"][mode][str(b)] = decode(llm, b, args.short, args.long)
            # Progress lines: a run cut short by a time limit still leaves these figures in the log.
            print(f"{label}{mode_label(mode, args)} batch {b}: decode step {d['step_ms']:.3f} ms ({d['tok_s']:.0f} tok/s); "
                  f"{args.short} tokens {d['short_s'] * 1e3:.0f} ms, {args.long} tokens {d['long_s'] * 1e3:.0f} ms"
                  + (f"; {lag_text(d.get('lag'))}" if d.get("lag") else ""), flush=True)
        if mode == "on":
            res["steps_ahead"] = llm.engine.steps_ahead - ahead
            if not res["steps_ahead"]:
                sys.exit(f"{label}: async scheduling on, but no step went ahead")
        llm.reset_prefix_cache()  # the first run's prefill shapes again (bf16 rounding follows the shapes)
        tokens_now = tokens(llm, prompts)
        res.setdefault("tokens_by_mode", {})[mode] = tokens_now
        if tokens_now != before:
            print(f"{label}{mode_label(mode, args)}: greedy tokens differ from the first run's!", flush=True)
    llm.engine.set_async_scheduling(False)
    res["decode"] = res["decode_async"][args.asyncs[0]]
    res["decode_tok_s"] = {b: d["tok_s"] for b, d in res["decode"].items()}
    for level in (1, 2) if cycles else ():
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
        print(f"{label} level {level}: {res[f'level{level}']}", flush=True)
    t = time.perf_counter()
    llm.close()
    res["close_s"] = time.perf_counter() - t
    print(f"{label}: closed in {res['close_s']:.1f} s", flush=True)
    return res


def profile_world(folder: Path, label: str, world: int, all_reduce: str, args) -> None:
    """torch.profiler on every rank over decode steps at one batch: the GPU kernels that take the most
    time per step on each (CUDA graphs' kernels included), to find what a step spends its time on. A
    rank that waits for a late peer shows it as time in the all-reduce kernels."""
    import torch
    from server import LLM, SamplingParams
    from server.engine.parallel.worker import gpu_ops

    from bench.common import table

    llm = LLM(model=str(folder), device="cuda", load_format="dummy", max_model_len=4096,
              kv_cache_memory=args.kv_cache_memory, tensor_parallel_size=world, tp_all_reduce=all_reduce)
    runner = llm.engine.runner
    workers = getattr(runner, "workers", None)
    b, n = args.profile_batch, 24
    prompts = [PROMPT + str(i) for i in range(b)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    if workers is not None:
        for r in workers.conns:
            workers.send_one(r, "profile", "start")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        torch.cuda.synchronize()
    per_rank = {0: gpu_ops(prof)}
    if workers is not None:
        for r in workers.conns:
            per_rank[r] = workers.send_one(r, "profile", "stop")
    llm.close()
    for rank, rows in per_rank.items():
        total = sum(g for g, _, _ in rows)
        print(f"\nprofile {label} batch {b}, rank {rank}, {n} new tokens ({n - 1} decode steps and the prefill): "
              f"GPU total {total / 1e3:.2f} ms, {total / 1e3 / (n - 1):.3f} ms per step", flush=True)
        print(table([[f"{g / 1e3 / (n - 1):.3f}", c, k[:90]] for g, c, k in rows[:15]],
                    ["ms per step", "calls", "GPU op / kernel"]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--kv-cache-memory", default="16GiB")
    ap.add_argument("--batches", default="1,8,64", help="decode batch sizes")
    ap.add_argument("--short", type=int, default=16, help="new tokens of the short generate")
    ap.add_argument("--long", type=int, default=144, help="new tokens of the long generate")
    ap.add_argument("--all-reduce", default="nccl,symm", help="--tp-all-reduce values to run at TP=world")
    ap.add_argument("--async-scheduling", default="on",
                    help="on (the server's default), off, or off,on: decode steps with async scheduling off and/or on "
                         "(one engine per run, switched between them)")
    ap.add_argument("--no-cycles", action="store_true", help="skip the sleep/wake cycles")
    ap.add_argument("--no-references", action="store_true",
                    help="skip the reference processes (plain CUDA, NCCL) the asleep memory is compared with")
    ap.add_argument("--no-spin-run", action="store_true",
                    help="skip the extra run whose workers block in recv (SLEEPSERVE_TP_WORKER_SPIN_US=0)")
    ap.add_argument("--profile", action="store_true",
                    help="instead: profile each rank's decode steps at --profile-batch, TP=1 and TP=world")
    ap.add_argument("--profile-batch", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--hold", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hold:
        hold(args.hold, args.rank, args.world, args.port)
        return
    args.batches = [int(b) for b in args.batches.split(",")]
    args.asyncs = [m for m in args.async_scheduling.split(",") if m]
    if not args.asyncs or any(m not in ("off", "on") for m in args.asyncs):
        sys.exit(f"--async-scheduling takes off, on or off,on; got {args.async_scheduling!r}")
    reduces = [a for a in args.all_reduce.split(",") if a]

    import torch

    from bench.common import hardware, now_iso, table, write_json
    from testkit.models import model_folder

    world = args.world
    if torch.cuda.device_count() < world:
        sys.exit(f"needs {world} GPUs, this host has {torch.cuda.device_count()}")
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    folder = model_folder(args.model, Path(tempfile.mkdtemp()), max_position_embeddings=131072)
    if args.profile:
        profile_world(folder, "TP=1", 1, "nccl", args)
        for a in reduces:
            profile_world(folder, f"TP={world} {a}", world, a, args)
        return
    idle = gpu_used(world)
    kinds = () if args.no_references else ("cuda", "nccl", "nccl-destroyed")
    refs = {kind: reference(kind, world) for kind in kinds}
    print(f"references (bytes per GPU): {refs}", flush=True)
    cycles = not args.no_cycles
    plan = [("TP=1", 1, "nccl", cycles)] + [(f"TP={world} {a}", world, a, cycles) for a in reduces]
    runs = [bench_world(folder, label, w, a, idle, args, cycles) for label, w, a, cycles in plan]
    if not args.no_spin_run and reduces:
        # The same as the last TP run but with workers that block in recv at once: what the spin buys.
        os.environ["SLEEPSERVE_TP_WORKER_SPIN_US"] = "0"  # the workers read it (they inherit the environment)
        try:
            runs.append(bench_world(folder, f"TP={world} {reduces[-1]} no spin", world, reduces[-1], idle, args,
                                    cycles=False))
        finally:
            del os.environ["SLEEPSERVE_TP_WORKER_SPIN_US"]
    one = runs[0]
    result = {"date": now_iso(), "hardware": hardware(torch.device("cuda")), "nccl": nccl, "model": args.model,
              "decode_tokens": [args.short, args.long], "references_used": refs, "runs": runs,
              "tokens_equal_tp1": {r["label"]: r["tokens"] == one["tokens"] for r in runs[1:]},
              "speedup": {r["label"]: {b: r["decode"][b]["tok_s"] / one["decode"][b]["tok_s"] for b in one["decode"]}
                          for r in runs[1:]},
              # every (run, mode) against TP=1 with async off and against TP=1 with the same mode
              "speedup_async": {f"{r['label']} async {m}": {
                  b: {"vs_tp1_off": d[b]["tok_s"] / one["decode_async"][args.asyncs[0]][b]["tok_s"],
                      "vs_tp1_same": d[b]["tok_s"] / one["decode_async"][m][b]["tok_s"]} for b in d}
                  for r in runs for m, d in r["decode_async"].items() if m in one["decode_async"]}}
    write_json(args.out, f"tensor-parallel-{world}", result)

    print(f"\ntensor parallel ({result['hardware']}, NCCL {nccl}, {result['date']}; {args.model} dummy weights; "
          f"decode step = (generate {args.long} - generate {args.short} new tokens) / {args.long - args.short})")
    if refs:
        print(f"references per GPU: plain CUDA {[round(v / MiB) for v in refs['cuda']]} MiB, NCCL initialised "
              f"{[round(v / MiB) for v in refs['nccl']]} MiB, NCCL after destroy_process_group "
              f"{[round(v / MiB) for v in refs['nccl-destroyed']]} MiB")
    rows = []
    base = args.asyncs[0]
    for r in runs:
        for m, dec in r["decode_async"].items():
            speed = result["speedup_async"][f"{r['label']} async {m}"] if r is not one or m != base else None
            rows.append([r["label"] + mode_label(m, args), "/".join(r["all_reduce"])]
                        + [f"{dec[str(b)]['step_ms']:.3f} ms ({dec[str(b)]['tok_s']:.0f})" for b in args.batches]
                        + ([" / ".join(f"{speed[str(b)]['vs_tp1_off']:.2f}x" for b in args.batches)] if speed else ["-"])
                        + (([" / ".join(f"{speed[str(b)]['vs_tp1_same']:.2f}x" for b in args.batches)]
                            if speed and r is not one else ["-"]) if len(args.asyncs) > 1 else [])
                        + [lag_text(dec[str(args.batches[0])].get("lag")) or "-"])
    print(table(rows, ["run", "all-reduce per rank"] + [f"batch {b}: step (tok/s)" for b in args.batches]
                + [f"vs TP=1{mode_label(base, args)}"] + (["vs TP=1 same mode"] if len(args.asyncs) > 1 else [])
                + [f"step lag at batch {args.batches[0]} (median/p90 after rank 0's send)"]))
    rows = []
    for r in runs:
        for level in (1, 2):
            lv = r.get(f"level{level}")
            if lv is None:
                continue
            rows.append([r["label"], f"L{level}", f"{lv['sleep_s'] * 1e3:.0f} ms", f"{lv['wake_s'] * 1e3:.0f} ms",
                         " / ".join(f"{(u - c) / MiB:+.0f}" for u, c in zip(lv["asleep_used"],
                                                                          refs.get("nccl-destroyed", [0] * world))),
                         " / ".join(f"{(u - c) / MiB:+.0f}" for u, c in zip(lv["asleep_used"], refs.get("cuda", [0] * world))),
                         "yes" if lv["identical"] else "NO"])
    if rows:
        print(table(rows, ["run", "level", "sleep", "wake", "asleep - NCCL-once ref (MiB/rank)",
                           "asleep - CUDA ref (MiB/rank)", "greedy identical"]))
    for label, speed in result["speedup"].items():
        print(f"{label} / TP=1 decode: " + ", ".join(f"batch {b} {v:.2f}x" for b, v in speed.items())
              + f"; tokens equal TP=1's: {result['tokens_equal_tp1'][label]}")
    if "on" in args.asyncs and "off" in args.asyncs:
        for r in runs:
            off, on = r["decode_async"]["off"], r["decode_async"]["on"]
            print(f"async scheduling on / off, {r['label']}: " + ", ".join(
                f"batch {b} {off[str(b)]['step_ms']:.3f} -> {on[str(b)]['step_ms']:.3f} ms "
                f"({off[str(b)]['step_ms'] / on[str(b)]['step_ms']:.2f}x)" for b in args.batches))
    if not all(r[f"level{lv}"]["identical"] for r in runs for lv in (1, 2) if f"level{lv}" in r):
        sys.exit("greedy outputs changed after a sleep/wake cycle")
    if not all(t == r["tokens"] for r in runs for t in r["tokens_by_mode"].values()):
        sys.exit("greedy outputs differ between async scheduling off and on")


if __name__ == "__main__":
    main()
