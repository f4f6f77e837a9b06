"""bench/moe.py --small: the MoE benchmark's whole path (decode at three batches with the activated experts
counted from the returned routed experts, the roofline, sleep cycles, the capture cost against a flag-off
engine) on CPU with a tiny Qwen3-MoE, under a minute. No timing is asserted: the H200 run reads the ratios."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interpreter import run_interpreted

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


def test_layer_alone_runs_a_few_tokens_on_inputs_with_their_own_experts():
    """bench/moe.py's sparse layer alone (CUDA-only: here its kernels in Triton's interpreter and graph_ms as one
    plain call): up to SMALL_TOKENS tokens a capture runs FEW_TOKEN_INPUTS inputs in turn, each routed on its
    own, and the time is per call; past that, one input. One token's 8 experts replayed alone could be read from
    L2, which a decode step never allows (docs/moe.md)."""
    out = run_interpreted("""
import torch
import bench.moe as bench
import server.model.fused_moe as fused_moe
seen, captures = [], []
real = fused_moe.fused_experts
def counted(x, w13, w2, ids, weights, cfg):
    seen.append((tuple(ids.shape), tuple(sorted(ids.reshape(-1).tolist()))))
    return real(x, w13, w2, ids, weights, cfg)
def one_call(fn, device, replays=10, per_replay=1):
    captures.append(per_replay); fn(); return 1.0
fused_moe.fused_experts, bench.graph_ms, bench.TILES = counted, one_call, bench.TILES[:1]
config = {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 32, "num_experts_per_tok": 2}
rows = bench.layer_times(config, torch.device("cpu"), [1, 12], 1e12, 1e15)
print(rows[0]["inputs"], rows[1]["inputs"], rows[0]["experts_read"], rows[0]["default_us"])
print(sorted(set(captures)))
one_token = [ids for shape, ids in seen if shape == (1, 2)]
print(len(one_token), len(set(one_token)))
""")
    inputs, inputs_12, experts, us = out.splitlines()[0].split()
    assert (int(inputs), int(inputs_12), float(experts), float(us)) == (8, 1, 2.0, 1000.0)
    assert out.splitlines()[1] == "[1, 8, 16]"  # 8 inputs a capture at one token; 1 at 12; the routing's 16
    calls, distinct = map(int, out.splitlines()[2].split())
    # the swept tile's capture and the default's, 8 inputs each, routed apart (not one input replayed)
    assert calls == 16 and distinct >= 6, out
