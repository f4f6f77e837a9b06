"""Starts the real server (`python -m server serve ...`) as a subprocess on a free loopback port.

Servers are shared: `shared_server(name, args)` starts one the first time a test module asks for it
and keeps it for the rest of the pytest run (start-up costs about 10 s on CPU; CI has 2 cores).
Tests that change server state (sleep, pause) must leave it serving again.
"""
from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 240.0  # a first run converts the default model (about 40 s) before serving
# Small limits keep CPU tests fast: a short context makes over-context prompts cheap to build.
# One API process (the default, auto, starts up to four on a host with more cores): a test that wants more says so.
BASE_ARGS = ["--device", "cpu", "--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--log-level", "info",
             "--api-server-count", "1"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment minus the variables that set server flags (SLEEPSERVE_PORT, ...): a test's
    command line must be all the server sees. Others (SLEEPSERVE_CACHE, PYTHONPATH's carried
    packages on the GPU host) pass through."""
    from server.cli import ENV_PREFIX, SERVE_OPTIONS

    flags = {o.env for o in SERVE_OPTIONS} | {ENV_PREFIX + "MODEL"}
    env = {k: v for k, v in os.environ.items() if k not in flags}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _end_with_parent() -> None:
    """In the server's process before exec: SIGTERM it when the process that started it dies. Its own
    session keeps it out of a terminal's Ctrl-C, so without this a test run or benchmark killed by a
    time limit would leave a server (and its engine's device memory) behind."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, api_key: str | None = None):
        self.args = list(args)
        self.env = env
        self.api_key = api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="sleepserve-test-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        return self.launch().wait_ready()

    def launch(self) -> "ServerProcess":
        """Start the process without waiting for it. PR_SET_PDEATHSIG fires when the *thread* that
        started the server ends: launch from a thread that outlives the server (to start several at
        once, launch each, then wait_ready each; never start them from a pool's threads)."""
        cmd = [sys.executable, "-m", "server", "serve", *self.args, "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=server_env(self.env), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_end_with_parent)
        return self

    def wait_ready(self) -> "ServerProcess":
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def engine_pid(self) -> int:
        """The engine process's pid: the server's child running server.engine.process."""
        assert self.proc is not None
        pid = engine_child(self.proc.pid)
        if pid is None:
            raise AssertionError(f"the server (pid {self.proc.pid}) has no engine process")
        return pid

    @property
    def api_pids(self) -> list[int]:
        """Every API process: the server's own, then those it started (--api-server-count)."""
        assert self.proc is not None
        return [self.proc.pid, *children(self.proc.pid, "server.api.replica")]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def headers(self, key: str | None = None) -> dict[str, str]:
        key = key or self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def client(self, timeout: float = 120.0, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, headers=self.headers(key))

    def async_client(self, timeout: float = 120.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=timeout, headers=self.headers(),
                                 limits=httpx.Limits(max_connections=200, max_keepalive_connections=100))

    def metric(self, name: str, labels: str = "") -> float:
        """One sample from /metrics, e.g. metric("sleepserve_kv_cache_blocks_used")."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
        if m is None:
            raise AssertionError(f"{name}{labels} is not in /metrics")
        return float(m.group(1))


class TorchrunServer(ServerProcess):
    """The server under torchrun (--tp-launch torchrun, --nproc-per-node `ranks`): self.proc is torchrun's
    agent, which starts every rank; the caller sets SLEEPSERVE_TP_KEY in env."""

    ranks = 2

    def launch(self) -> "TorchrunServer":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.ranks), "--master-port",
               str(free_port()), "-m", "server", "serve", *self.args, "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=server_env(self.env), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def stop(self) -> None:
        super().stop()
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # any rank torchrun left behind (its own session)
            except ProcessLookupError:
                pass


def children(parent: int, module: str) -> list[int]:
    """The pids of `parent`'s children that run `python -m <module>`, in pid order."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and module.encode() in cmdline.split(b"\0"):
            found.append(int(d.name))
    return sorted(found)


def engine_child(parent: int) -> int | None:
    """The pid of `parent`'s child that runs `python -m server.engine.process`, or None."""
    pids = children(parent, "server.engine.process")
    return pids[0] if pids else None


_shared: dict[str, ServerProcess] = {}


def shared_server(name: str, args: list[str], api_key: str | None = None,
                  env: dict[str, str] | None = None) -> ServerProcess:
    server = _shared.get(name)
    if server is None or not server.alive:
        server = ServerProcess([*BASE_ARGS, *args], env=env, api_key=api_key).start()
        _shared[name] = server
    return server


@atexit.register
def _stop_all() -> None:
    for server in _shared.values():
        server.stop()


def wait_for(condition, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    """Poll until condition() is truthy; return its value, or fail saying what was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)



def greedy_texts(server: ServerProcess, prompts: list[str], max_tokens: int = 8) -> list[str]:
    """The greedy completions of the prompts in one /v1/completions request, in prompt order."""
    r = httpx.post(server.url + "/v1/completions", timeout=300,
                   json={"prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def kill_during_a_request(server: ServerProcess, pid: int, prompt: str) -> httpx.Response:
    """SIGKILL pid while a long request runs on the server; that request's answer (it must get one)."""
    import threading

    answer: dict = {}

    def long_request() -> None:
        try:
            answer["r"] = httpx.post(server.url + "/v1/completions", timeout=300,
                                     json={"prompt": prompt, "max_tokens": 400, "ignore_eos": True})
        except httpx.TransportError as e:
            answer["error"] = e

    t = threading.Thread(target=long_request)
    t.start()
    wait_for(lambda: httpx.get(server.url + "/load").json()["running"] > 0, timeout=60, what="the request to run")
    os.kill(pid, signal.SIGKILL)
    t.join(120)
    assert "r" in answer, answer
    return answer["r"]

# The main server: an API key, no dev routes. The dev server: dev routes behind an admin key, both
# set through the environment (SLEEPSERVE_*), which test_http_cli checks reach the server; it refuses
# generation at once while asleep (--while-asleep reject). The hold server: dev routes, no keys, and
# the default --while-asleep hold with small limits, so the limits are cheap to reach.
MAIN_KEY = "sk-test-main"
DEV_KEY = "sk-test-dev"
ADMIN_KEY = "sk-test-admin"


def main_server() -> ServerProcess:
    return shared_server("main", ["--api-key", MAIN_KEY, "--served-model-name", "smol"], api_key=MAIN_KEY)


def dev_server() -> ServerProcess:
    return shared_server("dev", ["--api-key", DEV_KEY], api_key=DEV_KEY,
                         env={"SLEEPSERVE_DEV_MODE": "1", "SLEEPSERVE_ADMIN_API_KEY": ADMIN_KEY,
                              "SLEEPSERVE_WHILE_ASLEEP": "reject"})


HOLD_LIMIT = 3          # --max-held-requests
HOLD_TIMEOUT_S = 6.0    # --held-request-timeout


def hold_server() -> ServerProcess:
    return shared_server("hold", ["--dev-mode", "--max-held-requests", str(HOLD_LIMIT),
                                  "--held-request-timeout", str(HOLD_TIMEOUT_S), "--served-model-name", "smol"])
