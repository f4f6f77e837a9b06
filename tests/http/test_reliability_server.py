"""The server's own safety (issue 17) through real servers: offload files nothing else can reach and
nothing can outlive, dev routes a browser cannot drive, keys kept out of sight, graceful SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from testkit.http_server import BASE_ARGS, REPO, ServerProcess, free_port, server_env, wait_for

pytestmark = pytest.mark.timeout(300)

PROMPT = "The history of the city of Paris, the capital of France"


def fds_into(pid: int, folder: Path) -> list[str]:
    """Targets of the process's open files under `folder` (deleted ones say so)."""
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(folder)):
            out.append(target)
    return out


def greedy(server: ServerProcess) -> str:
    r = httpx.post(server.url + "/v1/completions", timeout=120, headers=server.headers(),
                   json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def dev(server: ServerProcess, method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return httpx.request(method, server.url + path, headers=headers, timeout=120, **kwargs)


@pytest.fixture(scope="module")
def offload_dir():
    with tempfile.TemporaryDirectory(prefix="sleepserve-offload-test-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def server(offload_dir):
    """The default local set-up: dev routes on, no key, loopback only; offloads into offload_dir."""
    s = ServerProcess([*BASE_ARGS, "--dev-mode", "--offload-dir", str(offload_dir)]).start()
    yield s
    s.stop()


# -- offload files -------------------------------------------------------------------------------------


def test_offload_file_is_unreachable_and_gone_while_awake(server, offload_dir):
    reference = greedy(server)
    pid = server.engine_pid  # the engine process owns the pool and its backups
    victim = offload_dir.parent / f"{offload_dir.name}-victim"
    victim.write_text("precious")
    planted = [offload_dir / f"sleepserve-{pid}-{i}-{tag}.bin" for i in range(3) for tag in ("weights", "kv_cache")]
    try:
        for p in planted:
            p.symlink_to(victim)
        assert not fds_into(pid, offload_dir)
        r = dev(server, "POST", "/sleep?level=1")
        assert r.status_code == 200, r.text
        assert victim.read_text() == "precious"  # no planted name was followed
        assert sorted(offload_dir.iterdir()) == sorted(planted)  # the backup has no name in the folder
        held = fds_into(pid, offload_dir)
        assert held and all("(deleted)" in t for t in held), held
        # A temp-folder cleaner empties the folder while the server sleeps: the wake still works.
        for p in offload_dir.iterdir():
            p.unlink()
        r = dev(server, "POST", "/wake_up")
        assert r.status_code == 200, r.text
        assert greedy(server) == reference
        assert not fds_into(pid, offload_dir)  # nothing on disk while awake
        assert not list(offload_dir.iterdir())
    finally:
        for p in planted:
            p.unlink(missing_ok=True)
        victim.unlink()


# -- dev routes from a browser -------------------------------------------------------------------------


def test_cross_site_requests_cannot_drive_dev_routes(server):
    url = server.url
    evil = {"Origin": "http://evil.example"}
    cases = [
        ("POST", "/sleep?level=2", {"Content-Type": "text/plain", **evil}, 403),
        ("POST", "/sleep?level=2", {"Content-Type": "text/plain"}, 415),
        ("POST", "/sleep?level=2", {"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ("POST", "/sleep?level=2", {"Content-Type": "application/json", **evil}, 403),
        ("POST", "/sleep?level=2", {"Origin": "null"}, 403),
        ("POST", "/update_weights", {"Content-Type": "text/plain", **evil}, 403),
        ("POST", "/sleep?level=2", {"Content-Type": "application/json", "Host": f"evil.example:{server.port}"}, 403),
        ("GET", "/is_sleeping", {"Host": "rebound.evil.example"}, 403),
    ]
    for method, path, headers, status in cases:
        r = httpx.request(method, url + path, headers=headers, content=b"{}" if method == "POST" else None,
                          timeout=60)
        assert r.status_code == status, (path, headers, r.status_code, r.text)
        assert r.json()["error"]["message"], r.text
    state = httpx.get(url + "/is_sleeping").json()
    assert state["is_sleeping"] is False and state["weights_valid"] is True
    # The same-origin page and plain clients (no Origin, no body) still work.
    r = dev(server, "POST", "/sleep?level=1", headers={"Origin": f"http://localhost:{server.port}"})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/wake_up", timeout=60)
    assert r.status_code == 200, r.text


def test_dev_mode_on_a_public_address_needs_an_admin_key():
    out = subprocess.run([sys.executable, "-m", "server", "serve", "--dev-mode", "--host", "0.0.0.0",
                          "--port", str(free_port()), "--device", "cpu"], cwd=REPO, env=server_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--admin-api-key" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_allowed_hosts_flag_admits_a_proxy_name():
    from server.api.guard import host_allowed
    from server.api.settings import ServerSettings

    s = ServerSettings(host="127.0.0.1", port=8000, allowed_hosts=("gpu-box.internal",))
    assert host_allowed("gpu-box.internal:8000", s) and host_allowed("localhost:9000", s)
    assert not host_allowed("evil.example", s) and not host_allowed("", s)


# -- kill -9 while asleep ------------------------------------------------------------------------------


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_zz_kill_9_while_asleep_leaves_no_file(server, offload_dir):
    r = dev(server, "POST", "/sleep?level=1")
    assert r.status_code == 200, r.text
    engine = server.engine_pid
    assert fds_into(engine, offload_dir)
    server.proc.kill()
    server.proc.wait(30)
    # The engine process dies with the API process (its parent-death signal): nothing holds the backup.
    wait_for(lambda: not Path(f"/proc/{engine}").exists() or _zombie(engine), 30, what="the engine process to exit")
    assert not list(offload_dir.iterdir())
    again = ServerProcess([*BASE_ARGS, "--dev-mode", "--offload-dir", str(offload_dir)]).start()
    try:
        assert httpx.get(again.url + "/health").json()["status"] == "ok"
        assert not list(offload_dir.iterdir())
    finally:
        again.stop()


def test_too_little_space_for_the_weights_is_a_start_up_error(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        out = subprocess.run([sys.executable, "-m", "server", "serve", *BASE_ARGS, "--offload-dir", str(mnt),
                              "--port", str(free_port())], cwd=REPO, env=server_env(), capture_output=True,
                             text=True, timeout=240)
        assert out.returncode == 1, out.stderr[-2000:]
        assert "space" in out.stderr and str(mnt) in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# -- keys, docs, SIGTERM ----------------------------------------------------------------------------


def _stream(url: str, key: str, body: dict, out: dict, name: str) -> None:
    events: list[str] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120,
                          headers={"Authorization": f"Bearer {key}"}) as r:
            out[name + ":status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as e:
        events.append(f"ERROR {type(e).__name__}: {e}")
    out[name] = events


def test_sigterm_ends_streams_properly_and_exits_0(tmp_path):
    key = "sk-from-a-file-4242"
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    s = ServerProcess([*BASE_ARGS, "--api-key-file", str(key_file), "--no-docs", "--shutdown-grace-period", "3"],
                      api_key=key).start()
    try:
        assert key not in s.log_text() and key not in " ".join(s.proc.args)
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/v1/models", headers=s.headers()).status_code == 200
        assert httpx.get(s.url + "/docs", headers=s.headers()).status_code == 404
        assert httpx.get(s.url + "/openapi.json", headers=s.headers()).status_code == 404

        out: dict = {}
        long = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True}
        short = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
        threads = [threading.Thread(target=_stream, args=(s.url, key, long, out, f"long{i}")) for i in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: all(len(out.get(f"long{i}", [])) or out.get(f"long{i}:status") for i in range(4)),
                 timeout=60, what="the streams to start")
        time.sleep(0.5)
        short_t = threading.Thread(target=_stream, args=(s.url, key, short, out, "short"))
        short_t.start()
        # Only once its response has started: a request not yet received when SIGTERM lands is refused.
        wait_for(lambda: out.get("short:status"), timeout=60, what="the short stream to start")
        s.proc.send_signal(signal.SIGTERM)
        for t in [*threads, short_t]:
            t.join(60)
        assert s.proc.wait(60) == 0, s.log_tail()
    finally:
        s.stop()
    for name in [f"long{i}" for i in range(4)] + ["short"]:
        events = out[name]
        assert events and events[-1] == "[DONE]", (name, events[-3:])
        finals = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
        assert finals == (["length"] if name == "short" else ["abort"]), (name, finals)
    log = s.log_text()
    assert "Traceback" not in log and "CancelledError" not in log, s.log_tail()
    assert key not in log


def test_a_request_held_at_sigterm_gets_503_when_the_grace_period_ends():
    """Nothing wakes a server that is shutting down: a request held by a sleep answers 503 shutting_down once
    the grace period ends, rather than being cancelled with a 500 when uvicorn's own deadline passes."""
    s = ServerProcess([*BASE_ARGS, "--dev-mode", "--shutdown-grace-period", "1"]).start()
    try:
        assert httpx.post(s.url + "/sleep", params={"level": 1}, timeout=60).status_code == 200
        out: dict = {}
        held = threading.Thread(target=lambda: out.update(r=httpx.post(
            s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60)))
        held.start()
        wait_for(lambda: httpx.get(s.url + "/load", timeout=30).json()["held"] == 1, 30, what="the request to be held")
        s.proc.send_signal(signal.SIGTERM)
        held.join(30)
        assert not held.is_alive(), "the held request hung"
        r = out["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert s.proc.wait(60) == 0, s.log_tail()
    finally:
        s.stop()
    log = s.log_text()
    assert "Traceback" not in log and "CancelledError" not in log, s.log_tail()
