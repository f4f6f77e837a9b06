"""Requests that arrive while paused or asleep are held and served after resume/wake (the default,
--while-asleep hold), bounded in number and time; vLLM's discovery routes and Prometheus families;
the async-RL flow pause(keep) -> update_weights -> resume. All through the real server."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from testkit.models import write_trained_checkpoint
from testkit.http_server import HOLD_LIMIT, HOLD_TIMEOUT_S, hold_server, wait_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(300)

PROMPT = "The history of the city of Paris, the capital of France, begins with a small settlement on an island"
BODY = {"model": "smol", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
LABELS = {"model_name": "smol", "engine": "0"}


@pytest.fixture(scope="module")
def server():
    return hold_server()


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, timeout=120, **kwargs)


def get(server, path: str) -> dict:
    r = httpx.get(server.url + path, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(autouse=True)
def leave_serving(server):
    yield
    s = get(server, "/is_sleeping")
    if s["is_sleeping"]:
        r = post(server, "/wake_up")
        assert r.status_code == 200, r.text
    if not get(server, "/is_sleeping")["weights_valid"]:
        r = post(server, "/update_weights")
        assert r.status_code == 200, r.text
    wait_for(lambda: get(server, "/load")["server_load"] == 0, 30, what="every request to end")


@pytest.fixture(scope="module")
def reference(server) -> str:
    r = post(server, "/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def held(server) -> dict[str, int]:
    return get(server, "/load")["held_by_reason"]


async def _complete(server, body: dict = BODY, timeout: float = 120) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.url, timeout=timeout) as c:
        return await c.post("/v1/completions", json=body)


async def _wait_held(server, reason: str, n: int = 1) -> None:
    await asyncio.to_thread(wait_for, lambda: held(server).get(reason, 0) == n, 30, 0.05, f"{n} held ({reason})")


def test_a_request_sent_while_paused_completes_after_resume(server, reference):
    async def flow() -> tuple[httpx.Response, bool, dict]:
        assert post(server, "/pause").status_code == 200
        task = asyncio.create_task(_complete(server))
        await _wait_held(server, "paused")
        load = get(server, "/load")
        await asyncio.sleep(0.3)  # not synchronization: a window in which it must not complete
        done_while_paused = task.done()
        assert post(server, "/resume").status_code == 200
        return await task, done_while_paused, load

    r, done_while_paused, load = asyncio.run(flow())
    assert not done_while_paused
    assert load["server_load"] == 1 and load["held"] == 1 and load["running"] == load["waiting"] == 0, load
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference
    assert held(server) == {}


def test_a_request_held_at_level_2_runs_only_on_valid_weights(server, reference):
    async def flow() -> tuple[httpx.Response, list]:
        assert post(server, "/sleep?level=2").status_code == 200
        task = asyncio.create_task(_complete(server, {**BODY, "stream": False}))
        seen = []
        await _wait_held(server, "sleeping")
        for step in ("/wake_up?tags=weights", "/update_weights", "/wake_up?tags=kv_cache"):
            await asyncio.sleep(0.3)  # a window in which it must not complete
            seen.append((step, task.done(), dict(held(server))))
            r = post(server, step, json={} if step == "/update_weights" else None)
            assert r.status_code == 200, r.text
        return await task, seen

    r, seen = asyncio.run(flow())
    assert [done for _, done, _ in seen] == [False, False, False], (seen, r.text)
    assert seen[0][2] == {"sleeping": 1} and seen[1][2] == {"sleeping": 1}, seen  # kv_cache still asleep
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference


def test_weights_invalid_answers_at_once_unless_paused(server, reference):
    """Awake after a level-2 sleep without new weights, only an update can make a request servable: it gets 503
    weights_invalid at once (holding it would only run it into the hold timeout). Paused, it is held as any
    request is, and runs after the update and the resume."""
    async def flow() -> tuple[httpx.Response, float, httpx.Response, bool]:
        assert post(server, "/sleep?level=2").status_code == 200
        assert post(server, "/wake_up").status_code == 200
        t = time.monotonic()
        refused = await _complete(server)
        refused_s = time.monotonic() - t
        assert post(server, "/pause").status_code == 200
        task = asyncio.create_task(_complete(server))
        await _wait_held(server, "weights_invalid")
        assert post(server, "/update_weights").status_code == 200
        await asyncio.sleep(0.3)  # a window in which it must not complete: still paused
        early = task.done()
        assert post(server, "/resume").status_code == 200
        return refused, refused_s, await task, early

    refused, refused_s, r, early = asyncio.run(flow())
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "weights_invalid", refused.text
    assert refused_s < 5
    assert not early and r.status_code == 200 and r.json()["choices"][0]["text"] == reference


def test_held_requests_beyond_the_limits_get_503(server, reference):
    async def flow() -> tuple[list[httpx.Response], httpx.Response, float]:
        assert post(server, "/pause").status_code == 200
        tasks = [asyncio.create_task(_complete(server)) for _ in range(HOLD_LIMIT)]
        await _wait_held(server, "paused", HOLD_LIMIT)
        t = time.monotonic()
        over = await _complete(server)
        over_s = time.monotonic() - t
        assert post(server, "/resume").status_code == 200
        return list(await asyncio.gather(*tasks)), over, over_s

    served, over, over_s = asyncio.run(flow())
    assert over.status_code == 503 and int(over.headers["Retry-After"]) > 0, over.text
    err = over.json()["error"]
    assert err["code"] == "paused" and "--max-held-requests" in err["message"], err
    assert over_s < 5, "past the queue limit the answer is immediate"
    assert [r.status_code for r in served] == [200] * HOLD_LIMIT
    assert all(r.json()["choices"][0]["text"] == reference for r in served)

    # Past the wait limit: 503 naming the flag, and the request never ran.
    assert post(server, "/sleep?level=1").status_code == 200
    t = time.monotonic()
    r = post(server, "/v1/completions", json=BODY)
    waited = time.monotonic() - t
    assert r.status_code == 503 and r.headers["Retry-After"], r.text
    assert r.json()["error"]["code"] == "sleeping" and "--held-request-timeout" in r.json()["error"]["message"]
    assert waited >= HOLD_TIMEOUT_S * 0.9
    assert held(server) == {}


def metric(server, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of /metrics, parsed with prometheus-client's own parser."""
    want = {**LABELS, **(labels or {})}
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in want.items()):
                return sample.value
    raise AssertionError(f"{name}{want} is not in /metrics")


