"""--api-server-count 2 through the real server: two API processes share one port (the kernel spreads new
connections over them) and one engine process. Each answers every route with the engine's tokens; a sleep
made through one holds the other's requests; /metrics sums both; SIGTERM stops both gracefully; one that
dies takes the server down (exit code 3) instead of leaving half of the connections unanswered."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from testkit.http_server import BASE_ARGS, ServerProcess, engine_child, wait_for

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4, 5,"]
TOKENS = 12


@pytest.fixture(scope="module")
def server():
    # A 30-s grace for the SIGTERM test: six 40-token streams on the loaded 2-core CI host outran 10 s (twice).
    server = ServerProcess([*BASE_ARGS, "--dev-mode", "--api-server-count", "2", "--shutdown-grace-period", "30"]).start()
    yield server
    server.stop()


def fresh(server: ServerProcess, method: str, path: str, **kwargs) -> httpx.Response:
    """One request on a connection of its own: the kernel picks the API process for each new connection."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        return c.request(method, path, **kwargs)


def api_pids(server: ServerProcess, connections: int = 24) -> set[int]:
    return {fresh(server, "GET", "/server_info").json()["processes"]["api_pid"] for _ in range(connections)}


def completion(server: ServerProcess, prompt: str, stream: bool, tokens: int = TOKENS,
               started: threading.Semaphore | None = None) -> str:
    """started: released once a stream's 200 arrived (the server took the request)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        if not stream:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = ""
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            if started is not None:
                started.release()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text


def burst(server: ServerProcess, jobs: list[tuple[str, bool]]) -> list[str]:
    """Every (prompt, stream) at once, each on its own connection."""
    out: list[str | None] = [None] * len(jobs)

    def run(i: int) -> None:
        out[i] = completion(server, *jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(o is not None for o in out), "a request of the burst did not finish"
    return out  # type: ignore[return-value]


def test_both_api_processes_answer_and_share_one_engine(server):
    infos = [fresh(server, "GET", "/server_info").json()["processes"] for _ in range(32)]
    pids = {i["api_pid"] for i in infos}
    assert len(pids) == 2 and server.proc.pid in pids, infos  # each misses 32 connections with p = 2^-32
    assert set(server.api_pids) == pids  # the second is the first's child running server.api.replica
    assert {i["engine_pid"] for i in infos} == {server.engine_pid}
    assert {i["api_server_count"] for i in infos} == {2}
    assert f"API processes: 2 (pids {server.proc.pid}, " in server.log_text()


def test_a_burst_through_both_gives_the_in_process_tokens(server, llm):
    from server import SamplingParams

    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    jobs = [(p, stream) for stream in (False, True) for p in PROMPTS] * 2
    got = burst(server, jobs)
    assert got == [expected[PROMPTS.index(p)] for p, _ in jobs]


def metric(server: ServerProcess, name: str) -> float:
    """The sum of a family's samples named `name` (every label), from one scrape of whichever process."""
    text = fresh(server, "GET", "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {")


def test_metrics_count_every_process_requests(server):
    def finished() -> float:
        return metric(server, "sleepserve_requests_finished_total")

    def tokens() -> float:
        return metric(server, "sleepserve_generation_tokens_total")

    def steps() -> float:  # counted by the first API process only (the engine sends it the steps)
        return metric(server, "vllm:iteration_tokens_total_count")

    before_requests, before_tokens, before_steps = finished(), tokens(), steps()
    assert len(api_pids(server)) == 2  # the requests below land on both
    burst(server, [(p, False) for p in PROMPTS * 4])
    # Whichever process answers a scrape, it reads both processes' counts.
    assert {finished() - before_requests for _ in range(8)} == {16}
    assert {tokens() - before_tokens for _ in range(8)} == {16 * TOKENS}
    # Every scrape counts the steps once: at least the 12 the longest request took, at most one per token.
    ran = {steps() - before_steps for _ in range(8)}
    assert len(ran) == 1 and TOKENS <= ran.pop() <= 16 * TOKENS, ran


