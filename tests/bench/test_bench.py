"""The serving benchmarks' measuring code against the real server and the in-process engine, at tiny
sizes: every request completes with the tokens asked for, and the metrics and the roofline are
computed from what ran. No timing is asserted (the benchmarks print ratios; the GPU run reads them)."""
from __future__ import annotations

import asyncio
from argparse import Namespace
import math
import sys
from pathlib import Path

import pytest
from testkit.http_server import MAIN_KEY, main_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import server_steps  # noqa: E402
from bench.roofline import Device, ModelCost, StepRecorder, StepShape  # noqa: E402
from bench.rollout import engine_rollout, http_rollout, make_prompts  # noqa: E402
from bench.serve import (IN_PROCESS, Fresh, Result, median_run, run_clients, run_engine, run_http, run_pass,  # noqa: E402
                         summarize, workload)
from bench.spy import summarize as summarize_spy  # noqa: E402
from bench.sse_floor import run as sse_floor  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_workload_lengths_and_poisson_arrivals():
    reqs = workload(200, 20, 10, 0.5, 50.0, 49152, seed=1)
    assert all(10 <= len(r.prompt) <= 30 and 5 <= r.max_tokens <= 15 for r in reqs)
    gaps = [b.at - a.at for a, b in zip(reqs, reqs[1:])]
    assert reqs[0].at == 0 and all(g >= 0 for g in gaps)
    assert 0.01 < sum(gaps) / len(gaps) < 0.04  # mean gap 1/rate = 0.02 s
    assert all(r.at == 0 for r in workload(5, 8, 4, 0.0, math.inf, 1000, seed=1))


def test_repeated_pass_keeps_the_median_run_and_every_failure():
    """--repeat: the run with the median tok/s is the pass's row; no failure of another run is dropped."""
    runs = iter([(8, 1.0, None), (8, 4.0, "HTTP 500"), (8, 2.0, None)])  # tokens each, seconds, an error

    def run(reqs, stream):
        tokens, seconds, error = next(runs)
        ok = [Result(sent=0.0, ttft=0.1, latency=seconds, output_tokens=tokens)]
        return ok + ([Result(sent=0.0, error=error)] if error else []), seconds, {"steps": int(10 * seconds)}

    row = median_run(run, lambda k: [], False, 3)
    assert row["repeats_tok_s"] == [8.0, 2.0, 4.0]  # in run order
    assert row["output_tok_s"] == 4.0 and row["steps"] == 20  # the median run: 8 tokens in 2 s
    assert row["failed"] == 0 and row["failed_all_runs"] == 1  # the slowest run's failure is kept


def test_raw_stream_raises_on_the_servers_error_chunk():
    """After the 200 the server reports a failure as `data: {"error": ...}`: the raw reader fails the request
    as the typed stream does (APIError), rather than counting it complete with no tokens."""
    from bench.serve import _raw_chunks

    class Response:
        async def iter_lines(self):
            for line in ['data: {"choices": [{"text": "a", "token_ids": [1]}]}', "",
                         'data: {"error": {"message": "engine died", "code": 503}}', "data: [DONE]"]:
                yield line

    class Streaming:
        def create(self, **kw):
            class Ctx:
                async def __aenter__(self):
                    return Response()

                async def __aexit__(self, *a):
                    return False
            return Ctx()

    client = Namespace(completions=Namespace(with_streaming_response=Streaming()))

    async def read():
        return [item async for item in _raw_chunks(client, {})]

    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(read())