def test_a_disconnected_held_client_is_dropped_and_never_reaches_the_engine(server):
    queries = metric(server, "vllm:prefix_cache_queries_total")
    assert post(server, "/pause").status_code == 200
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(server.url + "/v1/completions", json={**BODY, "prompt": "A held request nobody waits for"},
                   timeout=httpx.Timeout(30, read=1.0))
    wait_for(lambda: get(server, "/load")["server_load"] == 0, 15, what="the held request to be dropped")
    assert held(server) == {}
    assert post(server, "/resume").status_code == 200
    time.sleep(0.5)  # not synchronization: a window in which a leaked request would be admitted
    load = get(server, "/load")
    assert load["running"] == load["waiting"] == 0, load
    assert metric(server, "vllm:prefix_cache_queries_total") == queries  # the scheduler never saw it


def test_discovery_routes(server):
    info = get(server, "/server_info")
    assert info["weight_transfer_config"] is None and info["world_size"] == 1
    assert info["engine_config"]["while_asleep"] == "hold"
    assert info["engine_config"]["max_held_requests"] == HOLD_LIMIT
    assert info["engine_config"]["held_request_timeout"] == HOLD_TIMEOUT_S
    assert info["engine_config"]["device"] == "cpu" and info["model"]["served_model_name"] == "smol"
    assert info["kv_cache"]["block_size"] == 16 and info["server"]["api_key_set"] is False
    assert get(server, "/get_world_size") == {"world_size": 1}
    load = get(server, "/load")
    assert set(load) == {"server_load", "running", "waiting", "held", "held_by_reason"}
    assert get(server, "/is_paused") == {"is_paused": False}


