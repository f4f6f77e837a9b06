"""Tensor parallelism under torchrun on two GPUs of one host (--tp-launch torchrun, NCCL): the same greedy
tokens as the server spawning its own ranks (same model, same kernels), rank 1 on cuda:1 (its LOCAL_RANK),
and unchanged by level-1 and level-2 sleeps. Several hosts are not tested anywhere. Skipped on a host with
fewer than two GPUs."""
from __future__ import annotations

import httpx
import pytest
import torch

from testkit.http_server import ServerProcess, TorchrunServer, free_port, greedy_texts
from testkit.models import model_folder

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]
ARGS = ["--device", "cuda", "--load-format", "dummy", "--max-model-len", "1024", "--kv-cache-memory", "256MiB",
        "--max-num-seqs", "16", "--dev-mode",
        "--tensor-parallel-size", "2", "--log-level", "info"]


def test_torchrun_on_two_gpus_answers_as_the_spawned_ranks_across_sleeps(tmp_path):
    folder = str(model_folder("llama-tiny", tmp_path))  # as tests/gpu/test_tensor_parallel_gpu.py
    spawned = ServerProcess([folder, *ARGS]).start()
    try:
        reference = greedy_texts(spawned, PROMPTS, 16)
    finally:
        spawned.stop()
    server = TorchrunServer([folder, *ARGS, "--tp-launch", "torchrun"],
                            env={"SLEEPSERVE_TP_KEY": "gpu-check-key-0123456789", "SLEEPSERVE_TP_PORT": str(free_port())})
    try:
        server.start()
        ranks = httpx.get(server.url + "/server_info").json()["tensor_parallel"]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and ranks[1]["device"] == "cuda:1", ranks
        assert [r["all_reduce"] for r in ranks] == ["nccl", "nccl"], ranks
        assert greedy_texts(server, PROMPTS, 16) == reference
        for level in (1, 2):
            assert httpx.post(server.url + "/sleep", params={"level": level}, timeout=300).status_code == 200
            assert httpx.post(server.url + "/wake_up", timeout=300).status_code == 200
            if level == 2:
                r = httpx.post(server.url + "/update_weights", json={}, timeout=300)  # the same seeded dummy
                assert r.status_code == 200, r.text
            assert greedy_texts(server, PROMPTS, 16) == reference, f"level {level}"
    finally:
        print(server.log_tail(40))
        server.stop()
