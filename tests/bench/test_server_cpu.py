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

# Busy until a wall-clock deadline (however loaded the host), then idle.
BURN = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end: pass\ntime.sleep(30)"


def test_a_busy_thread_and_an_idle_process_are_told_apart():
    busy = subprocess.Popen([sys.executable, "-c", BURN])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)  # both started (the burner's interpreter up)
        cpu = server_cpu.ServerCpu(busy.pid, [idle.pid])
        time.sleep(1.5)
        cores = cpu.cores()
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
    # However many cores the load left the burner, its one thread is all of its process's CPU and the idle
    # process has next to none.
    assert cores["engine_thread"] > 0.05 and cores["engine_thread"] > 10 * cores["api"], cores
    assert cores["engine_thread"] == pytest.approx(cores["engine"], rel=0.1, abs=0.02), cores
    assert cores["engine"] < 1.05 and cores["api_max"] == pytest.approx(cores["api"]), cores


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
