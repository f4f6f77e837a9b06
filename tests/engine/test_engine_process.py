"""The process split through a real server: the engine runs in a process of its own, and when it dies
(killed here with SIGKILL, as the OOM killer would) every request in flight or held answers 503 at
once and the server exits with code 3 and a message that says what happened, instead of hanging."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from testkit.http_server import BASE_ARGS, ServerProcess, engine_child, wait_for

pytestmark = pytest.mark.timeout(300)

PROMPT = "The history of the city of Paris, the capital of France"


def test_the_engine_is_a_child_process_and_its_death_ends_the_server_with_503s():
    server = ServerProcess([*BASE_ARGS, "--dev-mode"]).start()
    try:
        engine = server.engine_pid
        assert engine != server.proc.pid
        info = httpx.get(server.url + "/server_info", timeout=30).json()
        assert info["processes"] == {"api_pid": server.proc.pid, "engine_pid": engine, "api_server_count": 1}
        assert f"engine process pid {engine}" in server.log_text()

        # A stream in flight, then a pause that keeps it, then a request held by the pause.
        first_chunk = threading.Event()
        stream: dict = {"events": []}

        def streamed() -> None:
            body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                stream["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        stream["events"].append(line[6:])
                        first_chunk.set()

        held: dict = {}

        def held_request() -> None:
            held["r"] = httpx.post(server.url + "/v1/completions", timeout=120,
                                   json={"prompt": PROMPT, "max_tokens": 4})

        t_stream = threading.Thread(target=streamed)
        t_stream.start()
        assert first_chunk.wait(120), "the stream never started"
        assert httpx.post(server.url + "/pause?mode=keep", timeout=60).status_code == 200
        t_held = threading.Thread(target=held_request)
        t_held.start()
        wait_for(lambda: httpx.get(server.url + "/load", timeout=30).json()["held"] == 1, 30,
                 what="the request to be held")

        killed_at = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        t_held.join(30)
        t_stream.join(30)
        assert not t_held.is_alive() and not t_stream.is_alive(), "a request hung after the engine died"
        answered_in = time.monotonic() - killed_at
        r = held["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        assert "was killed by SIGKILL" in r.json()["error"]["message"], r.text
        # The stream had its 200; the error arrives as its last event, then [DONE].
        assert stream["status"] == 200 and stream["events"][-1] == "[DONE]", stream["events"][-3:]
        error = json.loads(stream["events"][-2])["error"]
        assert error["code"] == "engine_dead", error

        code = server.proc.wait(60)
        assert code == 3, (code, server.log_tail())
        log = server.log_text()
        assert f"the engine process (pid {engine}) was killed by SIGKILL" in log, server.log_tail()
        assert "Traceback" not in log, server.log_tail()
        assert answered_in < 30
    finally:
        server.stop()


def test_the_engine_exits_with_the_server():
    server = ServerProcess([*BASE_ARGS]).start()
    engine = server.engine_pid
    server.stop()  # SIGINT: the graceful shutdown asks the engine to stop, then waits for it
    assert server.proc.returncode == 130
    assert engine_child(server.proc.pid) is None
    wait_for(lambda: not os.path.exists(f"/proc/{engine}"), 30, what="the engine process to be gone")


def test_an_engine_spawned_early_ends_quietly_when_the_server_never_starts_it():
    """The CLI spawns the engine before its own imports (spawn.py); a usage error found after that closes the
    channel before any Start: the engine process exits 0 with nothing on stderr, having loaded nothing."""
    import subprocess
    import sys

    from testkit.http_server import REPO, server_env

    # A bad engine flag that only EngineConfig checks (after the spawn): the CLI's usage error, exit 2.
    done = subprocess.run([sys.executable, "-m", "server", "serve", "--device", "cpu", "--gpu-memory-utilization", "1.5"],
                          cwd=REPO, env=server_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "gpu_memory_utilization must be in" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr

    from server.api.spawn import spawn_engine

    spawned = spawn_engine()
    spawned.mine.close()  # as the CLI's exit does
    assert spawned.proc.wait(120) == 0
