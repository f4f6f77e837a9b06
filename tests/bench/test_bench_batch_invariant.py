"""bench/batch_invariant.py's CPU smoke run (--small): both modes decode on one tiny model, the table and JSON
say each batch's tok/s and ratio (the H200 run is the one whose figures count)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.interpreter import ROOT


def test_small_run_reports_both_modes_and_their_ratio(tmp_path):
    res = subprocess.run([sys.executable, "bench/batch_invariant.py", "--small", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stderr[-3000:]
    printed = json.loads(res.stdout.strip().splitlines()[-1])
    saved = json.loads((tmp_path / "batch_invariant_small.json").read_text())
    assert printed == saved
    assert [(r["model"], r["batch"]) for r in saved["rows"]] == [("llama-micro", 1), ("llama-micro", 4)]
    for r in saved["rows"]:
        assert r["default_tok_s"] > 0 and r["batch_invariant_tok_s"] > 0
        assert r["ratio"] == r["batch_invariant_tok_s"] / r["default_tok_s"]
    assert "| ratio |" in res.stdout