def test_a_sleep_through_one_process_holds_the_other_requests(server):
    before = completion(server, PROMPTS[0], False)
    r = fresh(server, "POST", "/sleep", params={"level": 1})
    assert r.status_code == 200, r.text
    assert {fresh(server, "GET", "/is_sleeping").json()["is_sleeping"] for _ in range(12)} == {True}
    held: list[str] = []
    threads = [threading.Thread(target=lambda s=s: held.append(completion(server, PROMPTS[0], s)))
               for s in (False, True) * 3]
    for t in threads:
        t.start()
    wait_for(lambda: sum(fresh(server, "GET", "/load").json()["held"] for _ in range(8)) > 0, 30,
             what="requests to be held")
    assert not held, "a request ran while the engine slept"
    assert fresh(server, "POST", "/wake_up").status_code == 200
    for t in threads:
        t.join(120)
    assert held == [before] * 6
    # The sleep's and the wake's histograms count the process that made the call, once, in every scrape.
    assert {metric(server, "sleepserve_sleep_seconds_count") for _ in range(6)} == {1}
    assert {metric(server, "sleepserve_wake_seconds_count") for _ in range(6)} == {1}


def test_sigterm_stops_every_process_after_their_requests(server):
    engine = server.engine_pid
    others = api_pids(server) - {server.proc.pid}
    texts: list[str] = []
    started = threading.Semaphore(0)
    jobs = [threading.Thread(target=lambda: texts.append(completion(server, PROMPTS[1], True, 40, started)))
            for _ in range(6)]
    for t in jobs:
        t.start()
    # Every stream taken before the signal (a loaded host once sent it with one still connecting: refused).
    for _ in jobs:
        assert started.acquire(timeout=60), "a stream did not start"
    server.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    for t in jobs:
        t.join(120)
    assert len(texts) == 6 and len(set(texts)) == 1 and texts[0], texts  # each finished, none cut short
    assert server.proc.wait(60) == 0, server.log_tail()
    # Within the grace period (30 s) and a little: the others got the signal too, none had to be killed.
    assert time.monotonic() - sent < 45, server.log_tail()
    for pid in [engine, *others]:
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 30, what=f"pid {pid} to exit")
    log = server.log_text()
    assert "Traceback" not in log and "killing it" not in log, server.log_tail()


def test_a_dead_api_process_ends_the_server_with_code_3():
    server = ServerProcess([*BASE_ARGS, "--dev-mode", "--api-server-count", "2"]).start()
    try:
        engine = server.engine_pid
        (other,) = api_pids(server) - {server.proc.pid}
        os.kill(other, signal.SIGKILL)
        assert server.proc.wait(60) == 3, server.log_tail()
        assert f"API process 1 (pid {other}) exited with code -9" in server.log_text(), server.log_tail()
        assert engine_child(server.proc.pid) is None
        wait_for(lambda: not os.path.exists(f"/proc/{engine}"), 30, what="the engine process to exit")
    finally:
        server.stop()


def test_an_api_process_abort_all_ends_only_its_own_requests():
    """The engine with two channels, without HTTP: each EngineClient gets only its own requests' outputs, and
    abort_all (an API process's shutdown after its grace period) ends only the requests it added."""
    import asyncio

    from server import SamplingParams
    from server.config import EngineConfig
    from server.api.engine_client import EngineClient

    first = EngineClient.launch(EngineConfig(device="cpu", max_model_len=512, kv_cache_memory="128MiB"), channels=2)
    second = EngineClient.connect(first.spare_channels.pop())
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)

    async def run(client: EngineClient, request_id: str) -> tuple[str, int]:
        last = None
        async for out in client.generate(request_id, PROMPTS[0], None, params):
            last = out
        assert last is not None and last.request_id == request_id
        return last.outputs[0].finish_reason, len(last.outputs[0].token_ids)

    async def main() -> None:
        await first.attach()
        await second.attach()
        try:
            mine = [asyncio.ensure_future(run(first, f"first-{i}")) for i in range(2)]
            theirs = [asyncio.ensure_future(run(second, f"second-{i}")) for i in range(2)]
            while first.stats.running < 4:  # every request runs
                await asyncio.sleep(0.05)
            assert await second.abort_all() == 2
            assert [f for f, _ in await asyncio.gather(*theirs)] == ["abort", "abort"]
            assert not any(t.done() for t in mine), "the other process's requests ended too"
            assert await asyncio.gather(*mine) == [("length", 120)] * 2
        finally:
            await second.shutdown()  # only closes its channel
            await first.shutdown()   # stops the engine

    asyncio.run(main())


def test_the_listening_sockets_share_a_port_with_each_other_only():
    from server.api.servers import listening_sockets

    ours = listening_sockets("127.0.0.1", 0, 3)
    try:
        port = ours[0].getsockname()[1]
        assert {s.getsockname()[1] for s in ours} == {port} and port != 0
        with pytest.raises(OSError):  # another server with several API processes would share it silently
            listening_sockets("127.0.0.1", port, 2)
    finally:
        for s in ours:
            s.close()
