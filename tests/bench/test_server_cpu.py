"""bench/server_cpu.py: the server's cores read from /proc, and the sibling lists parsed from sysfs."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import server_cpu  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")

BURN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(30)"


def test_a_busy_thread_and_an_idle_process_are_told_apart():
    busy = subprocess.Popen([sys.executable, "-c", BURN])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)  # both started; the burner still has most of its 0.6 s of CPU to spend
        cpu = server_cpu.ServerCpu(busy.pid, [idle.pid])
        start = time.perf_counter()
        time.sleep(1.0)
        cores = cpu.cores(time.perf_counter() - start)
    finally:
        busy.kill()
        idle.kill()
    assert 0.2 < cores["engine_thread"] <= cores["engine"] + 1e-9 < 1.05, cores
    assert cores["api"] < 0.1 and cores["api_max"] == pytest.approx(cores["api"]), cores


def test_sibling_lists_in_both_of_the_kernels_spellings(tmp_path, monkeypatch):
    real = Path
    files = {"cpu3": "2-3", "cpu5": "1,5"}

    def fake(path: str):
        for cpu, text in files.items():
            if f"/{cpu}/" in str(path):
                f = tmp_path / cpu
                f.write_text(text + "\n")
                return f
        return real(tmp_path / "absent")

    monkeypatch.setattr(server_cpu, "Path", fake)
    assert server_cpu.core_siblings(3) == {2, 3}
    assert server_cpu.core_siblings(5) == {1, 5}
    assert server_cpu.core_siblings(7) == {7}  # not reported: the CPU alone
