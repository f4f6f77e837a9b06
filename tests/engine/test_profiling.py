"""vLLM's on-demand profiling (server/engine/step_profiler.py): with VLLM_TORCH_PROFILER_DIR set, POST /start_profile
and /stop_profile trace the engine process's steps into a gzipped Chrome trace there (LLM.start_profile() and
stop_profile() in process); without it the routes do not exist and the calls are refused."""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import httpx
import pytest

from server import SamplingParams
from server.wire.params import InvalidRequestError
from server.config import PROFILER_DIR_ENV
from server.engine.step_profiler import StepProfiler
from testkit.http_server import BASE_ARGS, MAIN_KEY, ServerProcess, main_server


def _ops(trace: str) -> set[str]:
    with gzip.open(trace, "rt") as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


def test_in_process_profile_traces_the_steps(llm, tmp_path):
    with pytest.raises(InvalidRequestError, match=PROFILER_DIR_ENV):
        llm.start_profile()  # the shared engine was built without the variable
    llm.engine.profiler = StepProfiler(tmp_path, llm.engine.device)
    try:
        llm.start_profile()
        llm.start_profile()  # a no-op while tracing, as vLLM's
        llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))
        report = llm.stop_profile()
        assert llm.stop_profile() == {"trace": None}  # nothing was running
    finally:
        llm.engine.profiler = None
    assert Path(report["trace"]).parent == tmp_path and report["device_busy_share"] is None  # a CPU engine
    assert any(op.startswith("aten::") for op in _ops(report["trace"]))  # the forward's ops are in it


def test_http_profile_routes_write_the_engine_process_trace(tmp_path):
    server = ServerProcess([*BASE_ARGS, "--api-key", MAIN_KEY], env={PROFILER_DIR_ENV: str(tmp_path)},
                           api_key=MAIN_KEY).start()
    try:
        auth = {"Authorization": f"Bearer {MAIN_KEY}"}
        assert httpx.post(server.url + "/start_profile", headers=auth, timeout=60).json() == {"profiling": True}
        model = httpx.get(server.url + "/v1/models", headers=auth, timeout=30).json()["data"][0]["id"]
        r = httpx.post(server.url + "/v1/completions", headers=auth, timeout=120,
                       json={"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200
        report = httpx.post(server.url + "/stop_profile", headers=auth, timeout=120).json()
        assert report["profiling"] is False and Path(report["trace"]).parent == tmp_path
        assert any(op.startswith("aten::") for op in _ops(report["trace"]))
        assert os.path.basename(report["trace"]).startswith("engine-")  # the engine process's own trace
        assert httpx.post(server.url + "/start_profile", timeout=60).status_code == 401  # behind the key
    finally:
        server.stop()


def test_profile_routes_do_not_exist_without_the_variable():
    server = main_server()
    r = httpx.post(server.url + "/start_profile", headers={"Authorization": f"Bearer {MAIN_KEY}"}, timeout=60)
    assert r.status_code == 404 and PROFILER_DIR_ENV in r.json()["error"]["message"]  # says how to turn them on
