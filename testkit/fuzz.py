"""The schemathesis run against the real server, driven by the server's own OpenAPI document: the bounded
run of tests/http/test_schema_fuzz.py and the long one of `make soak` (scripts/soak.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testkit.http_server import BASE_ARGS, ServerProcess

KEY = "sk-fuzz"
# A short context keeps every generated request cheap on 2 CPU cores: at most ~40 tokens each. The fuzzer
# also sleeps and pauses the server; a generation request that arrives then is held, and a 1 s hold limit
# makes it answer its documented 503 soon instead of outwaiting the client's timeout.
FUZZ_ARGS = [*BASE_ARGS[:2], "--max-model-len", "48", "--kv-cache-memory", "64MiB", "--log-level", "warning",
             "--dev-mode", "--api-key", KEY, "--held-request-timeout", "1"]
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance"
CONFIG = Path(__file__).with_name("schemathesis.toml")


def fuzz(server: ServerProcess, out_dir: Path, examples: int, seed: int, timeout: float) -> dict:
    """Run schemathesis; returns {"exit": code, "requests": n, "statuses": {...}, "output": text}."""
    ndjson = out_dir / "events.ndjson"
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run", f"{server.url}/openapi.json",
           "-H", f"Authorization: Bearer {KEY}", "--checks", CHECKS, "--max-examples", str(examples),
           "--seed", str(seed), "--workers", "1", "--phases", "examples,fuzzing", "--no-shrink",
           "--request-timeout", "120", "--suppress-health-check", "all", "--report", "ndjson",
           "--report-ndjson-path", str(ndjson), "--warnings", "off"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=out_dir)
    statuses: dict[str, int] = {}
    requests = 0
    if ndjson.exists():
        for line in ndjson.read_text().splitlines():
            for status in _statuses(json.loads(line)):
                statuses[str(status)] = statuses.get(str(status), 0) + 1
                requests += 1
    return {"exit": proc.returncode, "requests": requests, "statuses": statuses,
            "output": proc.stdout[-6000:] + proc.stderr[-3000:]}


def _statuses(node) -> list[int]:
    """Status codes of every response recorded in one ndjson event."""
    found: list[int] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if "status_code" in n and isinstance(n["status_code"], int) and "elapsed" in n:
                found.append(n["status_code"])
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return found
