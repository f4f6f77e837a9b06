"""Our pool beside torch_memory_saver (SGLang's allocator), one run (gpu-check stage `tms`).

The same 8 GiB of bf16 weights (256 tensors of 32 MiB) + 40 GiB of KV (40 tensors of 1 GiB), each
side in its own process (torch_memory_saver hooks cudaMalloc through LD_PRELOAD):
  - "level 1": ours offloads the weights to pinned host memory (prepared at start-up) and discards
    the KV; torch_memory_saver pauses with its CPU backup for the weights (region
    enable_cpu_backup=True) and without for the KV, then resumes;
  - torch_memory_saver's level 1 twice: by default (its pinned backup is made at each pause and
    freed at resume) and with retain_cpu_backup (kept, as our pool keeps its own);
  - "level 2": both discard everything (torch_memory_saver: regions without CPU backup);
  - memory left behind while asleep = device memory in use asleep minus in use before the first
    allocation (after the CUDA context and one kernel), each in its own process;
  - the weights come back bit-exact (level 1) on both sides.
3 cycles each; prints the medians with GB/s (weights bytes / call) and writes tms-compare.json.

    python bench/tms_compare.py --out $OUT/results
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GiB, MiB, GB = 1 << 30, 1 << 20, 1e9


def used() -> int:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def checksum(tensors) -> int:
    import torch

    return int(sum(t.view(torch.int16).sum(dtype=torch.int64).item() for t in tensors))


def make(n: int, nbytes: int, random: bool):
    import torch

    out = []
    for _ in range(n):
        t = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        if random:
            t.normal_()
        out.append(t)
    return out


def side_ours(weights_gib: int, kv_gib: int, cycles: int) -> dict:
    import torch

    from allocator import create_pool

    torch.cuda.init()
    torch.ones(1, device="cuda").add_(1)
    base = used()
    pool = create_pool("cuda")
    with pool.use("weights"):
        weights = make(weights_gib * 32, 32 * MiB, True)
    with pool.use("kv_cache"):
        kv = make(kv_gib, GiB, False)
    expected = checksum(weights)
    t = time.perf_counter()
    pool.prepare_backups(["weights"], only_if_room=False)
    pool.wait_prepared()
    res: dict = {"prepare_s": time.perf_counter() - t, "l1": [], "l2": []}
    for level in (1, 2):
        for _ in range(cycles):
            torch.cuda.synchronize()
            t = time.perf_counter()
            if level == 1:
                pool.sleep(offload_tags=["weights"], discard_tags=["kv_cache"])
            else:
                pool.sleep(discard_tags=["weights", "kv_cache"])
            sleep_s = time.perf_counter() - t
            asleep = used()
            t = time.perf_counter()
            pool.wake_up()
            wake_s = time.perf_counter() - t
            row = {"sleep_s": sleep_s, "wake_s": wake_s, "left_behind": asleep - base}
            if level == 1:
                row["bit_exact"] = checksum(weights) == expected
            res[f"l{level}"].append(row)
    del kv
    pool.close()
    return res


def side_tms(weights_gib: int, kv_gib: int, cycles: int) -> dict:
    import importlib.metadata

    import torch
    from torch_memory_saver import torch_memory_saver as tms

    torch.cuda.init()
    torch.ones(1, device="cuda").add_(1)
    base = used()
    res: dict = {"version": importlib.metadata.version("torch-memory-saver"), "l1": [], "l1r": [], "l2": []}
    # l1: its default (the pinned CPU backup is allocated at each pause and freed at resume); l1r: with
    # retain_cpu_backup, which keeps it like our pool does; l2: regions without CPU backup.
    for level in ("l1", "l1r", "l2"):
        tms.retain_cpu_backup = level == "l1r"
        with tms.region(tag="weights", enable_cpu_backup=level != "l2"):
            weights = make(weights_gib * 32, 32 * MiB, True)
        with tms.region(tag="kv"):
            kv = make(kv_gib, GiB, False)
        expected = checksum(weights)
        for _ in range(cycles):
            torch.cuda.synchronize()
            t = time.perf_counter()
            tms.pause()
            torch.cuda.synchronize()
            sleep_s = time.perf_counter() - t
            asleep = used()
            t = time.perf_counter()
            tms.resume()
            torch.cuda.synchronize()
            wake_s = time.perf_counter() - t
            row = {"sleep_s": sleep_s, "wake_s": wake_s, "left_behind": asleep - base}
            if level != "l2":
                row["bit_exact"] = checksum(weights) == expected
            res[level].append(row)
        del weights, kv
        torch.cuda.synchronize()
    return res


def preload_library() -> str | None:
    """torch_memory_saver's preload hook built for CUDA 13 (the only one that loads on the H200
    image), else any preload hook it ships."""
    for pattern in ("torch_memory_saver_hook_mode_preload_cu13*.so", "torch_memory_saver_hook_mode_preload*.so"):
        for folder in sys.path:
            found = sorted(glob.glob(os.path.join(folder or ".", pattern)))
            if found:
                return found[0]
    return None


def run_side(side: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    cmd = [sys.executable, __file__, "--side", side, "--weights-gib", str(args.weights_gib), "--kv-gib",
           str(args.kv_gib), "--cycles", str(args.cycles)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: {out.stderr[-3000:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(res: dict, weight_bytes: int) -> dict:
    out = {}
    for level in ("l1", "l1r", "l2"):
        rows = res.get(level) or []
        if not rows:
            continue
        later = rows[1:] or rows
        s = statistics.median(r["sleep_s"] for r in later)
        w = statistics.median(r["wake_s"] for r in later)
        out[level] = {"sleep_s_first": rows[0]["sleep_s"], "sleep_s": s, "wake_s": w,
                      "sleep_gbps": weight_bytes / s / GB, "wake_gbps": weight_bytes / w / GB,
                      "left_behind_MiB": statistics.median(r["left_behind"] for r in rows) / MiB,
                      "bit_exact": all(r.get("bit_exact", True) for r in rows)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=["ours", "tms"])
    ap.add_argument("--weights-gib", type=int, default=8)
    ap.add_argument("--kv-gib", type=int, default=40)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    if args.side:
        fn = side_ours if args.side == "ours" else side_tms
        print(json.dumps(fn(args.weights_gib, args.kv_gib, args.cycles)))
        return

    from bench.common import hardware, now_iso, table, write_json
    import torch

    result: dict = {"date": now_iso(), "hardware": hardware(torch.device("cuda")),
                    "weights_gib": args.weights_gib, "kv_gib": args.kv_gib}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result["ours_raw"] = run_side("ours", args, env)
    hook = preload_library()
    if hook is None:
        result["tms_raw"] = {"error": "torch_memory_saver is not installed (carry its wheel in .whl)"}
    else:
        result["tms_raw"] = run_side("tms", args, dict(env, LD_PRELOAD=hook))
        result["tms_hook"] = os.path.basename(hook)
    weight_bytes = args.weights_gib * GiB
    rows = []
    for name in ("ours", "tms"):
        raw = result[f"{name}_raw"]
        if "error" in raw:
            print(f"{name}: {raw['error']}")
            continue
        s = result[name] = summarize(raw, weight_bytes)
        label = "sleepserve pool" if name == "ours" else f"torch_memory_saver {raw.get('version', '?')}"
        for level, what in (("l1", "level 1 / pause+resume, CPU backup"),
                            ("l1r", "pause+resume, CPU backup retained"), ("l2", "level 2 / release")):
            if level not in s:
                continue
            v = s[level]
            rows.append([label, what, f"{v['sleep_s'] * 1e3:.0f} ms ({v['sleep_gbps']:.1f} GB/s)",
                         f"{v['wake_s'] * 1e3:.0f} ms ({v['wake_gbps']:.1f} GB/s)",
                         f"{v['sleep_s_first'] * 1e3:.0f} ms", f"{v['left_behind_MiB']:.0f} MiB",
                         "yes" if v["bit_exact"] else "NO"])
    write_json(args.out, "tms-compare", result)
    print(f"\nsleepserve vs torch_memory_saver ({result['hardware']}, {result['date']}; "
          f"{args.weights_gib} GiB weights + {args.kv_gib} GiB KV; GB/s = weight bytes / call; median of cycles >= 2)")
    print(table(rows, ["allocator", "mode", "sleep / pause", "wake / resume", "first sleep", "left behind asleep",
                       "bit-exact"]))
    if any("error" in result[f"{n}_raw"] for n in ("ours", "tms")):
        sys.exit(1)


if __name__ == "__main__":
    main()
