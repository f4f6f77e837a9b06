"""Tensor parallelism through the real server: one TP=2 server (two processes, gloo on CPU; the size set
through SLEEPSERVE_TENSOR_PARALLEL_SIZE, --tp-all-reduce symm, which CPU ignores, and async scheduling (the
default, named here: a step is launched before the last one's tokens reach rank 0's host, its ids broadcast
to the worker on the device communicator), with --tp-release-comm-on-sleep through its variable (every sleep
destroys the ranks' communicator, every full wake creates a new one), serves this module, started once; the
last test kills its worker. One-rank answers come from the shared hold server (same model, same greedy decoding,
synchronous); the synchronous TP=2 server is test_http_torchrun.py's."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from testkit.http_server import BASE_ARGS, REPO, ServerProcess, greedy_texts, hold_server, kill_during_a_request
from testkit.models import write_trained_checkpoint

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TRAINER = [sys.executable, str(REPO / "tests" / "weight_transfer" / "weight_trainer.py")]


@pytest.fixture(scope="module")
def server():
    # --tp-all-reduce symm through its variable: on CPU the ranks report gloo (checked below)
    proc = ServerProcess([*BASE_ARGS, "--dev-mode", "--async-scheduling", "--weight-transfer-config",
                          '{"backend": "gloo"}'],
                         env={"SLEEPSERVE_TENSOR_PARALLEL_SIZE": "2", "SLEEPSERVE_TP_ALL_REDUCE": "symm",
                              "SLEEPSERVE_TP_RELEASE_COMM_ON_SLEEP": "1", "SLEEPSERVE_TP_COMM_SUSPEND": "off"}).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference():
    return greedy_texts(hold_server(), PROMPTS)


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, timeout=300, **kwargs)


def test_two_ranks_answer_as_one_rank(server, reference):
    assert greedy_texts(server, PROMPTS) == reference
    assert httpx.get(server.url + "/server_info").json()["engine_config"]["async_scheduling"] is True
    assert "async scheduling on" in server.log_text()  # not turned off for tensor parallelism


def test_world_size_and_per_rank_reports(server):
    assert httpx.get(server.url + "/get_world_size").json() == {"world_size": 2}
    info = httpx.get(server.url + "/server_info").json()
    assert info["world_size"] == 2 and info["engine_config"]["tensor_parallel_size"] == 2
    assert info["engine_config"]["tp_all_reduce"] == "symm"
    assert info["engine_config"]["tp_release_comm_on_sleep"] is True
    assert info["engine_config"]["tp_comm_suspend"] == "off"
    ranks = info["tensor_parallel"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    assert [r["all_reduce"] for r in ranks] == ["gloo", "gloo"]  # CPU: gloo whatever --tp-all-reduce says
    memory = httpx.get(server.url + "/memory").json()
    assert len(memory["ranks"]) == 2
    assert all(r["tags"]["weights"]["bytes"] > 50e6 for r in memory["ranks"])  # each holds about half
    assert server.metric("sleepserve_tensor_parallel_size") == 2
    assert server.metric("sleepserve_rank_pool_bytes", '{rank="1",state="awake",tag="weights"}') > 50e6


def test_sleep_levels_and_update_weights_keep_the_outputs(server, reference):
    slept = post(server, "/sleep", params={"level": 1})
    assert slept.status_code == 200
    ranks = httpx.get(server.url + "/memory").json()["ranks"]
    assert [r["tags"]["weights"]["state"] for r in ranks] == ["offloaded", "offloaded"]
    woke = post(server, "/wake_up")
    assert woke.status_code == 200
    # Timings: the facade's phase around every rank's pool call, rank 0's own pool phases, each rank's ms.
    sleep_pool, wake_pool = slept.json()["timings"]["pool"], woke.json()["timings"]["pool"]
    assert "ranks" in sleep_pool["phases_ms"] and "ranks" in wake_pool["phases_ms"]
    assert "write_backups" in sleep_pool["rank0"]["phases_ms"] and "read_backups" in wake_pool["rank0"]["phases_ms"]
    assert len(sleep_pool["rank_ms"]) == len(wake_pool["rank_ms"]) == 2
    # --tp-release-comm-on-sleep: every rank's communicator went with the sleep and came back with the wake
    assert "comm_release" in sleep_pool["phases_ms"] and "comm_recreate" in wake_pool["phases_ms"]
    assert len(sleep_pool["comm_ms"]) == len(wake_pool["comm_ms"]) == 2
    assert greedy_texts(server, PROMPTS) == reference
    assert post(server, "/sleep", params={"level": 2}).status_code == 200
    assert post(server, "/wake_up").status_code == 200
    r = post(server, "/update_weights", json={})  # the served checkpoint, each rank reading its slices
    assert r.status_code == 200, r.text
    assert r.json()["state"]["weights_valid"]
    assert greedy_texts(server, PROMPTS) == reference


def test_a_weight_transfer_group_without_room_for_every_rank_answers_400(server):
    """world_size must hold the trainer and both ranks from rank_offset: 400 before any rendezvous."""
    r = post(server, "/init_weight_transfer_engine",
             json={"init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "init_info.world_size"
    assert "2 ranks" in r.json()["error"]["message"]
    assert greedy_texts(server, PROMPTS)  # still serving


def test_weight_transfer_reaches_every_rank(server, reference, default_model_folder, tmp_path_factory):
    """A trainer pushes new weights over gloo (the NCCL protocol) to both ranks at once (world = trainer
    + 2 ranks, from /get_world_size); each keeps its slices. The outputs equal a disk load of the same
    checkpoint (each rank reading its slices), packed buckets and one broadcast per tensor alike."""
    trained = write_trained_checkpoint(default_model_folder, tmp_path_factory.mktemp("tp-push") / "trained", seed=11)
    assert post(server, "/update_weights", json={"path": str(trained)}).status_code == 200
    expected = greedy_texts(server, PROMPTS)
    assert expected != reference, "the new weights must change greedy outputs"
    for how in ([], ["--unpacked"]):
        assert post(server, "/update_weights", json={}).status_code == 200  # back to the served checkpoint
        assert greedy_texts(server, PROMPTS) == reference
        out = subprocess.run([*TRAINER, server.url, "gloo", str(trained), "no-admin-key", "--bucket-bytes",
                              str(16 << 20), "--weight-version", f"tp{how}", *how],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        assert out.returncode == 0 and lines, out.stderr[-3000:]
        report = json.loads(lines[-1])
        assert report["server"]["weights_valid"] is True and report["server"]["tensors"] > 100, report
        assert greedy_texts(server, PROMPTS) == expected, how
    assert post(server, "/update_weights", json={}).status_code == 200
    assert greedy_texts(server, PROMPTS) == reference


def test_killing_a_worker_answers_503_and_exits(server):
    """Last: it ends the server. A request in flight gets 503 (engine_dead) and the server exits with 3."""
    worker = httpx.get(server.url + "/server_info").json()["tensor_parallel"]["ranks"][1]["pid"]
    answer = kill_during_a_request(server, worker, PROMPTS[0])
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "engine_dead"
    assert f"rank 1 (pid {worker}) was killed by SIGKILL" in answer.json()["error"]["message"]
    assert server.proc.wait(90) == 3
    assert f"tensor-parallel worker rank 1 (pid {worker}) was killed by SIGKILL" in server.log_text()
