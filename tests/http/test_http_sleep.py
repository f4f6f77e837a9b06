"""Sleep mode end to end through the real server's dev routes (docs/sleep.md), on the dev
server, which refuses generation at once while asleep (--while-asleep reject; holding is test_http_hold)."""
from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import httpx
import pytest
from testkit.models import write_trained_checkpoint
from testkit.http_server import ADMIN_KEY, DEV_KEY, dev_server, wait_for

pytestmark = pytest.mark.timeout(300)

# Over 16 tokens, so it fills a KV block and can hit the prefix cache.
PROMPT = "The history of the city of Paris, the capital of France, begins with a small settlement on an island"


@pytest.fixture(scope="module")
def server():
    return dev_server()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def admin(server, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                         timeout=120, **kwargs)


def state(server) -> dict:
    r = admin(server, "GET", "/is_sleeping")
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(autouse=True)
def leave_serving(server):
    """Whatever a test did, the next one starts from an awake server with valid weights."""
    yield
    if not server.alive:  # the shutdown test stopped it
        return
    s = state(server)
    if s["draining"]:
        wait_for(lambda: not state(server)["draining"], timeout=60, what="the drain to end")
        s = state(server)
    if s["sleeping_tags"] or s["paused"]:
        woke = admin(server, "POST", "/wake_up")
        assert woke.status_code == 200, woke.text
    if not state(server)["weights_valid"]:
        loaded = admin(server, "POST", "/update_weights")
        assert loaded.status_code == 200, loaded.text
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def generate(client, max_tokens: int = 8, **extra) -> dict:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                             "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def greedy(client, max_tokens: int = 8) -> str:
    return generate(client, max_tokens)["choices"][0]["text"]


@pytest.fixture(scope="module")
def reference(client) -> str:
    return greedy(client)


def assert_refused(client, code: str, words: str) -> None:
    start = time.monotonic()
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    elapsed = time.monotonic() - start
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) > 0
    err = r.json()["error"]
    assert err["code"] == code and words in err["message"], err
    assert elapsed < 1.0, f"a refusal should be immediate, took {elapsed:.2f} s"
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 503 and chat.json()["error"]["code"] == code


