"""Sleep and wake at the hardware limit, through the real HTTP server (gpu-check stage `limits`).

For each model shape (default 1.24B and 8B Llama, random weights) at the default
--gpu-memory-utilization 0.9, in one run, with references measured in the same run:
  - raw pinned host-to-device GB/s (a subprocess, before the server starts);
  - device memory of a bare process that ran one kernel, and of a process that ran the same engine
    and then closed its pool (the same kernels and handles, no pool memory);
  - level-1 sleep and wake, 4 cycles, each wake right after its sleep: cycle 1 against later ones
    (the host backup is prepared at start-up: --prepare-backups), the wake against
    weights / raw H2D + 50 ms, the first request after the wake against the same request before
    (streamed: its first token's time apart);
    every sleep after the previous wake's background KV mapping ended, so each releases the whole
    cache (and says how many GiB the driver released), and --idle-before-sleep seconds after that
    (default 1 s, where a rollout would be; 0 runs the cycles back to back);
  - level-2 sleep and wake, 3 cycles (wake right after the sleep; then /update_weights);
  - device memory asleep minus both references;
  - per cycle, one line each for the sleep, the wake and the first request after it: the HTTP time split
    into the engine's and the API's, the engine's and the pool's phases, the driver calls, the Python
    collector's pauses and the background KV mapper (the answers' `timings`, GET /memory's `chunks`);
  - one more level-1 cycle whose first request waits for the background KV mapping to end (is the
    first request slow only while chunks are being mapped?).
Prints a table and writes sleep-limits.json under --out (with every cycle's timings).

    python bench/sleep_limits.py --out $OUT/results
    python bench/sleep_limits.py --device cpu --cycles 2    # the same flow on CPU (a smoke run)
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

from bench.common import now_iso, table, write_json  # noqa: E402
from testkit.http_server import ServerProcess  # noqa: E402
from testkit.models import model_folder  # noqa: E402

MiB, GB = 1 << 20, 1e9
PROMPT = "The three most important ideas in the history of science are"
MODEL_ENV = "SLEEPSERVE_LIMITS_MODEL"

# What a process holds after each step of what the engine does, every tensor and cache freed
# between steps: the part of "asleep minus one kernel" that no pool can release.
_BREAKDOWN = """
import json, torch
torch.cuda.init(); torch.cuda.set_device(0)
def used():
    torch.cuda.synchronize()
    getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(0)
    return total - free
steps = {"context": used()}
x = torch.ones(1024, device="cuda"); x.add_(1); del x
steps["one elementwise kernel"] = used()
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
(a @ a).sum().item(); del a
steps["cuBLAS matmul (default stream)"] = used()
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); (a @ a).sum().item(); del a
steps["cuBLAS matmul on a second stream"] = used()
import threading
def other_thread():
    torch.cuda.set_device(0)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); (a @ a).sum().item()
t = threading.Thread(target=other_thread); t.start(); t.join()
steps["cuBLAS matmul on a second thread (torch keeps one handle per thread)"] = used()
a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
torch.nn.functional.softmax(a.float(), -1).sum().item()
torch.nn.functional.scaled_dot_product_attention(a.view(1, 1, 64, 4096)[..., :128], a.view(1, 1, 64, 4096)[..., :128],
                                                 a.view(1, 1, 64, 4096)[..., :128]).sum().item()
del a
steps["softmax + SDPA kernels"] = used()
g = torch.cuda.CUDAGraph(); inp = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2): inp @ w
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(g, stream=s):
    out = inp @ w