def test_vllm_prometheus_families(server):
    names = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count",
             "vllm:request_params_n_count", "vllm:request_params_max_tokens_sum",
             "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_sum",
             "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
             "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
             "vllm:request_decode_time_seconds_count", "vllm:iteration_tokens_total_count",
             "vllm:iteration_tokens_total_sum", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]
    before = {n: metric(server, n) for n in names}
    usage = []
    for max_tokens in (3, 5):
        r = post(server, "/v1/completions", json={**BODY, "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        usage.append(r.json()["usage"])
    after = {n: metric(server, n) for n in names}
    delta = {n: after[n] - before[n] for n in names}
    prompt = sum(u["prompt_tokens"] for u in usage)
    assert delta["vllm:prompt_tokens_total"] == prompt == delta["vllm:request_prompt_tokens_sum"]
    assert delta["vllm:generation_tokens_total"] == 8 == delta["vllm:request_generation_tokens_sum"]
    assert delta["vllm:request_params_max_tokens_sum"] == 8
    for n in ("vllm:e2e_request_latency_seconds_count", "vllm:request_params_n_count",
              "vllm:time_to_first_token_seconds_count", "vllm:request_queue_time_seconds_count",
              "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count"):
        assert delta[n] == 2, (n, delta[n])
    assert delta["vllm:inter_token_latency_seconds_count"] == 8 - 2  # every token after each first
    # As vLLM counts: each request's whole prompt (prefix-cache hits included) at its first token, plus every
    # token sampled, over at least 1 + max_tokens - 1 steps per request.
    assert delta["vllm:iteration_tokens_total_sum"] == prompt + 8
    assert delta["vllm:iteration_tokens_total_count"] >= 8
    assert delta["vllm:prefix_cache_queries_total"] >= prompt - 2  # (the last prompt token is always computed)
    assert delta["vllm:prefix_cache_hits_total"] >= 16  # the second request found the first's prompt blocks
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert metric(server, gauge) == 0.0
    assert metric(server, "vllm:num_preemptions_total") == 0.0
    assert metric(server, "vllm:cache_config_info", {"block_size": "16", "enable_prefix_caching": "True"}) == 1.0

    def sleep_state() -> dict[str, float]:
        return {s: metric(server, "vllm:engine_sleep_state", {"sleep_state": s})
                for s in ("awake", "weights_offloaded", "discard_all")}

    assert sleep_state() == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    assert post(server, "/sleep?level=1").status_code == 200
    assert sleep_state() == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
    assert post(server, "/wake_up").status_code == 200
    assert post(server, "/sleep?level=2").status_code == 200
    assert sleep_state() == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}
    assert post(server, "/wake_up").status_code == 200
    assert sleep_state()["discard_all"] == 1  # awake but the weights are not loaded yet
    assert post(server, "/update_weights").status_code == 200
    assert sleep_state() == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}


def test_async_rl_pause_keep_update_resume(server, tmp_path, default_model_folder, llm):
    """pause(mode=keep) with a stream in flight -> update_weights(new checkpoint) -> resume: the stream
    goes on, on the new weights: its tokens after the pause are what the new weights give, fresh, for
    the prompt plus the tokens before the pause (its KV was recomputed, none of the old KV was reused)."""
    import json

    from server import SamplingParams

    new = write_trained_checkpoint(default_model_folder, tmp_path / "step-1", seed=1)

    total = 24
    greedy = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)
    old_ids = llm.generate(PROMPT, greedy)[0].outputs[0].token_ids  # what the served weights give

    async def flow() -> tuple[list[str], str | None, int, list[int]]:
        texts: list[str] = []
        finish = None
        codes: list[int] = []
        before_pause = -1
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            async with c.stream("POST", "/v1/completions", json={**BODY, "max_tokens": total, "stream": True,
                                                                  "logprobs": 0}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    texts.extend(choice["logprobs"]["tokens"])
                    finish = choice["finish_reason"] or finish
                    if len(texts) >= 3 and before_pause < 0:
                        codes.append((await c.post("/pause?mode=keep")).status_code)
                        await asyncio.sleep(0.5)  # tokens already on their way arrive meanwhile
                        before_pause = len(texts)
                        upd = await c.post("/update_weights", json={"path": str(new), "weight_version": "step-1"})
                        assert upd.status_code == 200, upd.text
                        codes.append(upd.status_code)
                        codes.append((await c.post("/resume")).status_code)
        return texts, finish, before_pause, codes

    texts, finish, k, codes = asyncio.run(flow())
    try:
        assert codes == [200, 200, 200] and finish == "length" and len(texts) == total
        assert texts[:k] == [llm.tokenizer.decode([t]) for t in old_ids[:k]]  # the old weights' tokens
        # The same prompt and first k tokens, sent fresh to the server that now has the new weights.
        r = post(server, "/v1/completions", json={**BODY, "prompt": llm.engine.encode(PROMPT) + old_ids[:k],
                                                  "max_tokens": total - k, "logprobs": 0})
        assert r.status_code == 200, r.text
        fresh = r.json()["choices"][0]["logprobs"]["tokens"]
        assert texts[k:] == fresh, (k, texts, fresh)
        assert fresh != [llm.tokenizer.decode([t]) for t in old_ids[k:]], "the new weights should change the text"
    finally:
        r = post(server, "/update_weights", json={"weight_version": "initial"})  # the served checkpoint again
        assert r.status_code == 200, r.text