def rss_bytes(server) -> int | None:
    status = Path(f"/proc/{server.engine_pid}/status")  # the engine process holds the pool
    if not status.exists():
        return None
    line = next(ln for ln in status.read_text().splitlines() if ln.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


# -- access ------------------------------------------------------------------------------------


def test_dev_routes_need_the_admin_key(server):
    for headers in ({}, {"Authorization": f"Bearer {DEV_KEY}"}):  # the API key is not the admin key
        r = httpx.post(server.url + "/sleep", headers=headers)
        assert r.status_code == 401 and "--admin-api-key" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/is_sleeping", headers=headers).status_code == 401
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"},
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 401
    assert state(server)["is_sleeping"] is False


# -- level 1 and level 2 cycles ----------------------------------------------------------------


def assert_timed(timings: dict, engine_phases: set[str], pool_phases: set[str]) -> None:
    """A sleep's or a wake's `timings`: the engine's and the pool's phases, each adding up to its total,
    and the collector's count (the numbers themselves are the GPU run's to read)."""
    assert engine_phases <= set(timings["phases_ms"]), timings["phases_ms"]
    pool = timings["pool"]
    assert pool_phases <= set(pool["phases_ms"]), pool["phases_ms"]
    for t in (timings, pool):
        assert all(v >= 0 for v in t["phases_ms"].values()), t
        assert math.isclose(sum(t["phases_ms"].values()), t["total_ms"], rel_tol=1e-6, abs_tol=1e-6), t
        assert len(t["gc"]["collections"]) == 3 and t["gc"]["ms"] >= 0
    assert pool["total_ms"] <= timings["phases_ms"]["pool"] + 1e-6  # the pool's call is inside its phase
    # The engine process froze its start-up heap (server/heap.py): full collections skip the model,
    # torch and the tokenizer instead of pausing a sleep for tens of milliseconds.
    assert timings["gc"]["frozen_objects"] > 10_000



def assert_channel(timings: dict, http_ms: float) -> None:
    """The trips between the API process and the engine thread (EngineClient._with_channel): measured on one
    clock across the two processes, each inside what the HTTP client waited, the engine's own time beside."""
    assert "at" not in timings  # the engine's raw readings became the channel's figures
    ch = timings["channel"]
    assert 0 <= ch["to_engine_ms"] and 0 <= ch["to_api_ms"], ch
    assert ch["to_engine_ms"] + timings.get("pending_ms", 0) + timings["total_ms"] + ch["to_api_ms"] <= http_ms, \
        (ch, timings["total_ms"], http_ms)


def test_level1_cycle_refuses_then_serves_the_same_output(server, client, reference):
    rss_awake = rss_bytes(server)
    t0 = time.perf_counter()
    r = admin(server, "POST", "/sleep?level=1")
    elapsed = (time.perf_counter() - t0) * 1e3
    assert r.status_code == 200, r.text
    assert r.json()["bytes_offloaded"] > 100e6 and r.json()["state"]["is_sleeping"] is True
    # Where the sleep's time went: the engine's steps, then the CPU backend's (backup files written,
    # pages released).
    assert_timed(r.json()["timings"], {"abort", "prefix_cache", "pool", "publish"},
                 {"wait_prepare", "stop_kv_mapper", "check", "write_backups", "release", "state"})
    assert r.json()["timings"]["pending_ms"] >= 0
    assert_channel(r.json()["timings"], elapsed)
    s = state(server)
    assert s["is_sleeping"] and s["level"] == 1 and set(s["sleeping_tags"]) == {"weights", "kv_cache"}
    assert s["tag_states"]["weights"] == "offloaded" and s["tag_states"]["kv_cache"] == "discarded"
    if rss_awake is not None:  # the pages really went back to the OS
        assert rss_bytes(server) < rss_awake - 300e6, (rss_awake, rss_bytes(server))
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "sleeping"
    assert server.metric("sleepserve_engine_state", '{state="sleeping"}') == 1
    assert server.metric("sleepserve_tag_asleep", '{tag="weights"}') == 1
    assert_refused(client, "sleeping", "wake it with POST /wake_up")

    t0 = time.perf_counter()
    r = admin(server, "POST", "/wake_up")
    elapsed = (time.perf_counter() - t0) * 1e3
    assert r.status_code == 200, r.text
    assert set(r.json()["woke"]) == {"weights", "kv_cache"} and r.json()["bytes_restored"] > 100e6
    assert_channel(r.json()["timings"], elapsed)
    assert_timed(r.json()["timings"], {"pool", "publish"}, {"check", "read_backups", "map", "start_kv_mapper"})
    assert not state(server)["is_sleeping"]
    first = generate(client)
    assert first["choices"][0]["text"] == reference
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the KV went: so did its index
    again = generate(client)
    assert again["choices"][0]["text"] == reference
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # a prefix hit, and it is correct


def test_level2_needs_update_weights_then_serves_the_same_output(server, client, reference):
    assert admin(server, "POST", "/sleep", params={"level": 2}).status_code == 200
    assert state(server)["weights_valid"] is False
    assert admin(server, "POST", "/wake_up").status_code == 200
    s = state(server)
    assert not s["is_sleeping"] and s["weights_valid"] is False
    assert httpx.get(server.url + "/health").json()["status"] == "weights_invalid"
    assert_refused(client, "weights_invalid", "discarded by sleep level 2")

    r = admin(server, "POST", "/update_weights", json={"weight_version": "reloaded"})
    assert r.status_code == 200, r.text
    assert r.json()["weights_valid"] is True and r.json()["weight_version"] == "reloaded"
    assert state(server)["weight_version"] == "reloaded"
    assert greedy(client) == reference


def test_rlhf_order_with_tags(server, client, reference):
    assert admin(server, "POST", "/sleep?level=2").status_code == 200
    r = admin(server, "POST", "/wake_up?tags=weights")
    assert r.status_code == 200 and r.json()["woke"] == ["weights"]
    assert state(server)["sleeping_tags"] == ["kv_cache"]
    assert_refused(client, "sleeping", "kv_cache")
    assert admin(server, "POST", "/update_weights").status_code == 200  # no body: reload the served checkpoint
    assert admin(server, "POST", "/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert greedy(client) == reference


def test_pause_and_resume(server, client, reference):
    r = admin(server, "POST", "/pause")
    assert r.status_code == 200 and r.json()["level"] == 0
    assert state(server)["paused"] and httpx.get(server.url + "/health").json()["status"] == "paused"
    assert_refused(client, "paused", "POST /resume")
    assert admin(server, "POST", "/resume").status_code == 200
    assert greedy(client) == reference


def test_memory(server):
    mem = admin(server, "GET", "/memory").json()
    assert mem["tags"]["weights"]["bytes"] > 100e6 and mem["tags"]["weights"]["state"] == "awake"
    assert mem["device_total"] > 0 and 0 <= mem["device_free"] <= mem["device_total"]


def prefix_hits(server) -> float:
    return server.metric("vllm:prefix_cache_hits_total", '{engine="0",model_name="SmolLM2-135M-Instruct"}')


def test_reset_prefix_cache_forgets_every_prefix(server, client, reference):
    generate(client)  # PROMPT's blocks are in the cache now
    hits = prefix_hits(server)
    cached = generate(client)
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert prefix_hits(server) >= hits + 16
    r = admin(server, "POST", "/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"reset": True}
    hits = prefix_hits(server)
    fresh = generate(client)
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing was found...
    assert prefix_hits(server) == hits  # ...by the engine either
    assert fresh["choices"][0]["text"] == reference
    # A pause resets it too unless told not to (clear_cache, default true as in vLLM).
    for clear, expect_hit in (("false", True), ("true", False)):
        assert admin(server, "POST", f"/pause?clear_cache={clear}").status_code == 200
        assert admin(server, "POST", "/resume").status_code == 200
        again = generate(client)
        assert (again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16) is expect_hit, (clear, again)


def test_repeats_are_idempotent_and_only_impossible_requests_conflict(server, client, reference):
    def call(path: str, status: int = 200, changed: bool | None = None) -> dict:
        r = admin(server, "POST", path)
        assert r.status_code == status, (path, r.text)
        body = r.json()
        if changed is not None:
            assert body["changed"] is changed, (path, body)
        return body

    for path in ("/wake_up", "/wake_up?tags=weights", "/wake_up?tags=kv_cache,weights", "/resume"):
        assert call(path, changed=False)["state"]["is_sleeping"] is False
    call("/sleep?level=1", changed=True)
    before = state(server)
    for path in ("/sleep?level=1", "/sleep?level=1&tags=kv_cache", "/sleep?level=1&tags=weights&tags=kv_cache",
                 "/sleep?level=2&tags=kv_cache"):
        body = call(path, changed=False)
        assert body["bytes_offloaded"] == body["bytes_discarded"] == 0 and body["aborted"] == 0
    assert state(server) == before
    err = call("/sleep?level=2", status=409)["error"]
    assert err["code"] == "conflict" and "weights is offloaded, level 2 would have it discarded" in err["message"]
    call("/wake_up?tags=kv_cache", changed=True)
    call("/wake_up?tags=kv_cache", changed=False)
    call("/wake_up", changed=True)
    call("/wake_up", changed=False)

    call("/sleep?level=2", changed=True)
    call("/sleep?level=2", changed=False)
    assert "level 1 would have it offloaded" in call("/sleep?level=1", status=409)["error"]["message"]
    call("/wake_up?tags=weights", changed=True)
    call("/wake_up?tags=weights", changed=False)
    assert admin(server, "POST", "/update_weights").status_code == 200
    call("/wake_up?tags=kv_cache", changed=True)

    assert call("/pause", changed=True)["status"] == "paused"
    assert admin(server, "GET", "/is_paused").json() == {"is_paused": True}
    assert call("/pause?mode=wait", changed=False)["state"]["paused"] is True
    assert call("/resume", changed=True)["status"] == "resumed"
    call("/resume", changed=False)
    assert admin(server, "GET", "/is_paused").json() == {"is_paused": False}
    assert greedy(client) == reference


def test_sleep_metrics(server):
    def count(name: str, labels: str = "") -> float:
        try:
            return server.metric(name, labels)
        except AssertionError:
            return 0.0

    sleeps = count("sleepserve_sleep_seconds_count", '{level="1"}')
    wakes = count("sleepserve_wake_seconds_count", '{level="1"}')
    offloaded = count("sleepserve_sleep_offloaded_bytes_total")
    restored = count("sleepserve_wake_restored_bytes_total")
    assert admin(server, "POST", "/sleep?level=1").status_code == 200
    assert admin(server, "POST", "/wake_up").status_code == 200
    assert count("sleepserve_sleep_seconds_count", '{level="1"}') == sleeps + 1
    assert count("sleepserve_wake_seconds_count", '{level="1"}') == wakes + 1
    assert count("sleepserve_sleep_offloaded_bytes_total") > offloaded + 100e6
    assert count("sleepserve_wake_restored_bytes_total") > restored + 100e6
    assert count("sleepserve_pool_bytes", '{state="awake",tag="weights"}') > 100e6


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method,path,body,status,words", [
    ("POST", "/sleep?level=3", None, 400, "level must be 0, 1 or 2"),
    ("POST", "/sleep?level=one", None, 400, "level: Input should be a valid integer"),
    ("POST", "/sleep?tags=gpu", None, 400, "unknown tag 'gpu'"),
    ("POST", "/sleep?tags=cuda_graph", None, 400, "'cuda_graph' is internal"),
    ("POST", "/pause?mode=later", None, 400, "mode must be one of abort, wait, keep"),
    ("POST", "/pause?clear_cache=maybe", None, 400, "clear_cache: Input should be a valid boolean"),
    ("POST", "/sleep?mode=later", None, 400, "mode must be one of abort, wait, keep"),
    ("POST", "/wake_up?tags=gpu", None, 400, "unknown tag"),
    ("POST", "/update_weights", {"path": "/no/such/checkpoint"}, 400, "does not exist"),
    ("POST", "/update_weights", b"{oops", 400, "not valid JSON"),
    ("POST", "/update_weights", {"path": 5}, 400, "path: Input should be a valid string"),
    ("GET", "/sleep", None, 405, "not allowed"),
])
def test_bad_dev_input_is_4xx_and_server_keeps_serving(server, client, reference, method, path, body, status,
                                                       words):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    r = admin(server, method, path, **kwargs)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"], r.json()
    assert greedy(client) == reference


def test_update_weights_rejects_a_mismatched_checkpoint(server, client, reference, tmp_path):
    from safetensors.torch import save_file
    import torch

    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    r = admin(server, "POST", "/update_weights", json={"path": str(tmp_path)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "weight_load_error"
    assert greedy(client) == reference  # nothing was touched


# -- in-flight requests --------------------------------------------------------------------------


class Progress:
    """What a stream has received so far, readable by the action that runs beside it."""

    def __init__(self) -> None:
        self.text, self.finish, self.done, self.chunks = "", None, False, 0


async def _stream(server, max_tokens: int, after: int, action) -> tuple[Progress, object]:
    """Stream PROMPT; after `after` chunks start `action(progress)` beside it. Returns (progress, its result)."""
    progress, task = Progress(), None
    async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=server.headers()) as client:
        async with client.stream("POST", "/v1/completions", json={
                "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    progress.done = True
                    continue
                choice = json.loads(line[len("data: "):])["choices"][0]
                progress.text += choice["text"]
                progress.finish = choice["finish_reason"] or progress.finish
                progress.chunks += 1
                if progress.chunks == after:
                    task = asyncio.create_task(action(progress))
    return progress, (await task) if task else None


async def _admin(server, method: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                 headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        return await c.request(method, path)


def test_mode_abort_ends_streams_with_abort(server):
    async def sleep(progress: Progress) -> httpx.Response:
        return await _admin(server, "POST", "/sleep?level=1")

    progress, r = asyncio.run(_stream(server, 400, 3, sleep))
    assert r.status_code == 200 and r.json()["aborted"] == 1
    assert progress.finish == "abort" and progress.done and progress.chunks < 100


def test_mode_keep_resumes_streams_after_wake(server, client):
    expected = greedy(client, max_tokens=24)

    async def sleep_then_wake(progress: Progress) -> dict:
        slept = await _admin(server, "POST", "/sleep?level=1&mode=keep")
        asleep_at = progress.chunks
        unfinished = progress.finish is None  # the sleep did not wait for the request
        await asyncio.sleep(0.5)  # not synchronization: a window in which nothing may arrive
        frozen = progress.chunks == asleep_at
        woke = await _admin(server, "POST", "/wake_up")
        return {"codes": [slept.status_code, woke.status_code], "aborted": slept.json()["aborted"],
                "unfinished": unfinished, "frozen": frozen}

    progress, out = asyncio.run(_stream(server, 24, 3, sleep_then_wake))
    assert out["codes"] == [200, 200] and out["aborted"] == 0
    assert out["unfinished"] and out["frozen"], out
    # After wake the request recomputed its KV and went on: the same text as an undisturbed run.
    assert progress.text == expected and progress.finish == "length" and progress.done


def test_mode_wait_drains_before_sleeping(server, client):
    # Long enough that the drain is still on while the requests below arrive: 40 tokens once took ~3 s on the
    # CPU, and ended before the checks when the suite ran faster (2026-12-04); 120 keep a margin either way.
    expected = greedy(client, max_tokens=120)

    async def sleep_wait(progress: Progress) -> dict:
        task = asyncio.create_task(_admin(server, "POST", "/sleep?level=1&mode=wait"))
        await asyncio.to_thread(wait_for, lambda: state(server)["draining"], 10, 0.02, "the drain to start")
        # While draining: a second sleep is a conflict, and new requests are refused.
        async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=server.headers()) as c:
            second, refused = await asyncio.gather(
                _admin(server, "POST", "/sleep?level=1"),
                c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}))
        still_streaming = progress.finish is None
        slept = await task
        return {"refused": refused, "second": second, "slept": slept, "still_streaming": still_streaming,
                "finished_first": progress.finish}

    progress, out = asyncio.run(_stream(server, 120, 2, sleep_wait))
    assert progress.text == expected and progress.finish == "length" and progress.done  # finished untouched
    assert out["still_streaming"], "the stream ended before the checks: the drain window was too short"
    assert out["finished_first"] == "length"  # the sleep answered only after the request was done
    assert out["refused"].status_code == 503 and out["refused"].json()["error"]["code"] == "draining"
    assert out["second"].status_code == 409 and "already in progress" in out["second"].json()["error"]["message"]
    assert out["slept"].status_code == 200 and out["slept"].json()["aborted"] == 0
    # The drain is in the sleep's pending time, not in its phases (which start when it is applied).
    timings = out["slept"].json()["timings"]
    assert timings["pending_ms"] > 0 and "abort" in timings["phases_ms"]
    assert state(server)["is_sleeping"]


def test_rlhf_update_with_new_weights_serves_what_a_fresh_load_serves(server, client, reference, tmp_path,
                                                                      default_model_folder):
    """sleep level 2 -> wake weights -> update_weights(perturbed checkpoint) -> wake kv_cache: the server
    answers with the new weights, exactly as an engine that loaded them fresh does."""
    from server import LLM, SamplingParams

    new = write_trained_checkpoint(default_model_folder, tmp_path / "step-1", seed=0)

    assert admin(server, "POST", "/sleep?level=2").status_code == 200
    assert admin(server, "POST", "/wake_up?tags=weights").status_code == 200
    r = admin(server, "POST", "/update_weights", json={"path": str(new), "weight_version": "step-1"})
    assert r.status_code == 200 and r.json()["weights_valid"], r.text
    assert admin(server, "POST", "/wake_up?tags=kv_cache").status_code == 200
    served = greedy(client, max_tokens=16)

    fresh = LLM(model=str(new), device="cpu", kv_cache_memory="64MiB")
    try:
        expected = fresh.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    finally:
        fresh.close()
    assert served == expected.outputs[0].text
    assert served != greedy_reference_16(client, server)


def greedy_reference_16(client, server) -> str:
    """The original weights' answer, restoring them on the server (the other tests expect them)."""
    restored = admin(server, "POST", "/update_weights", json={})
    assert restored.status_code == 200, restored.text
    return greedy(client, max_tokens=16)


def test_zz_clean_shutdown_on_ctrl_c(server):
    """Last in this module (the dev server is not used after it): SIGINT drains and exits cleanly."""
    server.stop()
    assert server.proc.returncode == 130, server.log_tail()  # the usual exit code after Ctrl-C
    log = server.log_text()
    assert "Application shutdown complete" in log and "Traceback" not in log, server.log_tail()

