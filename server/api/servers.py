"""--api-server-count N: N API processes in front of one engine process.

One API process parses about one request every ~0.9 ms (its event loop, uvicorn, the ASGI layers: see
docs/measurements.md, "What misses its target"), so a burst of 256 requests reaches the engine over
~150-270 ms while the engine could take them at once. Several API processes divide that work, as vLLM's
--api-server-count does.

Layout: the first API process (the one `sleepserve serve` runs) starts the engine with one channel per API
process (server/api/engine_client.py, launch), binds N listening sockets to the same address with SO_REUSEPORT (the
kernel spreads new connections over them evenly) and starts the N - 1 others here, each with one socket and
one channel. Every API process serves every route; the engine keeps one order for all their commands and
sends each process its own requests' outputs, and every process its status (sleep state, stats).
What each process counts for /metrics lives in files of one shared folder (prometheus_client's
multiprocess mode), so a scrape reaches any of them and sums all (server/api/metrics.py).

Lifetimes: the first process owns the others. On SIGTERM or Ctrl-C it passes the signal on, and shuts the
engine down only after they have exited (their requests in flight get the same grace period); if one of them
dies, it shuts the server down (exit code 3), as when the engine dies. Each other process dies with the first
(the kernel's parent-death signal) and exits (3) if the engine goes away.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

log = logging.getLogger("sleepserve.server")

AUTO = "auto"
MAX_AUTO_API_SERVERS = 4


def auto_api_server_count(cores: int | None = None) -> int:
    """--api-server-count auto: API processes for this host. One API process begins a request every ~1 ms, so at
    256 requests at once the default server reached 0.77 of the engine on an H200 host, and 0.90-1.00 with four
    (docs/architecture.md, "Where serving time goes"). The engine process keeps two cores (its step thread and its
    helpers); of the rest, one API process per two cores (each is mostly one busy event loop, and the clients are
    often on the same host), at most four (more measured no faster, and each costs its own memory and start-up).
    cores: the CPUs this process may run on (its affinity, which a container's limit sets), by default."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_AUTO_API_SERVERS, (cores - 2) // 2))


def api_server_count(text: str) -> int | str:
    """The flag's value: a number of API processes, or `auto` (resolved by auto_api_server_count)."""
    if text.strip().lower() == AUTO:
        return AUTO
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1 or auto, got {value}")
    return value

METRICS_PREFIX = "sleepserve-metrics-"
BACKLOG = 2048  # uvicorn's default
START_TIMEOUT_S = 300.0  # for the others to listen (each imports the web stack and loads the tokenizer)
STOP_TIMEOUT_S = 30.0  # beyond the grace period: how long the others may take to exit before they are killed


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets listening on (host, port), each with SO_REUSEPORT; port 0 picks one free port for all.
    They listen at once, so a connection that reaches an API process still starting waits in its backlog
    rather than being refused. OSError when the address cannot be bound, also when another server listens
    there with SO_REUSEPORT (which would otherwise share the port with this one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:  # no SO_REUSEPORT: fails where anyone listens
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(BACKLOG)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def metrics_folder() -> str:
    """A new folder for the API processes' metrics files, named after this process; folders that processes
    no longer running left behind (a server killed with SIGKILL) are removed first."""
    tmp = tempfile.gettempdir()
    for old in glob.glob(os.path.join(tmp, f"{METRICS_PREFIX}*")):
        pid = os.path.basename(old)[len(METRICS_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-")


class OtherApiServers:
    """The API processes after the first, seen from the first."""

    def __init__(self, procs: list[subprocess.Popen], ready_pipes: list[int]):
        self.procs = procs
        self._ready_pipes = ready_pipes  # each writes one byte once it serves
        self._stopping = False
        self._on_death: Callable[[str], None] | None = None

    @classmethod
    def start(cls, settings: object, listeners: list[socket.socket], channels: list[socket.socket],
              metrics_dir: str, model: str | None = None) -> "OtherApiServers":
        """model: the --model the engine loads (each process starts loading that folder's tokenizer at once)."""
        procs, pipes = [], []
        for index, (listener, channel) in enumerate(zip(listeners, channels), start=1):
            ready, ready_w = os.pipe()
            fds = [listener.fileno(), channel.fileno(), ready_w]
            cmd = [sys.executable, "-m", "server.api.replica", "--index", str(index), "--listen-fd", str(fds[0]),
                   "--engine-fd", str(fds[1]), "--ready-fd", str(ready_w), "--parent", str(os.getpid()),
                   "--metrics-dir", metrics_dir, *(["--model", model] if model else [])]
            proc = subprocess.Popen(cmd, pass_fds=fds, stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(settings))
            proc.stdin.close()
            procs.append(proc)
            pipes.append(ready)
            for theirs in (listener, channel):
                theirs.close()
            os.close(ready_w)
        return cls(procs, pipes)

    def wait_ready(self, timeout: float) -> None:
        """Until each serves, then watch them (watch). RuntimeError if one exits first or takes longer than
        `timeout` seconds (the server then exits with code 1: a failed start, not a death)."""
        deadline = time.monotonic() + timeout
        pipes, self._ready_pipes = self._ready_pipes, []
        failed = None
        for index, fd in enumerate(pipes, start=1):
            left = max(0.0, deadline - time.monotonic())
            got = os.read(fd, 1) if failed is None and select.select([fd], [], [], left)[0] else None
            os.close(fd)
            if not got and failed is None and not self._stopping:
                failed = (f"API process {index} (pid {self.procs[index - 1].pid}) "
                          + ("exited while starting" if got == b"" else f"did not start in {timeout:.0f} s"))
        if failed is not None:
            self.stop()
            raise RuntimeError(failed)
        for index, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(index, proc), name=f"sleepserve-api-{index}",
                             daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def watch(self, on_death: Callable[[str], None]) -> None:
        """on_death(message), from a thread, when one exits, once all started, while the server is not stopping."""
        self._on_death = on_death

    def _watch(self, index: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._stopping and self._on_death is not None:
            self._on_death(f"API process {index} (pid {proc.pid}) exited with code {code}")

    def stop(self) -> None:
        """Pass SIGTERM on (once): each runs its own graceful shutdown (the same grace period)."""
        if self._stopping:
            return
        self._stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        """Until every one has exited (after stop); those still running after `timeout` seconds are killed."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("API process pid %d did not exit within %.0f s; killing it", proc.pid, timeout)
                proc.kill()
                proc.wait()
