"""Tensor parallelism on two GPUs: the symmetric-memory all-reduce (--tp-all-reduce symm) against NCCL's,
eagerly and captured in a CUDA graph, then TP=2 greedy tokens with each backend (equal, and unchanged
by level-1 and level-2 sleeps), and TP=2 async scheduling against synchronous steps. Skipped on a host
with fewer than two GPUs."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server import LLM, SamplingParams
from testkit.models import model_folder

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]
CHECK = Path(__file__).with_name("tp_allreduce_check.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_symm_all_reduce_equals_nccl_eager_and_in_a_graph():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(CHECK), str(r), "2", str(port)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"rank exited with {p.returncode}"
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    for out in outs:
        assert out["backend"] == "symm", f"rank {out['rank']} fell back to {out['backend']} (its log says why)"
        checks = out["checks"]
        for rows in ("1", "8", "64", "256"):
            assert checks[rows]["one_shot"], f"{rows} rows should fit the symmetric buffer"
        assert not checks["1024"]["one_shot"], "a message above the buffer goes to NCCL"
        for rows, c in checks.items():
            assert c["ints_equal"], f"{rows} rows: small integers must sum exactly on both paths"
            assert c["close"], f"{rows} rows: symm and NCCL sums differ beyond bf16 rounding ({c})"
        assert out["graph"] == [True, True, True], "the captured one-shot all-reduce gave a wrong sum on replay"
        assert all(out["staged"].values()), f"sums of rows written into the buffer differ from NCCL's: {out['staged']}"
    # Both ranks hold the same result: every rank sums in rank order.
    assert outs[0]["checks"] == outs[1]["checks"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return model_folder("llama-tiny", tmp_path_factory.mktemp("models"))


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], params)]  # batch 1: the graph of 1
    return out + [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_tp2_greedy_tokens_are_the_same_with_nccl_and_symm(tiny):
    kw = dict(model=str(tiny), device="cuda", load_format="dummy", kv_cache_memory="256MiB", max_num_seqs=16,
              tensor_parallel_size=2)
    results = {}
    for backend in ("nccl", "symm"):
        llm = LLM(tp_all_reduce=backend, **kw)
        try:
            assert [r["all_reduce"] for r in llm.engine.runner.ranks()] == [backend, backend]
            results[backend] = greedy(llm)
            lags = llm.engine.runner.step_lag()
            assert all(v.get("eager_steps") == 0 for v in lags.values()), f"decode steps ran without a graph: {lags}"
            if backend == "symm":
                for level in (1, 2):
                    llm.sleep(level=level)
                    llm.wake_up()
                    if level == 2:
                        llm.update_weights()  # dummy weights: the same seeded values again
                    assert greedy(llm) == results[backend], f"symm outputs changed after a level-{level} sleep"
        finally:
            llm.close()
    assert results["symm"] == results["nccl"]


def test_tp2_async_scheduling_gives_the_synchronous_tokens(tiny):
    """--async-scheduling at TP=2 (NCCL, decode graphs): rank 0 broadcasts each step's sampled tokens to rank 1
    on the device, and both ranks launch the next step from them before they reach the host. One engine
    switched between the two modes (same weights, same graphs), float32 (batch-shape rounding far below any
    argmax margin): batch 1 and 5 run to their length with log-probs beside n=2 seeded sampling, then ends at
    different steps (a stop token, lengths) with a level-1 sleep (mode keep) while a step is in flight."""
    from tests.engine.test_async_scheduling import run, same

    llm = LLM(model=str(tiny), device="cuda", load_format="dummy", kv_cache_memory="256MiB", max_num_seqs=8,
              dtype="float32", tensor_parallel_size=2, tp_all_reduce="nccl")
    eng = llm.engine

    def both(reqs, hook=None) -> tuple[dict, dict]:
        eng.set_async_scheduling(False)
        off = run(llm, reqs)
        eng.set_async_scheduling(True)
        assert eng.async_scheduling, "async scheduling should be on at TP=2"
        before = eng.steps_ahead
        on = run(llm, reqs, hook)
        eng.set_async_scheduling(False)
        assert eng.steps_ahead > before, "no step went ahead"
        for rid in off:
            same(on[rid], off[rid])
        return off, on

    try:
        eng.runner.step_lag()
        for k in (1, 5):
            reqs = [(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1))
                    for p in (PROMPTS * 2)[:k]]
            both(reqs)
            both(reqs[:1] + [(PROMPTS[3], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40,
                                                         ignore_eos=True))])
        lags = eng.runner.step_lag()
        assert all(v.get("eager_steps") == 0 for v in lags.values()), f"decode steps ran without a graph: {lags}"
        ref = run(llm, [(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))])
        stop = ref["r0"].outputs[0].token_ids[7]
        reqs = [(p, SamplingParams(temperature=0.0, max_tokens=6 + 7 * i, stop_token_ids=[stop]))
                for i, p in enumerate(PROMPTS)]
        slept = []

        def hook(step: int, done: dict) -> None:
            if step == 9:
                assert eng._inflight is not None
                llm.sleep(level=1, mode="keep")
                llm.wake_up()
                slept.append(step)

        both(reqs, hook)
        assert slept
    finally:
        llm.close()


def test_tp2_release_comm_on_sleep_recreates_nccl_and_recaptures_the_graphs(tiny):
    """--tp-release-comm-on-sleep at TP=2 (NCCL, decode graphs, fp32): level-1 and level-2 (+ update_weights)
    cycles keep the greedy tokens; every rank's NCCL communicator is down while asleep and a new generation
    after the wake; decode steps after the wake replay graphs (re-captured, none eager); the graphs' pool
    memory does not grow from cycle to cycle (re-captured into the same buffers and pool); a rank failing
    once its new communicator is up rolls every rank back to sleep, and the next wake succeeds."""
    from allocator import PoolError

    llm = LLM(model=str(tiny), device="cuda", load_format="dummy", kv_cache_memory="256MiB", max_num_seqs=16,
              dtype="float32", tensor_parallel_size=2, tp_all_reduce="nccl", tp_release_comm_on_sleep=True)
    pool = llm.engine.pool

    def comms() -> tuple[list[str], list[int]]:
        states = pool.comm_states()
        return [s["all_reduce"] for s in states], [s["generation"] for s in states]

    def graph_bytes() -> list[tuple[int, int]]:
        return [(s.tags["cuda_graph"].bytes, s.tags["cuda_graph"].allocations) for s in pool.stats_per_rank()]

    try:
        reference = greedy(llm)
        llm.engine.runner.step_lag()
        names, gens = comms()
        assert names == ["nccl", "nccl"]
        graphs_at_start = graph_bytes()
        graphs_before = None
        for cycle in range(2):
            for level in (1, 2):
                llm.sleep(level=level)
                assert comms()[0] == ["none", "none"], "the communicator should be down while asleep"
                llm.wake_up()
                if level == 2:
                    llm.update_weights()  # dummy weights: the same seeded values again
                assert greedy(llm) == reference, f"outputs changed after a level-{level} sleep (cycle {cycle})"
                lags = llm.engine.runner.step_lag()
                assert all(v.get("eager_steps") == 0 for v in lags.values()), f"decode ran without graphs: {lags}"
            now = graph_bytes()
            # The re-capture reuses the graph buffers and the pool's cached blocks: the first may differ from the
            # start-up's by the allocator's rounding at most, and nothing grows from one cycle to the next.
            for (b0, _), (b1, _) in zip(graphs_at_start, now):
                assert b1 <= b0 * 1.1 + (8 << 20), f"graph pool memory {graphs_at_start} at start, {now} after a re-capture"
            assert graphs_before is None or now == graphs_before, f"graph pool memory grew: {graphs_before} -> {now}"
            graphs_before = now
        assert comms() == (["nccl", "nccl"], [g + 4 for g in gens])
        llm.sleep(level=1)
        pool.inject_failure(1, "comm_recreate", "out of memory on rank 1 (injected)")
        with pytest.raises(PoolError, match="rank 1: out of memory"):
            llm.wake_up()
        assert llm.is_sleeping() and comms()[0] == ["none", "none"]
        llm.wake_up()
        assert greedy(llm) == reference
        assert comms() == (["nccl", "nccl"], [g + 6 for g in gens])
    finally:
        llm.close()