def test_saturation_runs_never_share_a_prompt():
    """Every saturation run (streamed, not, each repeat, the in-process reference) gets prompts of its own:
    a run that reused another's would find their KV in the server's prefix cache and skip the prefill."""
    fresh = Fresh(lambda salt: workload(4, 16, 4, 0.0, math.inf, 1000, seed=100 + 7919 * salt))
    seen: list = []

    def run(reqs, stream):
        seen.append(tuple(tuple(r.prompt) for r in reqs))
        return [Result(sent=0.0, ttft=0.1, latency=0.5, output_tokens=r.max_tokens) for r in reqs], 0.5, {}

    rows = run_pass("saturation", Namespace(repeat=2), [(4, fresh)], run)
    assert [(r["stream"], len(r["repeats_tok_s"])) for r in rows] == [(True, 2), (False, 2)]
    median_run(run, lambda k: fresh.of(IN_PROCESS, k), True, 2)
    prompts = [p for run_prompts in seen for p in run_prompts]
    assert len(seen) == 6 and len(set(prompts)) == len(prompts) == 24
    assert fresh.of(IN_PROCESS, 1) == fresh.of(IN_PROCESS, 1)  # the same run gets the same prompts every time
    assert [len(r.prompt) for r in fresh.of(0, 0)] == [len(r.prompt) for r in fresh.of(2, 1)]


def test_serve_clients_over_processes_keep_request_order_and_count_cpu(llm):
    """bench/serve.py's client spread over processes: every request answered, each result back at its
    request's index (output lengths differ per request), and the clients' CPU time counted."""
    server = main_server()
    reqs = workload(5, 8, 4, 0.5, math.inf, llm.engine.model_config.vocab_size, seed=5)
    assert len({r.max_tokens for r in reqs}) > 1
    before: list = []
    results, duration, client = run_clients(server.url, MAIN_KEY, "smol", reqs, True, 0.0, 120, 2,
                                            lambda: before.append(server_steps(server.url, MAIN_KEY)))
    assert [r.error for r in results] == [None] * 5
    assert [r.output_tokens for r in results] == [r.max_tokens for r in reqs]
    assert client["client_procs"] == 2 and client["client_cpu_s"] > 0 and duration > 0
    # The start line came after both clients' warm-ups: the steps since ran this pass's tokens, at least
    # one step per token of its longest request (other tests may share the server, never fewer).
    assert len(before) == 1 and server_steps(server.url, MAIN_KEY) - before[0] >= max(r.max_tokens for r in reqs)


@pytest.mark.parametrize("stream", [True, False])
def test_serve_http_and_engine_paths_complete_every_request(stream, llm):
    server = main_server()
    reqs = workload(3, 8, 4, 0.0, math.inf, llm.engine.model_config.vocab_size, seed=3)
    results, duration = asyncio.run(run_http(server.url, MAIN_KEY, "smol", reqs, stream, 0.0, 120))
    s = summarize(results, duration)
    assert s["failed"] == 0 and s["completed"] == 3 and s["output_tokens"] == 12, s
    assert s["ttft_ms"]["p50"] > 0 and s["output_tok_s"] > 0
    if stream:
        assert all(len(r.itl) >= 1 for r in results) and s["itl_ms"] is not None
        assert 1.0 <= s["tokens_per_chunk"] <= 2.0  # 12 tokens in 6 (each request's ITL has one gap) to 12 chunks
    else:
        assert s["tokens_per_chunk"] is None
    counts: dict = {}
    eng, duration = run_engine(llm.engine, reqs, 0.0, f"bench-{stream}", counts)
    e = summarize(eng, duration)
    assert e["failed"] == 0 and e["output_tokens"] == 12 and all(len(r.itl) == 3 for r in eng), e
    # One step per token when all three are admitted at once; the clean-clone CI run of 2026-12-04 on the loaded
    # 2-core host admitted one a step later (5), as the server's admission window allows.
    assert 4 <= counts["steps"] <= 5, counts
    assert e["all_first_token_ms"] > 0
    assert not llm.engine.has_unfinished