g.replay(); del out, inp, w
steps["a captured CUDA graph (kept)"] = used()
print(json.dumps(steps))
"""

_RAW_H2D = """
import json, sys
sys.path.insert(0, sys.argv[1])
from bench.pool_table import raw_pinned_bandwidth
d2h, h2d = raw_pinned_bandwidth(0, 4 << 30)
print(json.dumps({"d2h": d2h, "h2d": h2d}))
"""


def run_json(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def engine_kernels(index: int):
    """For testkit/footprint.reference_process_used: run the engine on the model named by
    $SLEEPSERVE_LIMITS_MODEL (a small KV cache), then close its pool: what stays is what the
    kernels, graphs and library handles cost without any pool memory."""
    from server import LLM, SamplingParams

    llm = LLM(model=os.environ[MODEL_ENV], device=f"cuda:{index}", load_format="dummy",
              kv_cache_memory="1GiB", max_model_len=2048, prepare_backups="off")
    llm.generate([PROMPT] * 4, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    llm.generate(PROMPT * 40, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.close()
    return None


def complete(c, max_tokens: int = 32) -> tuple[str, float, float]:
    """(text, seconds, seconds to the first token) of one streamed greedy request: the first token's
    time is the prefill's share (and anything paid once on the first step), the rest the decode's."""
    t = time.perf_counter()
    first, parts = None, []
    with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                                   "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text = json.loads(line[6:])["choices"][0]["text"]
            if text and first is None:
                first = time.perf_counter() - t
            parts.append(text)
    total = time.perf_counter() - t
    return "".join(parts), total, total if first is None else first


def timed_post(c, path: str, **kw) -> tuple[float, dict]:
    """(seconds through HTTP, the answer's JSON)."""
    t = time.perf_counter()
    r = c.post(path, **kw)
    elapsed = time.perf_counter() - t
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text[:500]}")
    return elapsed, r.json()


def kv_chunks(c) -> dict:
    """The KV cache's chunks mapped now and its background mapper (GET /memory's `chunks`)."""
    return c.get("/memory").json().get("chunks", {}).get("kv_cache", {})


def wait_for_kv_mapping(c, limit_s: float = 30.0) -> float:
    """Seconds until the wake's background KV mapper has mapped the whole cache (at most limit_s)."""
    t = time.perf_counter()
    while kv_chunks(c).get("mapping") and time.perf_counter() - t < limit_s:
        time.sleep(0.01)
    return time.perf_counter() - t


def pool_timings(timings: dict) -> dict:
    """The pool's part of a sleep's or a wake's `timings` (with tensor parallelism, rank 0's pool)."""
    pool = timings.get("pool") or {}
    return pool.get("rank0") or pool


def released(answer: dict) -> tuple[float | None, float | None]:
    """(GiB, ms) the driver released in a sleep (its timings' cuMemRelease totals; None on CPU)."""
    release = (pool_timings(answer.get("timings") or {}).get("driver") or {}).get("release")
    return (release["bytes"] / 2**30, release["ms"]) if release else (None, None)


def _ms(phases: dict, floor: float = 0.5) -> str:
    return " ".join(f"{k} {v:.1f}" for k, v in phases.items() if v >= floor) or "-"


def describe(http_s: float, answer: dict) -> str:
    """One line: where a sleep's or a wake's milliseconds went (the answer's `timings`)."""
    t = answer.get("timings") or {}
    pool = t.get("pool") or {}
    inner = pool_timings(t)  # tensor parallelism: the pool facade's phases, then rank 0's
    gc = t.get("gc") or {}
    ch = t.get("channel") or {}
    to_engine, to_api = ch.get("to_engine_ms", 0.0), ch.get("to_api_ms", 0.0)
    engine = t.get("total_ms", 0) + t.get("pending_ms", 0)
    parts = [f"HTTP {http_s * 1e3:.1f} ms = engine {engine:.1f} + to engine {to_engine:.1f} + back {to_api:.1f}"
             f" + HTTP/API {http_s * 1e3 - engine - to_engine - to_api:.1f}",
             f"engine [{_ms(t.get('phases_ms', {}))}]"]
    if pool.get("rank0"):
        parts.append(f"ranks [{_ms(pool.get('phases_ms', {}))}]")
    parts.append(f"pool [{_ms(inner.get('phases_ms', {}))}]")
    driver = inner.get("driver") or {}
    if driver:
        parts.append("driver [" + " ".join(f"{op} {d['calls']}x {d['ms']:.1f} (max {d['longest_ms']:.1f})"
                                           for op, d in driver.items()) + "]")
    if gc.get("ms", 0) >= 0.5 or any(gc.get("collections", [0])[1:]):
        parts.append(f"GC {gc.get('ms', 0):.1f} ms (collections by generation {gc.get('collections')})")
    for tag, m in (inner.get("kv_mapper") or {}).items():
        parts.append(f"{tag} mapper found {m['ready']}/{m['total']} chunks"
                     + (" still mapping" if m["mapping"] else "")
                     + (f", chunks ready at {m['chunk_ready_ms']} ms" if m["chunk_ready_ms"] else ""))
    if t.get("pending_ms", 0) >= 0.5:
        parts.append(f"of which pending {t['pending_ms']:.1f} ms")
    return "; ".join(parts)


