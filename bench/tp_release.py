"""What a sleep does with NCCL's communicator on a multi-GPU host, and what it gives back: kept (the default
with NCCL < 2.29.7), released (--tp-release-comm-on-sleep: destroyed, then re-created and the decode graphs
re-captured by the wake) and suspended (--tp-comm-suspend auto where the NCCL in use has ncclCommSuspend:
SLEEPSERVE_NCCL_SO names a libnccl >= 2.29.7; run only there).

One TP=N engine per setting (keep, release, then suspend), each in its own process: NCCL all-reduce, decode CUDA graphs, an 8B shape
with random bf16 weights. Per level (1, then 2 with update_weights after the wake), 3 sleep/wake cycles:
sleep and wake wall time, the communicator's part per rank (the sleep's release or suspend; the wake's
init: a new NCCL communicator and the ranks' agreement, capture: the decode graphs again, or its resume), each GPU's memory in use while asleep (nvidia-smi,
whole device) minus two references measured first on the same GPUs (bench/tensor_parallel.py's): a
process that initialised NCCL once, ran an all-reduce and destroyed its group (`NCCL-once`), and a plain
CUDA process; whether the greedy tokens after each wake equal those before the first sleep, and whether
every decode step after it replayed a graph. Exits 1 when tokens differ or a decode step ran eagerly.

    python bench/tp_release.py --world 2 --out $OUT          # make gpu-check ARGS=tp-release
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tensor_parallel import PROMPT, gpu_used, reference, tokens  # noqa: E402

MiB = 1 << 20


SETTINGS = {"keep": {"tp_release_comm_on_sleep": False, "tp_comm_suspend": "off"},
            "release": {"tp_release_comm_on_sleep": True, "tp_comm_suspend": "off"},
            "suspend": {"tp_release_comm_on_sleep": False, "tp_comm_suspend": "auto"}}


def run_setting(folder: Path, label: str, world: int, idle: list[int], args) -> dict:
    from server import LLM

    t = time.perf_counter()
    llm = LLM(model=str(folder), device="cuda", load_format="dummy", max_model_len=4096,
              kv_cache_memory=args.kv_cache_memory, tensor_parallel_size=world, tp_all_reduce="nccl",
              **SETTINGS[label])
    res: dict = {"label": label, "start_s": time.perf_counter() - t,
                 "awake_used": [u - i for u, i in zip(gpu_used(world), idle)]}
    print(f"{label}: started in {res['start_s']:.1f} s", flush=True)
    prompts = [PROMPT * 3, "def fibonacci(n):", "Once upon a time"]
    before = tokens(llm, prompts)
    runner = llm.engine.runner
    runner.step_lag()
    for level in (1, 2):
        rows = []
        for cycle in range(args.cycles):
            slept = llm.sleep(level=level)
            time.sleep(0.5)  # nvidia-smi's view settles
            asleep = [u - i for u, i in zip(gpu_used(world), idle)]
            t = time.perf_counter()
            woke = llm.wake_up()
            wake_s = time.perf_counter() - t
            if level == 2:
                llm.update_weights()  # the same seeded dummy weights
            same = tokens(llm, prompts) == before
            eager = sum(v.get("eager_steps", 0) for v in runner.step_lag().values())
            comm = woke.timings.get("pool", {}).get("comm_ms") or []  # re-created: dicts; resumed: ms
            row = {"sleep_s": slept.seconds, "wake_s": wake_s, "asleep_used": asleep, "identical": same,
                   "eager_steps": eager, "init_ms": [c["init_ms"] for c in comm if isinstance(c, dict)],
                   "capture_ms": [c["capture_ms"] for c in comm if isinstance(c, dict)],
                   "resume_ms": [c for c in comm if not isinstance(c, dict)],
                   "release_ms": slept.timings.get("pool", {}).get("comm_ms") or []}
            rows.append(row)
            print(f"{label} L{level} cycle {cycle + 1}: sleep {row['sleep_s'] * 1e3:.0f} ms (communicator release or "
                  f"suspend {_ms(row['release_ms'])} per rank), wake {wake_s * 1e3:.0f} ms"
                  f" (communicator init {_ms(row['init_ms'])}, graphs {_ms(row['capture_ms'])}, resume "
                  f"{_ms(row['resume_ms'])} per rank), asleep "
                  f"{' / '.join(f'{u / MiB:.0f}' for u in asleep)} MiB, greedy identical {same}, eager steps {eager}",
                  flush=True)
        later = rows[1:] or rows
        res[f"level{level}"] = {"cycles": rows, "sleep_s": statistics.median(r["sleep_s"] for r in later),
                                "wake_s": statistics.median(r["wake_s"] for r in later),
                                "identical": all(r["identical"] for r in rows),
                                "eager_steps": sum(r["eager_steps"] for r in rows)}
    t = time.perf_counter()
    llm.close()
    print(f"{label}: closed in {time.perf_counter() - t:.1f} s", flush=True)
    return res


_IDLE = "SLEEPSERVE_TP_RELEASE_IDLE"


def _child(setting: str, idle: list[int]) -> dict:
    """run_setting in a fresh process (this script with --setting); its progress lines pass through."""
    out = subprocess.run([sys.executable, *sys.argv, "--setting", setting], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, _IDLE: json.dumps(idle)})
    lines = out.stdout.strip().splitlines()
    print("\n".join(lines[:-1]), flush=True)
    if out.returncode != 0 or not lines:
        sys.exit(f"the {setting} run failed (exit {out.returncode})")
    return json.loads(lines[-1])


def _ms(values: list[float]) -> str:
    return "/".join(f"{v:.0f}" for v in values) + " ms" if values else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--kv-cache-memory", default="16GiB")
    ap.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles per level and setting")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--setting", choices=list(SETTINGS), help=argparse.SUPPRESS)  # one setting, in a child process
    args = ap.parse_args()

    import torch

    from bench.common import hardware, now_iso, write_json
    from server.engine.parallel.comm_cycle import suspend_support
    from server.weight_transfer.nccl import NcclLibrary
    from testkit.models import model_folder

    world = args.world
    if torch.cuda.device_count() < world:
        sys.exit(f"needs {world} GPUs, this host has {torch.cuda.device_count()}")
    if args.setting is not None:
        folder = model_folder(args.model, Path(tempfile.mkdtemp()), max_position_embeddings=131072)
        print(json.dumps(run_setting(folder, args.setting, world, json.loads(os.environ[_IDLE]), args)))
        return
    idle = gpu_used(world)
    refs = {kind: reference(kind, world) for kind in ("cuda", "nccl-destroyed")}
    print(f"references (bytes per GPU): {refs}", flush=True)
    # Each setting in its own process: NCCL reads its environment once per process (the flag turns
    # NCCL_GRAPH_REGISTER off before the first communicator), so "release" must not inherit "keep"'s NCCL.
    settings = ["keep", "release"] + (["suspend"] if NcclLibrary().can_suspend else [])
    runs = [_child(setting, idle) for setting in settings]
    result = {"date": now_iso(), "hardware": hardware(torch.device("cuda")), "nccl": suspend_support(),
              "model": args.model, "references_used": refs, "runs": runs}
    write_json(args.out, f"tp-release-{world}", result)
    report(result, args)


def report(result: dict, args) -> None:
    """The table and the summary lines (make gpu-check's summary greps them); exits 1 on a failed check."""
    from bench.common import table

    refs, runs, world = result["references_used"], result["runs"], args.world
    once, cuda = refs["nccl-destroyed"], refs["cuda"]
    print(f"\ntp release ({result['hardware']}, {result['nccl']}, {result['date']}; {args.model} dummy weights, "
          f"TP={world} NCCL, {args.cycles} cycles per level; references per GPU: NCCL-once "
          f"{[round(v / MiB) for v in once]} MiB, plain CUDA {[round(v / MiB) for v in cuda]} MiB)")
    rows = []
    for r in runs:
        for level in (1, 2):
            lv = r[f"level{level}"]
            first, last = lv["cycles"][0]["asleep_used"], lv["cycles"][-1]["asleep_used"]
            init = [statistics.median(c["init_ms"][i] for c in lv["cycles"]) for i in range(len(lv["cycles"][0]["init_ms"]))]
            cap = [statistics.median(c["capture_ms"][i] for c in lv["cycles"])
                   for i in range(len(lv["cycles"][0]["capture_ms"]))]
            rel = [statistics.median(c["release_ms"][i] for c in lv["cycles"])
                   for i in range(len(lv["cycles"][0]["release_ms"]))]
            rows.append([r["label"], f"L{level}", f"{lv['sleep_s'] * 1e3:.0f} ms", _ms(rel), f"{lv['wake_s'] * 1e3:.0f} ms",
                         _ms(init), _ms(cap),
                         " / ".join(f"{(u - c) / MiB:+.0f}" for u, c in zip(last, once)),
                         " / ".join(f"{(u - c) / MiB:+.0f}" for u, c in zip(last, cuda)),
                         " / ".join(f"{(b - a) / MiB:+.0f}" for a, b in zip(first, last)),
                         "yes" if lv["identical"] else "NO", lv["eager_steps"]])
    print(table(rows, ["setting", "level", "sleep", "of which comm release/suspend per rank", "wake", "comm init per rank", "graph capture per rank",
                       "asleep - NCCL-once ref (MiB/rank)", "asleep - CUDA ref (MiB/rank)",
                       "growth cycle 1 -> last (MiB/rank)", "greedy identical", "eager steps after wakes"]))
    keep = runs[0]
    for other in runs[1:]:
        for level in (1, 2):
            a, b = keep[f"level{level}"], other[f"level{level}"]
            freed = [(x - y) / MiB for x, y in zip(a["cycles"][-1]["asleep_used"], b["cycles"][-1]["asleep_used"])]
            print(f"tp {other['label']} L{level}: asleep, gives back {' / '.join(f'{v:.0f}' for v in freed)} MiB per "
                  f"rank over keep; wake {a['wake_s'] * 1e3:.0f} -> {b['wake_s'] * 1e3:.0f} ms, sleep "
                  f"{a['sleep_s'] * 1e3:.0f} -> {b['sleep_s'] * 1e3:.0f} ms")
    bad = [f"{r['label']} L{lv}" for r in runs for lv in (1, 2) if not r[f"level{lv}"]["identical"]]
    eager = [f"{r['label']} L{lv}" for r in runs for lv in (1, 2) if r[f"level{lv}"]["eager_steps"]]
    if bad:
        sys.exit(f"greedy outputs changed after a sleep/wake cycle: {bad}")
    if eager:
        sys.exit(f"decode steps ran without a CUDA graph after a wake: {eager}")


if __name__ == "__main__":
    main()