@pytest.mark.parametrize("stream", [True, False])
def test_serve_raw_and_fast_clients_read_what_the_typed_client_reads(stream, llm):
    """--client raw (ids in extra_body, answers json-parsed) and --client fast (the same bodies over
    bench/fast_client.py) send the server the same request and count the same tokens and chunks as the typed
    path; an ignored extra_body would leave an empty prompt (a 400)."""
    server = main_server()
    reqs = workload(3, 8, 4, 0.5, math.inf, llm.engine.model_config.vocab_size, seed=7)
    got = {client: asyncio.run(run_http(server.url, MAIN_KEY, "smol", reqs, stream, 0.0, 120, warm_up=True,
                                        client=client))[0] for client in ("typed", "raw", "fast")}
    for raw, results in got.items():
        assert [r.error for r in results] == [None] * 3, raw
        assert [r.output_tokens for r in results] == [r.max_tokens for r in reqs], raw
        assert all(r.ttft > 0 and r.latency >= r.ttft for r in results), raw
        if stream:  # a content chunk per token, or fewer when the server merged steps for a lagging client
            assert all(0 <= len(r.itl) <= q.max_tokens - 1 for r, q in zip(results, reqs)), raw
            assert sum(len(r.itl) for r in results) >= 1, raw


def test_spy_summary_gives_each_threads_share_and_hottest_frames(tmp_path):
    # py-spy's raw format: one line per distinct stack, root first (with --threads, the thread), then a count.
    raw = tmp_path / "api.txt"
    raw.write_text("thread (1): MainThread;run (a.py:1);send (b.py:2) 30\n"
                   "thread (1): MainThread;run (a.py:1);take (c.py:3) 10\n"
                   "thread (1): MainThread;run (a.py:1);send (b.py:2) 20\n"
                   "thread (2): reader;read (d.py:4) 40\n"
                   "not a stack line\n")
    s = summarize_spy(raw, top=1)
    assert s["samples"] == 100
    assert list(s["threads"]) == ["thread (1): MainThread", "thread (2): reader"]  # busiest first
    assert s["threads"]["thread (1): MainThread"] == {"share": 0.6, "top": [["send (b.py:2)", round(50 / 60, 3)]]}
    assert s["threads"]["thread (2): reader"] == {"share": 0.4, "top": [["read (d.py:4)", 1.0]]}


def test_spy_below_a_frame_counts_one_threads_children_of_the_first_anchor_found(tmp_path):
    """bench.spy.below: only the named thread; each stack under the first anchor it holds (in preference
    order), `depth` frames deep; stacks with neither anchor, or idle in a skipped frame, left out."""
    from bench.spy import below

    raw = tmp_path / "engine.txt"
    raw.write_text("thread (7): engine;run (s.py:1);step (c.py:2);record (c.py:3);collect (r.py:4) 50\n"
                   "thread (7): engine;run (s.py:1);step (c.py:2);record (c.py:3);update (u.py:5) 30\n"
                   "thread (7): engine;run (s.py:1);flush (s.py:6);send (m.py:7) 15\n"
                   "thread (7): engine;run (s.py:1);Event.wait (t.py:8) 99\n"
                   "thread (7): engine;other (o.py:1) 5\n"
                   "thread (8): reader;run (s.py:1);read (m.py:9) 40\n")
    total, counts = below([raw], "engine", ["step", "run"], depth=2)
    assert total == 95
    assert counts == {"record;collect": 50, "record;update": 30, "flush;send": 15}
    assert below([raw], "engine", ["step"], depth=1) == (80, {"record": 80})


def test_sse_floor_counts_the_same_chunks_through_the_server_and_the_bare_app():
    r = sse_floor("cpu", "llama-micro", 2, 4, 1)
    ours, floor = r["server"], r["floor"]
    assert 2 <= ours["chunks"] <= 8  # 2 streams x 4 tokens, merged into fewer chunks only when a client lags
    assert floor["chunks"] == 2 * round(ours["chunks"] / 2) and floor["chunk_bytes"] == ours["chunk_bytes"] > 100
    # No CPU figure is asserted: /proc counts it in 10 ms ticks, and a run this small may read 0.


