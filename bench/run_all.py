"""`make bench`: every benchmark that fits this machine (the CPU ones here; all of them with a GPU)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
    if torch.cuda.is_available():
        runs = [["bench/pool_table.py", "--out", out],
                ["bench/throughput.py", "--device", "cuda", "--out", out],
                ["bench/step_profile.py", "--out", out],
                ["bench/sleep_wake.py", "--device", "cuda", "--out", out],
                ["bench/e2e_server.py", "--device", "cuda", "--out", out],
                ["bench/structured_mask.py", "--device", "cuda", "--model", "llama-1b", "--out", out],
                ["bench/serve.py", "--device", "cuda", "--model", "llama-1b", "--out", out],
                ["bench/prefill.py", "--device", "cuda", "--out", out],
                ["bench/rollout.py", "--device", "cuda", "--model", "llama-1b", "--out", out],
                ["bench/rollout.py", "--device", "cuda", "--model", "llama-8b", "--out", out]]
    else:
        runs = [["bench/throughput.py", "--device", "cpu", "--out", out],
                ["bench/sleep_wake.py", "--device", "cpu", "--out", out],
                ["bench/e2e_server.py", "--device", "cpu", "--out", out],
                ["bench/structured_mask.py", "--device", "cpu", "--out", out],
                ["bench/serve.py", "--device", "cpu", "--model", "llama-tiny", "--smoke", "--out", out],
                ["bench/rollout.py", "--device", "cpu", "--model", "llama-tiny", "--smoke", "--out", out]]
    failed = [r[0] for r in runs if subprocess.run([sys.executable, *r], cwd=ROOT).returncode != 0]
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
