"""Shared fixtures. The default model is converted once per cache folder (about 40 s the first time).

tests/ follows the source: allocator/, model/, engine/, wire/, api/ (the API process's modules on their own),
http/ (through the real server), weight_transfer/, bench/ and docker/ (the benchmarks' and the image's
checks), gpu/ (`-m gpu`, run by `make gpu-check`). Helpers that bench/ and scripts/ use too live in testkit/.
Checks of the whole repository (layers, docs, testkit imports) sit at the top. No folder has an __init__.py:
pytest imports each test file by its name, so names stay unique across folders."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, os.cpu_count() or 1))


# `make test` leaves these out (marked slow) so that it stays within 12.5 minutes on 2 cores; `make test-slow`
# runs them, and CI runs both. Each is the slow twin of a check `make test` keeps: Triton kernels under the
# CPU interpreter (their PyTorch paths are tested in make test, the compiled kernels by make gpu-check);
# tensor parallelism through several processes (gloo) and through HTTP; the HTTP twins of engine-level checks
# (async scheduling, batch invariance, MoE); several API processes; the CLI's environment and bad paths;
# reliability, fuzz, bad-input and load runs; the benchmarks' own smoke runs. Times: the 2-core CI host,
# 2026-12-04 (make test without them: 466 tests in 565 s on a clean clone; 486 in 388 s on 2026-12-05).
SLOW_FILES = {
    "model/test_fused_ops_interpreted.py",             # 211 s
    "model/test_small_gemm_interpreted.py",            # 105 s
    "model/test_batch_invariant_kernels_interpreted.py",  # 68 s
    "model/test_prefill_kernel_interpreted.py",        # 57 s
    "engine/test_fused_sample_interpreted.py",         # 57 s
    "engine/test_tensor_parallel.py",                  # 112 s
    "engine/test_moe_tensor_parallel.py",              # 29 s
    "engine/test_stream_interval.py",                  # 55 s
    "engine/test_profiling.py",                        # 27 s
    "http/test_http_cli.py",                           # 49 s
    "http/test_http_moe.py",                           # 43 s
    "http/test_reliability_input.py",                  # 40 s
    "http/test_http_api_servers.py",                   # 128 s
    "http/test_reliability_server.py",                 # 93 s
    "http/test_http_tensor_parallel.py",               # 77 s
    "http/test_http_async_scheduling.py",              # 70 s
    "http/test_http_batch_invariant.py",               # 58 s
    "http/test_schema_fuzz.py",                        # 55 s
    "http/test_http_torchrun.py",                      # 43 s
    "http/test_http_load.py",                          # 31 s
    "bench/test_bench.py",                             # 75 s
    "bench/test_bench_moe.py",                         # 30 s
    "bench/test_bench_batch_invariant.py",             # 7 s
}
TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if os.path.relpath(str(item.path), TESTS) in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make gpu-check` on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_folder():
    from server.model.source import resolve_model

    return resolve_model(None).folder


@pytest.fixture(scope="session")
def llm(default_model_folder):
    """One CPU engine on the default model, shared by tests that leave it as they found it."""
    from server import LLM

    engine = LLM(model=str(default_model_folder), device="cpu")
    yield engine
    engine.close()


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
    "Translate to French: Good morning, how are you?",
    "The quick brown fox",
    "Explain photosynthesis in one sentence.",
    "1, 2, 3, 4, 5,",
]
