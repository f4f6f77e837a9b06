"""`make soak`: the long reliability run against real CPU servers (10-20 min on 2 cores).

1. fuzz     schemathesis, driven by the server's OpenAPI document, until >= --fuzz-requests requests
            (bodies and dev routes included): no 5xx but the documented 503, every status declared.
2. cycles   --cycles sleep/wake cycles alternating level 1 and level 2 (+ /update_weights): the greedy
            output after every wake is the reference output; RSS growth after warm-up <= 64 MiB.
3. kill -9  while asleep at level 1 (the weights offloaded to a file): nothing left in the offload
            folder, and a restart on the same folder serves.
4. SIGTERM  under load (32 streams): every stream ends with a finish_reason and [DONE], exit 0, no
            traceback in the log.

Prints one JSON object with every figure (and writes it to --out); exits 1 if any target is missed.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from testkit.fuzz import FUZZ_ARGS, KEY, fuzz  # noqa: E402
from testkit.http_server import BASE_ARGS, ServerProcess  # noqa: E402

PROMPT = "The history of the city of Paris, the capital of France"
RSS_LIMIT = 64 << 20
EXTRA: list[str] = []  # --server-args: more flags for every server this starts


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def phase_fuzz(target: int, work: Path) -> dict:
    server = ServerProcess([*FUZZ_ARGS, *EXTRA], api_key=KEY).start()
    total, statuses, seed, runs, failed = 0, {}, 1, 0, []
    start = time.monotonic()
    try:
        while total < target:
            out = work / f"fuzz-{seed}"
            out.mkdir()
            r = fuzz(server, out, examples=150, seed=seed, timeout=3600)
            runs += 1
            total += r["requests"]
            for k, v in r["statuses"].items():
                statuses[k] = statuses.get(k, 0) + v
            if r["exit"] != 0:
                failed.append({"seed": seed, "output": r["output"][-3000:]})
            log(f"fuzz seed {seed}: {r['requests']} requests (total {total}), exit {r['exit']}")
            seed += 1
            for path in ("/wake_up", "/resume"):  # what a fuzzed /sleep or /pause left behind
                httpx.post(server.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        traceback = "Traceback" in server.log_text()
    finally:
        server.stop()
    errors = sum(v for k, v in statuses.items() if k.startswith("5") and k != "503")
    return {"requests": total, "runs": runs, "server_errors": errors, "statuses": statuses,
            "failed_runs": failed, "traceback_in_log": traceback, "seconds": round(time.monotonic() - start, 1),
            "ok": total >= target and errors == 0 and not failed and not traceback}


def greedy(server: ServerProcess) -> str:
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def post(server: ServerProcess, path: str) -> dict:
    r = httpx.post(server.url + path, timeout=300, headers={"Content-Type": "application/json"})
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
    return r.json()


def fds_into(pid: int, folder: Path) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            n += os.readlink(fd).startswith(str(folder))
        except OSError:
            pass
    return n


def phase_cycles(cycles: int, offload: Path) -> dict:
    server = ServerProcess([*BASE_ARGS, "--dev-mode", "--offload-dir", str(offload), *EXTRA]).start()
    start = time.monotonic()
    try:
        proc = psutil.Process(server.engine_pid)  # the engine process holds the pool
        reference = greedy(server)
        mismatches, rss, warm = 0, [], 10
        for i in range(cycles):
            level = 1 if i % 2 == 0 else 2
            post(server, f"/sleep?level={level}")
            post(server, "/wake_up")
            if level == 2:
                post(server, "/update_weights")
            mismatches += greedy(server) != reference
            rss.append(proc.memory_info().rss)
            if (i + 1) % 20 == 0:
                log(f"cycle {i + 1}/{cycles}: rss {rss[-1] / 2**20:.0f} MiB, mismatches {mismatches}")
        growth = rss[-1] - rss[warm - 1] if len(rss) >= warm else 0
        left = sorted(p.name for p in offload.iterdir())
    finally:
        server.stop()
    return {"cycles": cycles, "mismatches": mismatches, "rss_after_warmup_mib": round(rss[warm - 1] / 2**20, 1),
            "rss_end_mib": round(rss[-1] / 2**20, 1), "rss_growth_mib": round(growth / 2**20, 1),
            "rss_max_mib": round(max(rss) / 2**20, 1), "files_left": left,
            "seconds": round(time.monotonic() - start, 1),
            "ok": mismatches == 0 and growth <= RSS_LIMIT and not left}


def phase_kill(offload: Path) -> dict:
    server = ServerProcess([*BASE_ARGS, "--dev-mode", "--offload-dir", str(offload), *EXTRA]).start()
    report = post(server, "/sleep?level=1")
    held = fds_into(server.engine_pid, offload)
    server.proc.kill()
    server.proc.wait(30)
    left = sorted(p.name for p in offload.iterdir())
    again = ServerProcess([*BASE_ARGS, "--dev-mode", "--offload-dir", str(offload), *EXTRA]).start()
    try:
        serves = bool(greedy(again))
        left_after_restart = sorted(p.name for p in offload.iterdir())
    finally:
        again.stop()
    return {"bytes_offloaded": report.get("bytes_offloaded"), "backup_files_held_while_asleep": held,
            "files_left_after_kill": left, "files_left_after_restart": left_after_restart,
            "restart_serves": serves, "ok": held > 0 and not left and not left_after_restart and serves}


def phase_sigterm(streams: int, grace: float) -> dict:
    server = ServerProcess([*BASE_ARGS, "--shutdown-grace-period", str(grace), *EXTRA]).start()
    results: dict[int, list[str]] = {}

    def stream(i: int) -> None:
        events: list[str] = []
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                    "prompt": PROMPT, "max_tokens": 4 if i % 4 == 0 else 800, "ignore_eos": True,
                    "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        except httpx.HTTPError as e:
            events.append(f"ERROR {type(e).__name__}")
        results[i] = events

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(3)
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    code = server.proc.wait(60)
    exit_seconds = time.monotonic() - sent
    finishes: dict[str, int] = {}
    proper = 0
    for events in results.values():
        reasons = [c["finish_reason"] for e in events if e != "[DONE]" and not e.startswith("ERROR")
                   for c in json.loads(e)["choices"] if c.get("finish_reason")]
        ok = bool(events) and events[-1] == "[DONE]" and len(reasons) == 1
        proper += ok
        for r in reasons:
            finishes[r] = finishes.get(r, 0) + 1
    text = server.log_text()
    return {"streams": streams, "ended_properly": proper, "finish_reasons": finishes, "exit_code": code,
            "seconds_to_exit": round(exit_seconds, 1), "grace_period_s": grace,
            "traceback_in_log": "Traceback" in text or "CancelledError" in text,
            "ok": proper == streams and code == 0 and "Traceback" not in text}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuzz-requests", type=int, default=5000)
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--grace", type=float, default=3.0)
    ap.add_argument("--phases", default="fuzz,cycles,kill,sigterm")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--server-args", default="", help="more flags for every server, e.g. '--api-server-count 2'")
    args = ap.parse_args()
    phases = args.phases.split(",")
    EXTRA[:] = shlex.split(args.server_args)
    figures: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="sleepserve-soak-") as tmp:
        work = Path(tmp)
        offload = work / "offload"
        offload.mkdir()
        if "fuzz" in phases:
            log("fuzzing")
            figures["fuzz"] = phase_fuzz(args.fuzz_requests, work)
        if "cycles" in phases:
            log(f"{args.cycles} sleep cycles")
            figures["cycles"] = phase_cycles(args.cycles, offload)
        if "kill" in phases:
            log("kill -9 while asleep")
            figures["kill"] = phase_kill(offload)
        if "sigterm" in phases:
            log("SIGTERM under load")
            figures["sigterm"] = phase_sigterm(args.streams, args.grace)
    ok = all(v.get("ok") for v in figures.values() if isinstance(v, dict))
    figures["ok"] = ok
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
