"""Tensor parallelism launched by torchrun (--tp-launch torchrun): `torchrun --nproc-per-node 2 -m server
serve ...` on CPU (gloo), one host standing in for several. Rank 0 serves the API and its engine process
waits for rank 1, which joins it over TCP with SLEEPSERVE_TP_KEY. One server start for the module; the
last test kills rank 1. One-rank answers come from the shared hold server (same model, greedy)."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from testkit.http_server import (BASE_ARGS, REPO, TorchrunServer, free_port, greedy_texts, hold_server, kill_during_a_request,
                         server_env)

from server.engine.parallel.launch import torchrun_place

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
KEY = "test-key-0123456789abcdef"


@pytest.fixture(scope="module")
def server():
    env = {"SLEEPSERVE_TP_KEY": KEY, "SLEEPSERVE_TP_PORT": str(free_port())}
    # Synchronous steps: the TP=2 server of test_http_tensor_parallel.py runs with async scheduling (the
    # default), this one covers tensor parallelism without it through HTTP.
    proc = TorchrunServer([*BASE_ARGS, "--dev-mode", "--tensor-parallel-size", "2", "--tp-launch", "torchrun",
                           "--no-async-scheduling"], env=env)
    proc.launch()
    try:
        proc.wait_ready()
    except BaseException:
        proc.stop()
        raise
    yield proc
    proc.stop()


def test_torchrun_ranks_answer_as_one_rank_and_keep_it_across_a_sleep(server):
    reference = greedy_texts(hold_server(), PROMPTS)
    info = httpx.get(server.url + "/server_info").json()
    assert info["engine_config"]["async_scheduling"] is False
    assert info["engine_config"]["tp_launch"] == "torchrun" and info["world_size"] == 2
    ranks = info["tensor_parallel"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    assert greedy_texts(server, PROMPTS) == reference
    assert httpx.post(server.url + "/sleep", params={"level": 1}, timeout=300).status_code == 200
    memory = httpx.get(server.url + "/memory").json()["ranks"]
    assert [r["tags"]["weights"]["state"] for r in memory] == ["offloaded", "offloaded"]
    assert httpx.post(server.url + "/wake_up", timeout=300).status_code == 200
    assert greedy_texts(server, PROMPTS) == reference


def test_killing_rank_1_answers_503_and_the_run_ends(server):
    """Last: it ends the run. Rank 0 sees rank 1's liveness connection end, the request in flight
    gets 503 engine_dead naming the rank, and torchrun's run ends instead of hanging."""
    worker = httpx.get(server.url + "/server_info").json()["tensor_parallel"]["ranks"][1]["pid"]
    answer = kill_during_a_request(server, worker, PROMPTS[0])
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "engine_dead"
    assert f"rank 1 (pid {worker} on " in answer.json()["error"]["message"]
    assert server.proc.wait(90) != 0  # torchrun reports the failed rank
    assert f"tensor-parallel worker rank 1 (pid {worker} on " in server.log_text()


def test_torchrun_place_needs_the_key_and_a_matching_world():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(ValueError, match="SLEEPSERVE_TP_KEY"):
        torchrun_place(2, env)
    with pytest.raises(ValueError, match="SLEEPSERVE_TP_KEY"):
        torchrun_place(2, {**env, "SLEEPSERVE_TP_KEY": "short"})
    env["SLEEPSERVE_TP_KEY"] = KEY
    place = torchrun_place(2, env)
    assert (place.rank, place.local_rank, place.address, place.key) == (1, 1, "10.0.0.1:29501", KEY.encode())
    assert torchrun_place(2, {**env, "SLEEPSERVE_TP_PORT": "4000"}).port == 4000
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        torchrun_place(4, env)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        torchrun_place(2, {k: v for k, v in env.items() if k != "MASTER_ADDR"})


def test_the_cli_refuses_torchrun_without_its_key():
    env = server_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": "29500"})
    env.pop("SLEEPSERVE_TP_KEY", None)
    out = subprocess.run([sys.executable, "-m", "server", "serve", *BASE_ARGS, "--tensor-parallel-size", "2",
                          "--tp-launch", "torchrun"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "SLEEPSERVE_TP_KEY" in out.stderr, out.stderr[-2000:]
