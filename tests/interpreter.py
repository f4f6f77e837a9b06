"""Runs a snippet under Triton's CPU interpreter, in a fresh process: TRITON_INTERPRET is read when a
kernel is defined, so it cannot be switched on inside a process that already imported the kernels."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(code: str, timeout: float = 300) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout
