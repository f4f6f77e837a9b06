"""The command line: flags and SLEEPSERVE_* variables, a fast --help, clear failures, `prepare`."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import httpx
from testkit.http_server import ADMIN_KEY, REPO, dev_server, free_port, server_env

from server.cli import SERVE_OPTIONS, build_parser, resolve_options, split_options

pytestmark = pytest.mark.timeout(120)


def resolve(argv: list[str], env: dict[str, str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(["serve", *argv])
    return resolve_options(args, env or {}, args.parser)


def run_cli(*argv: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", *argv], cwd=REPO, env=server_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_defaults():
    v = resolve([])
    assert v["host"] == "127.0.0.1" and v["port"] == 8000 and v["dev_mode"] is False and v["model"] is None
    settings, engine = split_options(v)
    assert settings.api_key is None and engine["enable_prefix_caching"] is True and engine["max_num_seqs"] == 256
    assert engine["batch_invariant"] is None  # unset: the engine's config reads VLLM_BATCH_INVARIANT, else off


def test_every_flag_reads_its_environment_variable():
    samples = {"port": ("9001", 9001), "device": ("cpu", "cpu"), "max_model_len": ("512", 512),
               "gpu_memory_utilization": ("0.5", 0.5), "dev_mode": ("1", True), "no_prefix_caching": ("yes", True),
               "enforce_eager": ("true", True), "async_scheduling": ("on", True), "log_level": ("debug", "debug"), "seed": ("-3", -3),
               "max_num_seqs": ("3", 3), "max_num_batched_tokens": ("128", 128), "block_size": ("32", 32),
               "max_held_requests": ("7", 7), "held_request_timeout": ("2.5", 2.5),
               "no_docs": ("1", True), "shutdown_grace_period": ("2.5", 2.5), "tensor_parallel_size": ("2", 2),
               "tp_release_comm_on_sleep": ("1", True), "stream_interval": ("4", 4), "batch_invariant": ("1", True),
               "api_server_count": ("2", 2), "no_check_weights_finite": ("1", True),
               "enable_return_routed_experts": ("1", True)}
    for opt in SERVE_OPTIONS:
        raw, expected = samples.get(opt.dest, ("x-value", "x-value"))
        if opt.choices and opt.dest not in samples:
            raw = expected = opt.choices[-1]
        if opt.dest == "kv_cache_memory":
            continue  # excludes gpu_memory_utilization; checked below
        v = resolve([], {opt.env: raw})
        assert v[opt.dest] == expected, (opt.env, v[opt.dest])
    assert resolve([], {"SLEEPSERVE_KV_CACHE_MEMORY": "2GiB"})["kv_cache_memory"] == "2GiB"
    assert resolve([], {"SLEEPSERVE_MODEL": "/models/x"})["model"] == "/models/x"


def test_command_line_wins_over_the_environment():
    env = {"SLEEPSERVE_PORT": "9001", "SLEEPSERVE_DEV_MODE": "1", "SLEEPSERVE_API_KEY": "from-env",
           "SLEEPSERVE_NO_PREFIX_CACHING": "1", "SLEEPSERVE_GPU_MEMORY_UTILIZATION": "0.5"}
    v = resolve(["--port", "9002", "--no-dev-mode", "--api-key", "cli", "--prefix-caching",
                 "--kv-cache-memory", "1GiB"], env)
    assert (v["port"], v["dev_mode"], v["api_key"], v["no_prefix_caching"]) == (9002, False, "cli", False)
    assert v["kv_cache_memory"] == "1GiB" and v["gpu_memory_utilization"] == 0.9  # the env's 0.5 is hidden
    settings, _ = split_options(v)
    assert settings.effective_admin_key == "cli"  # the admin key defaults to the API key


def test_api_server_count_defaults_to_auto_for_the_host():
    from server.api.servers import auto_api_server_count

    # Two cores for the engine process, then one API process per two cores, 1 to 4.
    assert [auto_api_server_count(n) for n in (1, 2, 4, 6, 8, 10, 16, 128)] == [1, 1, 1, 2, 3, 4, 4, 4]
    for argv, env in (([], {}), (["--api-server-count", "auto"], {}), ([], {"SLEEPSERVE_API_SERVER_COUNT": "AUTO"})):
        v = resolve(argv, env)
        assert v["api_server_count"] == "auto"
        assert split_options(v)[0].api_server_count == auto_api_server_count()
    assert split_options(resolve(["--api-server-count", "3"], {}))[0].api_server_count == 3


@pytest.mark.parametrize("argv,env,words", [
    ([], {"SLEEPSERVE_PORT": "eighty"}, "SLEEPSERVE_PORT='eighty'"),
    ([], {"SLEEPSERVE_DEV_MODE": "maybe"}, "1/true/yes/on"),
    ([], {"SLEEPSERVE_DEVICE": "tpu"}, "choose from auto, cpu, cuda"),
    (["--tp-comm-suspend", "on"], {}, "invalid choice: 'on'"),
    ([], {"SLEEPSERVE_KV_CACHE_MEMORY": "1GiB", "SLEEPSERVE_GPU_MEMORY_UTILIZATION": "0.5"}, "keep one"),
    (["--port", "70000"], {}, "port number"),
    (["--max-num-seqs", "0"], {}, "at least 1"),
    (["--stream-interval", "0"], {}, "at least 1"),
    ([], {"SLEEPSERVE_STREAM_INTERVAL": "-2"}, "at least 1"),
    (["--api-server-count", "0"], {}, "at least 1"),
    ([], {"SLEEPSERVE_API_SERVER_COUNT": "two"}, "SLEEPSERVE_API_SERVER_COUNT='two'"),
    (["--kv-cache-memory", "1GiB", "--gpu-memory-utilization", "0.5"], {}, "not allowed with"),
])
def test_bad_values_exit_2_with_a_message(capsys, argv, env, words):
    with pytest.raises(SystemExit) as exc:
        resolve(argv, env)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_help_is_fast_and_imports_no_torch():
    code = ("import sys\nfrom server.cli import main\ntry:\n    main(['serve', '--help'])\nexcept SystemExit:\n"
            "    pass\nassert 'torch' not in sys.modules and 'fastapi' not in sys.modules, 'heavy import'\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=server_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - start < 5
    for flag in ("--dev-mode", "--api-key", "--kv-cache-memory", "SLEEPSERVE_DEV_MODE"):
        assert flag in out.stdout


def test_bad_model_path_fails_fast_with_exit_1(tmp_path):
    missing = tmp_path / "no-such-model"
    out = run_cli("serve", str(missing), "--device", "cpu", "--port", str(free_port()))
    assert out.returncode == 1, out.stderr
    assert "could not start" in out.stderr and str(missing) in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_model_path_with_several_api_processes_fails_with_exit_1_and_leaves_none(tmp_path):
    """The other API processes start while the engine loads: an engine that cannot start ends them too, quietly."""
    missing = tmp_path / "no-such-model"
    out = run_cli("serve", str(missing), "--device", "cpu", "--port", str(free_port()), "--api-server-count", "2")
    assert out.returncode == 1, out.stderr
    assert "could not start" in out.stderr and str(missing) in out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    # The other API process's command line names the model (--model): none is left.
    leftover = subprocess.run(["pgrep", "-f", str(missing)], capture_output=True)
    assert leftover.returncode == 1, leftover.stdout  # pgrep finds nothing


def test_an_address_in_use_with_several_api_processes_fails_before_loading():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        out = run_cli("serve", "--device", "cpu", "--port", str(port), "--api-server-count", "2")
    assert out.returncode == 1 and "could not listen" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "KV cache" not in out.stderr, out.stderr  # no model was loaded
    assert time.monotonic() - start < 60


def test_bad_size_is_a_usage_error():
    out = run_cli("serve", "--device", "cpu", "--kv-cache-memory", "lots")
    assert out.returncode == 2 and "lots" in out.stderr


def test_prepare_prints_the_model_folder():
    out = run_cli("prepare")
    assert out.returncode == 0, out.stderr
    folder = Path(out.stdout.strip().splitlines()[-1])
    assert (folder / "config.json").is_file()


def test_environment_configures_a_real_server():
    """The dev server gets --dev-mode and --admin-api-key only as SLEEPSERVE_DEV_MODE=1 and
    SLEEPSERVE_ADMIN_API_KEY (see http_server.dev_server); its clean shutdown is checked in test_http_sleep."""
    server = dev_server()
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=server.headers()).status_code == 200
    assert httpx.get(server.url + "/is_sleeping", headers=server.headers()).status_code == 401  # API key: no
    admin = httpx.get(server.url + "/is_sleeping", headers=server.headers(ADMIN_KEY))
    assert admin.status_code == 200 and admin.json()["is_sleeping"] is False
    assert "sleep mode dev routes: on" in server.log_text()