def bench_model(name: str, raw_h2d: float, cycles: int, cpu: bool = False, extra: list[str] = (),
                idle_s: float = 1.0) -> dict:
    """cpu: a smoke run of the same flow on the CPU backend (the embedded model, no references).
    idle_s: seconds between a wake's end of mapping and the next sleep (a rollout's place).
    extra: more server flags (e.g. --kv-wake-chunk 0 to map the whole KV cache before a wake returns)."""
    from testkit.footprint import one_kernel_process_used, reference_process_used, server_device_used

    if cpu:
        one_kernel = reference = 0
        serve = ["--device", "cpu", "--kv-cache-memory", "256MiB", "--kv-wake-chunk", "16MiB",
                 "--max-model-len", "1024", "--prepare-backups", "on"]
    else:
        folder = model_folder(name, Path(tempfile.mkdtemp()), max_position_embeddings=131072)
        os.environ[MODEL_ENV] = str(folder)
        one_kernel = one_kernel_process_used(0)
        reference = reference_process_used(0, "bench.sleep_limits", "engine_kernels",
                                           [str(Path(__file__).resolve().parents[1])])
        serve = [str(folder), "--device", "cuda", "--load-format", "dummy", "--max-model-len", "4096"]
    t0 = time.perf_counter()
    server = ServerProcess([*serve, *extra, "--dev-mode", "--while-asleep", "reject"]).start()
    res: dict = {"model": name, "startup_s": time.perf_counter() - t0, "one_kernel_process_used": one_kernel,
                 "reference_process_used": reference, "idle_before_sleep_s": idle_s}
    try:
        with server.client(timeout=600) as c:
            mem = c.get("/memory").json()
            res["tags_bytes"] = {t: v["bytes"] for t, v in mem["tags"].items()}
            weights = res["tags_bytes"].get("weights", 0)
            res["weight_bytes"] = weights
            complete(c, 8)
            c.post("/reset_prefix_cache")
            reference_text, before_s, before_first_s = complete(c)
            res["request_before_s"] = before_s
            res["first_token_before_s"] = before_first_s
            # The backup preparation runs in the background; a request now shows it does not
            # delay serving. Give it time to finish before the first sleep (what a trainer's first
            # rollout phase does); the first sleep waits for it anyway.
            time.sleep(0.5 if cpu else max(2.0, weights / 2e9))
            rows = []
            for level, n in ((1, cycles), (2, max(2, cycles - 1))):
                for i in range(n):
                    c.post("/reset_prefix_cache")
                    sleep_s, slept = timed_post(c, f"/sleep?level={level}")
                    asleep = server_device_used(c)
                    wake_s, woke = timed_post(c, "/wake_up")
                    update_s = timed_post(c, "/update_weights", json={})[0] if level == 2 else 0.0
                    chunks_before = kv_chunks(c)
                    text, after_s, after_first_s = complete(c)
                    chunks_after = kv_chunks(c)
                    # Every sleep releases the whole cache, as after a rollout: the next one waits for this
                    # wake's background mapping (back to back, a later sleep released 44-86 of 117 GiB at 1B
                    # and its time compared a partial release with the first cycle's full one).
                    settle_s = wait_for_kv_mapping(c)
                    # and some time passes, as a rollout's would
                    time.sleep(idle_s)
                    released_gib, release_ms = released(slept)
                    row = {"level": level, "cycle": i + 1, "sleep_s": sleep_s, "wake_s": wake_s,
                           "asleep_used": asleep, "asleep_minus_one_kernel_MiB": (asleep - one_kernel) / MiB,
                           "asleep_minus_reference_MiB": (asleep - reference) / MiB,
                           "request_after_wake_s": after_s, "after_over_before": after_s / before_s,
                           "first_token_after_wake_s": after_first_s,
                           "same_output": text == reference_text, "update_weights_s": update_s,
                           "sleep_timings": slept.get("timings", {}), "wake_timings": woke.get("timings", {}),
                           "kv_chunks_at_request": [chunks_before.get("ready"), chunks_after.get("ready"),
                                                    chunks_before.get("total")],
                           "kv_mapping_during_request": bool(chunks_before.get("mapping")),
                           "kv_mapping_settled_s": settle_s, "released_GiB": released_gib,
                           "release_ms": release_ms}
                    rows.append(row)
                    print(f"{name} L{level} cycle {i + 1}: sleep {describe(sleep_s, slept)}"
                          + (f"; released {released_gib:.1f} GiB" if released_gib is not None else ""), flush=True)
                    print(f"{name} L{level} cycle {i + 1}: wake {describe(wake_s, woke)}", flush=True)
                    print(f"{name} L{level} cycle {i + 1}: 1st request {after_s * 1e3:.1f} ms "
                          f"({after_s / before_s:.2f}x of {before_s * 1e3:.1f}; first token {after_first_s * 1e3:.1f} "
                          f"ms against {before_first_s * 1e3:.1f}); KV chunks mapped "
                          f"{chunks_before.get('ready')} -> {chunks_after.get('ready')} of {chunks_before.get('total')}"
                          + (" (the wake's background mapper ran during it)" if chunks_before.get("mapping") else "")
                          + (f"; /update_weights {update_s * 1e3:.0f} ms before it" if level == 2 else ""),
                          flush=True)
            res["cycles"] = rows
            # The same request once the background KV mapping of a wake is over: if the first request
            # after a wake is slow only while chunks are being mapped, this one is as fast as before.
            c.post("/reset_prefix_cache")
            timed_post(c, "/sleep?level=1")
            timed_post(c, "/wake_up")
            waited = wait_for_kv_mapping(c)
            _, settled_s, _ = complete(c)
            _, second_s, _ = complete(c)
            res["request_after_mapping_s"] = settled_s
            res["second_request_after_wake_s"] = second_s
            print(f"{name}: request after a wake once KV mapping ended ({waited * 1e3:.0f} ms after the wake "
                  f"returned) {settled_s * 1e3:.1f} ms ({settled_s / before_s:.2f}x), the next one "
                  f"{second_s * 1e3:.1f} ms ({second_s / before_s:.2f}x)", flush=True)
            # The same request right after a wake that came 1 s after its sleep (a trainer's step sits
            # between them in RL): tells the wake's own cost from what the driver still does with the
            # memory the sleep released (measured: a copy runs 11% slower for 200-300 ms after a release).
            c.post("/reset_prefix_cache")
            timed_post(c, "/sleep?level=1")
            time.sleep(1.0)
            timed_post(c, "/wake_up")
            _, gap_s, _ = complete(c)
            res["request_after_wake_1s_after_sleep_s"] = gap_s
            print(f"{name}: 1st request after a wake 1 s after its sleep {gap_s * 1e3:.1f} ms "
                  f"({gap_s / before_s:.2f}x)", flush=True)
    finally:
        server.stop()
    l1 = [r for r in res["cycles"] if r["level"] == 1]
    l2 = [r for r in res["cycles"] if r["level"] == 2]
    later = l1[1:] or l1
    res["l1_first_sleep_over_later"] = l1[0]["sleep_s"] / statistics.median(r["sleep_s"] for r in later)
    res["l1_wake_s"] = statistics.median(r["wake_s"] for r in l1)
    res["l1_wake_target_s"] = res["weight_bytes"] / (raw_h2d * GB) + 0.050
    res["l1_sleep_s"] = statistics.median(r["sleep_s"] for r in later)
    res["l2_sleep_s"] = statistics.median(r["sleep_s"] for r in l2)
    res["l2_wake_s"] = statistics.median(r["wake_s"] for r in l2)
    res["after_over_before"] = max(r["after_over_before"] for r in res["cycles"])
    res["asleep_minus_one_kernel_MiB"] = statistics.median(r["asleep_minus_one_kernel_MiB"] for r in res["cycles"])
    res["asleep_minus_reference_MiB"] = statistics.median(r["asleep_minus_reference_MiB"] for r in res["cycles"])
    res["same_output"] = all(r["same_output"] for r in res["cycles"])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-1b,llama-8b")
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the flow")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--server-args", default="", help="more flags for every server, e.g. '--kv-wake-chunk 0'")
    ap.add_argument("--idle-before-sleep", type=float, default=1.0,
                    help="seconds from a wake's end of KV mapping to the next sleep (a rollout's place; 0: back to back)")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    raw = {"d2h": float("nan"), "h2d": float("inf")} if cpu else run_json(_RAW_H2D, str(Path(__file__).resolve().parents[1]))
    breakdown = {"context": 0} if cpu else run_json(_BREAKDOWN)
    result = {"date": now_iso(), "raw_pinned_gbps": raw, "footprint_steps": breakdown, "models": []}
    for name in ["SmolLM2-135M (CPU)"] if cpu else args.models.split(","):
        result["models"].append(bench_model(name, raw["h2d"], args.cycles, cpu, args.server_args.split(),
                                            args.idle_before_sleep))
        write_json(args.out, "sleep-limits", result)
    print(f"\nsleep limits through HTTP ({result['date']}; raw pinned H2D {raw['h2d']:.1f} GB/s, "
          f"D2H {raw['d2h']:.1f} GB/s; wakes right after their sleep, sleeps {args.idle_before_sleep:g} s "
          "after the previous wake's KV mapping ended)")
    rows = []
    for m in result["models"]:
        rows.append([m["model"], f"{m['weight_bytes'] / GB:.2f} GB",
                     f"{m['tags_bytes'].get('kv_cache', 0) / 2**30:.1f} GiB",
                     f"{m['l1_sleep_s'] * 1e3:.0f} ms (1st {m['l1_first_sleep_over_later']:.2f}x)",
                     f"{m['l1_wake_s'] * 1e3:.0f} ms (target {m['l1_wake_target_s'] * 1e3:.0f})",
                     f"{m['l2_sleep_s'] * 1e3:.0f} ms", f"{m['l2_wake_s'] * 1e3:.0f} ms",
                     f"{m['after_over_before']:.2f}x",
                     f"{m['asleep_minus_one_kernel_MiB']:+.0f} / {m['asleep_minus_reference_MiB']:+.0f} MiB",
                     "yes" if m["same_output"] else "NO"])
    print(table(rows, ["model", "weights", "KV", "L1 sleep", "L1 wake", "L2 sleep", "L2 wake",
                       "1st request after wake / before", "asleep - one-kernel / - same kernels", "same output"]))
    base = breakdown["context"]
    print("what a process keeps with every tensor and cache freed, over a bare context: "
          + "; ".join(f"{k} {(v - base) / MiB:+.0f} MiB" for k, v in breakdown.items() if k != "context"))
    if not all(m["same_output"] for m in result["models"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
