"""bench/moe.py --small: the MoE benchmark's whole path (decode at three batches with the activated experts
counted from the returned routed experts, the roofline, sleep cycles, the capture cost against a flag-off
engine) on CPU with a tiny Qwen3-MoE, under a minute. No timing is asserted: the H200 run reads the ratios."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def test_small_run_reports_every_measure(tmp_path):
    res = subprocess.run([sys.executable, "bench/moe.py", "--small", "--out", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "moe.json").read_text())
    assert [row["batch"] for row in report["decode"]] == [1, 4, 8]
    k, e = report["config"]["num_experts_per_tok"], report["config"]["num_experts"]
    for row in report["decode"]:
        assert row["tok_s"] > 0 and 0 < row["fraction_of_roofline"]
        assert k <= row["experts_per_layer"] <= min(e, k * row["batch"])  # distinct experts of the batch
    assert report["decode"][0]["experts_per_layer"] == k  # one sequence: exactly its top-k
    assert report["sleep"]["level1"][0]["sleep_s"] > 0 and report["sleep"]["level2"]["reload_dummy_s"] > 0
    capture = report["routed_capture"]
    assert {"off_tok_s", "on_not_asking_tok_s", "on_asking_tok_s", "cost_asking"} <= set(capture)
    assert "[moe] decode at batch 8" in res.stderr  # progress per phase
