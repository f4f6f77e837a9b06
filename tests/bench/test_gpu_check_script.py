"""scripts/gpu_check.sh's shell functions, which otherwise run only on the device machine: a mistake there costs a
device call. The script runs under `set -u`; embedded_model once read a variable no call had set and stopped every
stage that asks for the embedded model's weights (found on an H100, 2026-12-06)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def shell_function(name: str) -> str:
    """The function's definition as the script writes it: from `name() {` to the first line that is `}`."""
    found = re.search(rf"^{name}\(\) \{{.*?^\}}$", SCRIPT.read_text(), re.S | re.M)
    assert found, f"{name} is not defined in {SCRIPT}"
    return found.group(0)


def call_twice(folder: Path) -> subprocess.CompletedProcess:
    # run() stands in for the script's own (which logs and times a command): it prints what it would run.
    body = "set -uo pipefail\nrun() { echo \"RUN $*\"; }\nPYTHONPATH=\n" + shell_function("embedded_model") + \
        "\nembedded_model && embedded_model && echo \"PYTHONPATH=$PYTHONPATH\"\n"
    return subprocess.run(["bash", "-c", body], cwd=folder, capture_output=True, text=True, timeout=30)


def test_embedded_model_joins_once_under_set_u_where_the_pieces_came(tmp_path):
    (tmp_path / ".gguf_parts").mkdir()
    (tmp_path / ".gguf_parts" / "sha256").write_text("0" * 64 + " model.gguf\n")
    done = call_twice(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("RUN gguf-join bash scripts/gguf_pieces.sh join /tmp/gguf-model") == 1
    assert done.stdout.strip().endswith("PYTHONPATH=/tmp/gguf-model:")


def test_embedded_model_does_nothing_without_the_pieces(tmp_path):
    done = call_twice(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "RUN" not in done.stdout and done.stdout.strip() == "PYTHONPATH="
