"""A bounded schemathesis run against the real server, driven by the server's own OpenAPI document:
no generated request (bodies included, dev routes included) may get a 500, every status must be one
the document declares, and the server must still serve afterwards. `make soak` runs the long version
(scripts/soak.py)."""
from __future__ import annotations

import httpx
import pytest

from testkit.fuzz import FUZZ_ARGS, KEY, fuzz
from testkit.http_server import ServerProcess

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(FUZZ_ARGS, api_key=KEY).start()
    yield s
    s.stop()


def test_generated_requests_never_get_a_server_error(server, tmp_path):
    result = fuzz(server, tmp_path, examples=40, seed=17, timeout=360)
    print(result["output"][-1500:])
    assert result["exit"] == 0, result["output"]
    assert result["requests"] >= 200, result
    assert not any(s.startswith("5") and s != "503" for s in result["statuses"]), result["statuses"]
    print(f"\nschemathesis: {result['requests']} requests, statuses {result['statuses']}")
    # Whatever the fuzzer left (asleep, paused), the server wakes and serves.
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    httpx.post(server.url + "/wake_up", headers=headers, timeout=60)
    httpx.post(server.url + "/resume", headers=headers, timeout=60)
    httpx.post(server.url + "/update_weights", headers=headers, timeout=120)
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=120,
                   json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert "Traceback" not in server.log_text(), server.log_tail()