def test_rollout_http_as_trl_and_in_process_with_roofline(llm):
    server = main_server()
    prompts = make_prompts(3, 8, 0.25, llm.engine.model_config.vocab_size, seed=0)
    http = http_rollout(server.url, MAIN_KEY, "smol", prompts, n=2, max_tokens=4, temperature=1.0, requests=2)
    assert http["sequences"] == 6 and http["tokens"] == 24
    recorder = StepRecorder(llm.engine)
    try:
        eng = engine_rollout(llm, prompts, n=2, max_tokens=4, temperature=1.0)
    finally:
        recorder.close()
    assert eng["sequences"] == 6 and eng["tokens"] == 24
    # Every sequence's prompt was computed once (prefix caching may share it) and 3 decode tokens after it.
    assert sum(shape.tokens for shape in recorder.steps) >= 6 * 3
    cost = ModelCost.of(llm.engine.model)
    device = Device(bandwidth=1e12, gemm_flops=1e14)
    assert recorder.roofline_seconds(cost, device) >= len(recorder.steps) * cost.weight_bytes / 1e12


def test_roofline_step_cost_counts_weights_kv_and_flops(llm):
    cost = ModelCost.of(llm.engine.model)
    shape = StepShape.of([(0, 3), (10, 1)], sampled=2)
    nbytes, flops = cost.step(shape)
    assert nbytes == cost.weight_bytes + (3 + 11) * cost.kv_bytes_per_token
    pairs = (0 + 1 + 2 + 3) + 11  # each new token attends to every token up to itself
    assert flops == 2 * cost.matmul_params * 4 + 2 * cost.head_params * 2 + cost.attn_flops_per_pair * pairs
    slow_memory = Device(bandwidth=1.0, gemm_flops=1e30)
    assert cost.step_seconds(shape, slow_memory) == nbytes
    # A decode step: each sequence's one new token reads and attends to its whole context.
    assert StepShape.decode(10 + 20, 2) == StepShape.of([(10, 1), (20, 1)], 2)


def test_step_host_cost_runs_the_step_and_the_frame_path(llm):
    """bench/step_host_cost.py at a tiny size: the step, the frame and the API side ran, and the streams got
    every token once per step (streaming) or none before the end (FINAL_ONLY); measure checks that."""
    from bench.step_host_cost import measure

    for kind in ("stream", "final"):
        row = measure(llm, 4, kind, 2, 3, 1.0, 1.0, 0, None, False)
        assert row["batch"] == 4 and row["kind"] == kind and "engine_host_ms" in row
    from bench.step_host_cost import python_cost

    for kind in ("stream", "final", "inproc"):  # the Python alone: planned ahead and recorded, engine left empty
        row = python_cost(llm, 4, kind, 2, 3, 0, None, repeats=1)
        assert row["python_us_per_seq"] > 0 and not llm.engine.has_unfinished


def test_openai_client_cost_reads_every_answer_from_the_stand_in(tmp_path):
    """bench/openai_client_cost.py end to end at a tiny size: each client (the official one typed and raw, the
    benchmarks' fast one) gets every plain answer and every streamed chunk from the stand-in, and the CPU it
    spent is counted."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "bench/openai_client_cost.py", "--concurrency", "8", "--chunks", "5",
                          "--rounds", "1", "--server-processes", "1", "--out", str(tmp_path)],
                         cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["client"], r["mode"]): r for r in json.loads((tmp_path / "openai-client-cost.json").read_text())["rows"]}
    assert len(rows) == 6  # typed, raw and fast; plain and streamed
    for (client, mode), row in rows.items():
        assert row["requests"] == 8 and row["received"] == 8 * (5 if mode == "stream" else 1), (client, row)
        assert row["client_cpu_ms_per_request"] > 0


def test_finite_check_bench_times_a_check_that_finds_nothing(tmp_path):
    import torch

    from bench.finite_check import check_s

    named = [(f"w{i}", torch.randn(256, 64)) for i in range(4)]
    median, best = check_s(named, torch.device("cpu"), rounds=2)
    assert 0 < best <= median
