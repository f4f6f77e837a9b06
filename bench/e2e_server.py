"""Sleep mode end to end through the real HTTP server (issue: sleep mode end to end).

Starts `python -m server serve` with a ~1.2B bf16 Llama (random weights) on CUDA, or the embedded
model on CPU, and checks through HTTP: generate; /sleep?level=1; device memory in use against a
bare CUDA process measured in this run; /wake_up; the same greedy output; the first request after
wake against the same request before sleep. Then level 2: /wake_up answers 503 on generate until
/update_weights reloads, after which the output is the same again.

    python bench/e2e_server.py --out $OUT            # CUDA
    python bench/e2e_server.py --device cpu          # the same flow on the CPU backend
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import now_iso, table, write_json  # noqa: E402
from testkit.models import model_folder  # noqa: E402
from testkit.http_server import ServerProcess  # noqa: E402

MiB = 1 << 20
PROMPT = "The three most important ideas in the history of science are"


def complete(client, max_tokens: int = 64) -> tuple[str, float, int]:
    t = time.perf_counter()
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                             "ignore_eos": True})
    return r.json()["choices"][0]["text"] if r.status_code == 200 else "", time.perf_counter() - t, r.status_code


def used(client) -> int:
    m = client.get("/memory").json()
    return int(m["device_total"]) - int(m["device_free"])


def gpu_pids() -> dict[int, float] | None:
    """MiB of device memory per process with a CUDA context (nvidia-smi), or None without nvidia-smi."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = {}
    for line in out.strip().splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        used[int(pid)] = float(mib)
    return used


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()

    cuda = args.device == "cuda"
    bare = None
    if cuda:
        from testkit.footprint import bare_process_used
        bare = bare_process_used(0)  # before the server touches the GPU
        folder = model_folder(args.model, Path(tempfile.mkdtemp()), max_position_embeddings=131072)
        serve = [str(folder), "--device", "cuda", "--load-format", "dummy", "--max-model-len", "2048"]
    else:
        serve = ["--device", "cpu", "--kv-cache-memory", "256MiB", "--max-model-len", "1024"]
    server = ServerProcess([*serve, "--dev-mode", "--while-asleep", "reject"]).start()
    result: dict = {"date": now_iso(), "device": args.device, "model": args.model if cuda else "SmolLM2-135M"}
    rows = []
    try:
        with server.client(timeout=600) as c:
            startup = [line for line in server.log_text().splitlines() if "KV cache" in line or "model" in line]
            result["startup_log"] = startup[-6:]
            complete(c, 8)  # warm-up
            pids = gpu_pids() if cuda else None
            if pids is not None:
                # The API process must never create a CUDA context (memory no sleep could free).
                api, engine = server.proc.pid, server.engine_pid
                result["contexts_MiB"] = {"api_process": pids.get(api, 0.0), "engine_process": pids.get(engine)}
                if engine in pids:  # nvidia-smi sees this PID namespace: the check means something
                    assert api not in pids, f"the API process (pid {api}) holds a CUDA context: {pids}"
                    print(f"CUDA contexts: engine process {pids[engine]:.0f} MiB, API process none")
                else:
                    print(f"nvidia-smi lists other pids ({sorted(pids)}), not this namespace's: context check skipped")
            c.post("/reset_prefix_cache")
            reference, before_s, _ = complete(c)
            assert reference, "the first completion failed"
            result["request_before_sleep_s"] = before_s
            for level in (1, 2):
                c.post("/reset_prefix_cache")
                awake_used = used(c)
                t = time.perf_counter()
                r = c.post(f"/sleep?level={level}")
                sleep_s = time.perf_counter() - t
                assert r.status_code == 200, r.text
                asleep_used = used(c)
                refused = complete(c)[2]
                t = time.perf_counter()
                r = c.post("/wake_up")
                wake_s = time.perf_counter() - t
                assert r.status_code == 200, r.text
                if level == 2:
                    blocked = complete(c)[2]
                    assert blocked == 503, f"level 2 must refuse generation until weights load, got {blocked}"
                    r = c.post("/update_weights", json={})
                    assert r.status_code == 200, r.text
                text, after_s, status = complete(c)
                row = {"level": level, "sleep_s": sleep_s, "wake_s": wake_s, "awake_used_MiB": awake_used / MiB,
                       "asleep_used_MiB": asleep_used / MiB, "refused_while_asleep": refused,
                       "same_output": text == reference, "first_request_after_wake_s": after_s,
                       "after_over_before": after_s / before_s}
                if bare is not None:
                    row["bare_process_MiB"] = bare / MiB
                    row["asleep_over_bare_MiB"] = (asleep_used - bare) / MiB
                rows.append(row)
            assert server.alive
            assert all(r["same_output"] for r in rows), "output changed across a sleep/wake cycle"
    finally:
        server.stop()
    result["rows"] = rows
    write_json(args.out, f"e2e-server-{args.device}", result)
    print(f"\nend to end through HTTP ({result['model']}, {args.device}, {result['date']})")
    print(table([[r["level"], f"{r['sleep_s'] * 1e3:.0f} ms", f"{r['wake_s'] * 1e3:.0f} ms",
                  f"{r['awake_used_MiB']:.0f} -> {r['asleep_used_MiB']:.0f} MiB",
                  f"{r.get('asleep_over_bare_MiB', float('nan')):+.0f} MiB", r["refused_while_asleep"],
                  "yes" if r["same_output"] else "NO", f"{r['after_over_before']:.2f}x"] for r in rows],
                ["level", "sleep", "wake", "device used awake -> asleep", "asleep vs bare process",
                 "generate while asleep", "same output", "1st request after / before"]))


if __name__ == "__main__":
    main()
