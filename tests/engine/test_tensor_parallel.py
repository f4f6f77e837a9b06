"""Tensor parallelism in process (LLM(tensor_parallel_size=2), gloo on CPU): the same greedy tokens as one
rank, and sleep, wake and weight updates applied on every rank, all or nothing, with the device communicator
kept through a sleep (the default) or released and re-created on wake (--tp-release-comm-on-sleep, switched on
the engine's ParallelPool). One TP=2 engine (two processes) serves the whole module; each test leaves it awake
with the served weights."""
from __future__ import annotations

import pytest
import torch

from allocator import PoolError
from server import LLM, SamplingParams
from tests.conftest import PROMPTS
from testkit.models import write_trained_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ARGS = dict(device="cpu", kv_cache_memory="64MiB", max_model_len=512)


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]


@pytest.fixture(scope="module")
def tp2(default_model_folder):
    llm = LLM(model=str(default_model_folder), tensor_parallel_size=2, **ARGS)
    procs = [peer.proc for peer in llm.engine.runner.workers.peers.values()]
    yield llm
    llm.close()
    assert [p.wait(30) for p in procs] == [0], "a worker did not exit cleanly on close"


def wake_and_resume(llm) -> None:
    if llm.engine.sleep_state.asleep:
        llm.wake_up()
    if llm.engine.sleep_state.paused:
        llm.resume()


@pytest.fixture(autouse=True)
def as_found_after_each_test(request):
    """A test that fails half-way (a full disk failed CI's sleeps once) must not leave the module's shared TP=2
    engine asleep, paused or serving other weights: one failure, not every later test failing with "the
    server is paused" or other tokens."""
    llm = request.getfixturevalue("tp2") if "tp2" in request.fixturenames else None
    version = llm.engine.sleep_state.weight_version if llm is not None else None
    yield
    if llm is not None:
        wake_and_resume(llm)
        state = llm.engine.sleep_state
        if not state.weights_valid or state.weight_version != version:
            llm.update_weights()  # the served checkpoint again


@pytest.fixture(scope="module")
def reference(llm, default_model_folder, tmp_path_factory):
    """One rank's greedy tokens, with the served weights and with a 'trained' checkpoint."""
    served = tokens(llm)
    trained = write_trained_checkpoint(default_model_folder, tmp_path_factory.mktemp("tp") / "trained", seed=7)
    llm.sleep(level=2)
    llm.wake_up()
    llm.update_weights(path=str(trained))
    after = tokens(llm)
    llm.update_weights()
    assert after != served, "the trained checkpoint should change the greedy tokens"
    return {"served": served, "trained": after, "trained_path": trained}


def rank_states(llm) -> list[dict[str, str]]:
    return [{t: s.state for t, s in stats.tags.items()} for stats in llm.engine.pool.stats_per_rank()]


def test_two_ranks_give_one_rank_greedy_tokens(tp2, reference):
    assert tp2.engine.model.tp.world == 2
    assert tp2.engine.model.config.num_heads == 6  # 3 KV heads split 2 + 1, their 9 query heads 6 + 3
    assert tokens(tp2) == reference["served"]


def test_each_rank_reports_when_it_launched_each_decode_step(tp2, reference):
    tp2.engine.runner.step_lag()  # clear what earlier tests left
    tp2.generate(PROMPTS[:2], GREEDY)
    lags = tp2.engine.runner.step_lag()
    assert sorted(lags) == [0, 1]
    # 8 tokens: the prefill samples the first, then 7 decode-only steps, seen by both ranks
    assert lags[0]["launch_us"]["steps"] == lags[1]["launch_us"]["steps"] == 7
    assert "recv_us" not in lags[0] and lags[1]["recv_us"]["steps"] == 7
    assert lags[0]["eager_steps"] == lags[1]["eager_steps"] == 7  # CPU: no CUDA graphs
    # a worker receives each step before it launches it (same clock: perf_counter is system-wide)
    assert 0 < lags[1]["recv_us"]["median"] <= lags[1]["launch_us"]["median"]
    assert tp2.engine.runner.step_lag() == {0: {}, 1: {}}  # read and cleared


def test_level1_offloads_every_rank_and_restores_the_outputs(tp2, reference):
    report = tp2.sleep(level=1)
    assert report.changed
    per_rank = rank_states(tp2)
    assert len(per_rank) == 2
    for states in per_rank:
        assert states["weights"] == "offloaded" and states["kv_cache"] == "discarded"
    tp2.wake_up()
    assert all(set(s.values()) == {"awake"} for s in rank_states(tp2))
    assert tokens(tp2) == reference["served"]


def test_level2_and_update_weights_from_disk_on_every_rank(tp2, reference):
    tp2.sleep(level=2)
    assert all(s["weights"] == "discarded" for s in rank_states(tp2))
    tp2.wake_up()
    tp2.update_weights(path=str(reference["trained_path"]))  # each rank reads only its slices
    assert tokens(tp2) == reference["trained"]
    tp2.update_weights()  # the served checkpoint again
    assert tokens(tp2) == reference["served"]


def test_update_weights_from_tensors_gives_each_rank_its_slices(tp2, reference):
    from safetensors.torch import load_file

    named = load_file(str(reference["trained_path"] / "model.safetensors"))
    tp2.pause()
    tp2.update_weights(named_tensors=named.items())
    tp2.resume()
    assert tokens(tp2) == reference["trained"]
    tp2.update_weights()
    assert tokens(tp2) == reference["served"]


def test_a_rank_failing_its_wake_leaves_every_rank_asleep(tp2, reference):
    tp2.sleep(level=1)
    tp2.engine.pool.inject_failure(1, "wake", "out of memory on rank 1 (injected)")
    with pytest.raises(PoolError, match="rank 1.*out of memory.*put back to sleep"):
        tp2.wake_up()
    assert tp2.is_sleeping()
    for states in rank_states(tp2):  # rank 0 had woken: it was put back to sleep as it was
        assert states["weights"] == "offloaded" and states["kv_cache"] == "discarded"
    tp2.wake_up()
    assert tokens(tp2) == reference["served"]


def test_a_rank_failing_its_sleep_leaves_every_rank_awake(tp2, reference):
    tp2.engine.pool.inject_failure(1, "sleep", "backup write failed on rank 1 (injected)")
    with pytest.raises(PoolError, match="rank 1.*backup write failed"):
        tp2.sleep(level=1)
    assert not tp2.is_sleeping()
    assert all(set(s.values()) == {"awake"} for s in rank_states(tp2))
    assert tokens(tp2) == reference["served"]


@pytest.fixture
def released(tp2):
    """The module's TP=2 engine with --tp-release-comm-on-sleep's behaviour on (the flag's value lives on its
    ParallelPool; LLM(tp_release_comm_on_sleep=True) and the server's flag set it there at start)."""
    pool = tp2.engine.pool
    pool.release_comm = True
    yield tp2
    wake_and_resume(tp2)  # a test that failed asleep: the wake re-creates the communicator
    pool.release_comm = False
    assert [s["all_reduce"] for s in pool.comm_states()] == ["gloo", "gloo"], "a test left the communicator down"


def comm_states(llm) -> tuple[list[str], list[int]]:
    states = llm.engine.pool.comm_states()
    return [s["all_reduce"] for s in states], [s["generation"] for s in states]


def test_release_comm_on_sleep_gives_every_rank_a_new_communicator_on_wake(released, reference):
    """Level 1 (async scheduling on: the sampled tokens reach the worker on the new communicator) and level 2
    with the RL order (wake the weights, update them with the communicator still down, wake the KV cache):
    every rank's communicator is down while anything sleeps and a new generation afterwards; greedy tokens
    as before the sleep, and as one rank's."""
    eng = released.engine
    group = eng.runner.workers.group
    old, (names, gens) = group.comm, comm_states(released)
    assert names == ["gloo", "gloo"]
    report = released.sleep(level=1)
    assert "comm_release" in report.timings["pool"]["phases_ms"]
    assert comm_states(released)[0] == ["none", "none"] and group.comm is None and eng.model.tp.comm is None
    released.wake_up(tags=["weights"])  # the KV cache still sleeps: the engine cannot run, no communicator yet
    assert comm_states(released)[0] == ["none", "none"]
    woke = released.wake_up()
    assert "comm_recreate" in woke.timings["pool"]["phases_ms"] and len(woke.timings["pool"]["comm_ms"]) == 2
    names, after = comm_states(released)
    assert names == ["gloo", "gloo"] and after == [g + 1 for g in gens]
    assert group.comm is not old and eng.model.tp.comm is group.comm
    was = eng.async_scheduling
    eng.set_async_scheduling(True)
    try:
        ahead = eng.steps_ahead
        assert tokens(released) == reference["served"]
        assert eng.steps_ahead > ahead, "no step went ahead: the broadcast on the new communicator was not used"
    finally:
        eng.set_async_scheduling(was)

    released.sleep(level=2)
    assert comm_states(released)[0] == ["none", "none"]
    released.wake_up(tags=["weights"])
    released.update_weights(path=str(reference["trained_path"]))  # no communicator needed: each rank reads its slices
    assert comm_states(released)[0] == ["none", "none"]
    released.wake_up(tags=["kv_cache"])
    assert comm_states(released) == (["gloo", "gloo"], [g + 2 for g in gens])
    assert tokens(released) == reference["trained"]
    released.update_weights()
    assert tokens(released) == reference["served"]


def test_a_rank_failing_to_recreate_the_communicator_leaves_every_rank_asleep(released, reference):
    """Rank 1 fails once its new communicator is up (rank 0's is up too): both drop theirs, every rank goes back
    to sleep as before the wake, the engine keeps answering, and the next wake succeeds."""
    released.sleep(level=1)
    gens = comm_states(released)[1]
    released.engine.pool.inject_failure(1, "comm_recreate", "NCCL out of memory on rank 1 (injected)")
    with pytest.raises(PoolError, match=r"re-creating the device communicator on .*rank 1: NCCL out of memory"):
        released.wake_up()
    assert released.is_sleeping()
    for states in rank_states(released):  # every rank had woken its pool: all put back to sleep as they were
        assert states["weights"] == "offloaded" and states["kv_cache"] == "discarded"
    assert comm_states(released) == (["none", "none"], [g + 1 for g in gens])
    released.wake_up()
    assert comm_states(released) == (["gloo", "gloo"], [g + 2 for g in gens])
    assert tokens(released) == reference["served"]


def test_a_failed_sleep_keeps_the_communicator(released, reference):
    released.engine.pool.inject_failure(1, "sleep", "backup write failed on rank 1 (injected)")
    gens = comm_states(released)[1]
    with pytest.raises(PoolError, match="rank 1.*backup write failed"):
        released.sleep(level=1)
    assert not released.is_sleeping()
    assert comm_states(released) == (["gloo", "gloo"], gens)  # released only once every rank slept
    assert tokens(released) == reference["served"]


@pytest.fixture
def tp2_async(tp2):
    """The module's TP=2 engine with async scheduling on (rank 0 broadcasts each step's sampled tokens to
    the worker on the device communicator), as it was afterwards."""
    was = tp2.engine.async_scheduling
    tp2.engine.set_async_scheduling(True)
    assert tp2.engine.async_scheduling, "ParallelRunner should support async scheduling"
    yield tp2
    tp2.engine.set_async_scheduling(was)


def _mixed_requests() -> list:
    """Ends at different steps (rows leave the batch while a step is in flight), a stop string, greedy
    log-probs, n=2 seeded temperature sampling with log-probs."""
    from tests.engine.test_async_scheduling import greedy

    return [(p, greedy(3 + 4 * i)) for i, p in enumerate(PROMPTS[:3])] + [
        (PROMPTS[3], greedy(16, stop=["\n"])),
        (PROMPTS[4], greedy(8, logprobs=2)),
        (PROMPTS[5], SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=10, logprobs=1)),
    ]


def test_async_scheduling_at_two_ranks_gives_the_synchronous_outputs(tp2_async, reference):
    """Greedy, stops, log-probs and seeded sampling at TP=2 with async on equal TP=2 with it off, token for
    token; the greedy tokens equal one rank's; steps really went ahead (their ids never crossed a pipe)."""
    from tests.engine.test_async_scheduling import run, same

    eng = tp2_async.engine
    reqs = _mixed_requests()
    eng.set_async_scheduling(False)
    sync = run(tp2_async, reqs)
    assert tokens(tp2_async) == reference["served"]
    eng.set_async_scheduling(True)
    before = eng.steps_ahead
    got = run(tp2_async, reqs)
    assert eng.steps_ahead > before, "no step went ahead: the test ran synchronously"
    assert tokens(tp2_async) == reference["served"]
    assert got.keys() == sync.keys()
    for rid in sync:
        same(got[rid], sync[rid])
    assert len({tuple(o.token_ids) for o in got["r5"].outputs}) == 2  # two different seeded samples


def test_async_level1_sleep_with_a_step_in_flight_at_two_ranks(tp2_async, reference):
    """A level-1 sleep (mode=keep) while a step is in flight on both ranks: the step is drained first,
    every rank offloads, and after the wake the sequences go on to the uninterrupted synchronous outputs;
    an abort mid-batch drops the row from the next step on both ranks."""
    from tests.engine.test_async_scheduling import greedy, run, same

    reqs = [(p, greedy(10 + 2 * i)) for i, p in enumerate(PROMPTS[:4])]
    eng = tp2_async.engine
    eng.set_async_scheduling(False)
    sync = run(tp2_async, reqs)
    eng.set_async_scheduling(True)
    events = []

    def hook(step: int, done: dict) -> None:
        if step == 3:
            assert eng._inflight is not None
            req = eng.requests["r1"]
            assert eng.abort_request("r1")
            done["r1"] = req.output()
            events.append("abort")
        if step == 5:
            assert eng._inflight is not None
            tp2_async.sleep(level=1, mode="keep")
            assert eng._inflight is None and tp2_async.is_sleeping()
            assert all(s["weights"] == "offloaded" for s in rank_states(tp2_async))
            tp2_async.wake_up()
            events.append("sleep")

    before = eng.steps_ahead
    got = run(tp2_async, reqs, hook)
    assert events == ["abort", "sleep"] and eng.steps_ahead > before
    cut = got["r1"].outputs[0]
    assert cut.finish_reason == "abort" and cut.token_ids == sync["r1"].outputs[0].token_ids[:len(cut.token_ids)]
    for rid in ("r0", "r2", "r3"):
        same(got[rid], sync[rid])
    assert tokens(tp2_async) == reference["served"]


def test_async_step_failing_after_its_forward_keeps_the_ranks_paired(tp2_async, reference, monkeypatch):
    """Rank 0's sampling raises after the worker was told the step broadcasts its tokens: rank 0 still joins
    that broadcast (with placeholders), so the next steps' collectives pair up and the outputs are right."""
    import server.engine.runner as runner_module

    eng = tp2_async.engine
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("sampling failed (injected)")

    eng.add_request("boom", PROMPTS[0], params=GREEDY)
    with monkeypatch.context() as patch:
        patch.setattr(runner_module, "sample_on_device", failing)
        with pytest.raises(RuntimeError, match="injected"):
            eng.step()
    assert calls and eng._inflight is None
    eng.abort_all()
    assert tokens(tp2_async) == reference["served"]


def test_layout_is_checked_before_any_process_starts(default_model_folder):
    with pytest.raises(ValueError, match="cannot split 3 KV heads"):
        LLM(model=str(default_model_folder), tensor_parallel_size=4, **ARGS)


def test_shards_cover_every_checkpoint_tensor_exactly_once():
    """Column slices tile the rows, row-parallel slices tile the columns, the padded vocabulary tiles the
    vocabulary: put the ranks' slices back together and get the whole tensor. KV heads fewer than ranks
    are replicated: each rank holds the one its query heads read."""
    from server.model.config import ModelConfig
    from server.model.shard import TensorParallel

    def config(heads: int, kv: int) -> ModelConfig:
        return ModelConfig.from_dict(dict(model_type="llama", vocab_size=101, hidden_size=24, intermediate_size=30,
                                          num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv,
                                          head_dim=4))

    cfg = config(12, 4)
    names = {"model.embed_tokens.weight": (101, 24), "model.layers.0.self_attn.q_proj.weight": (48, 24),
             "model.layers.0.self_attn.k_proj.weight": (16, 24), "model.layers.0.self_attn.o_proj.weight": (24, 48),
             "model.layers.0.mlp.gate_proj.weight": (30, 24), "model.layers.0.mlp.down_proj.weight": (24, 30)}
    for world in (2, 3, 4):
        for name, shape in names.items():
            whole = torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape)
            parts, dim = [], 0
            for rank in range(world):
                shard = TensorParallel(cfg, rank, world).shard(name)
                dim = shard.dim
                local = torch.empty(shard.size if dim == 0 else shape[0], shard.size if dim == 1 else shape[1])
                shard.place(local, shard.take(whole))
                parts.append(local.narrow(dim, 0, shard.stop - shard.start))
            assert torch.equal(torch.cat(parts, dim), whole), (world, name)
    replicated = config(8, 2)
    k = torch.arange(8 * 24, dtype=torch.float32).view(8, 24)
    for rank in range(4):
        tp = TensorParallel(replicated, rank, 4)
        assert tp.config.num_kv_heads == 1 and tp.config.num_heads == 2
        kv = rank // 2  # query heads 2r, 2r+1 read KV head r // 2
        assert torch.equal(tp.shard("model.layers.0.self_attn.k_proj.weight").take(k), k[kv * 4:(kv + 1) * 4])


def test_row_parallel_writes_into_a_staging_communicator_and_sums():
    """A communicator with a staging buffer (symmetric memory on CUDA) gets o_proj/down_proj's output
    written into its buffer, then reduced; one without gets linear(x) all-reduced. Both give the sum.
    Here the 'ranks' are two identical ones (the reduction doubles), in one process."""
    from server.model.config import ModelConfig
    from server.model.shard import TensorParallel

    class Staging:
        def __init__(self) -> None:
            self.buf = torch.full((64,), float("nan"))
            self.staged = 0

        def all_reduce(self, x):
            return x.mul_(2)

        def staging(self, rows, cols, dtype):
            return None if rows * cols > 64 else self.buf[:rows * cols].view(rows, cols)

        def reduce_staged(self, staged):
            assert staged.data_ptr() == self.buf.data_ptr(), "the matmul wrote outside the buffer"
            self.staged += 1
            return staged * 2

    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=11, hidden_size=8, intermediate_size=8,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=4))
    tp = TensorParallel(cfg, 0, 2)
    tp.comm = Staging()
    torch.manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(6, 8, bias=bias)
        for rows in (3, 9):  # 24 values fit the buffer, 72 do not
            x = torch.randn(rows, 6)
            with torch.no_grad():
                assert torch.allclose(tp.row_parallel(linear, x), 2 * linear(x), atol=1e-6)
    assert tp.comm.staged == 2  # the rows that fit went through the buffer, with and without a bias
    assert torch.equal(TensorParallel(cfg).row_parallel(linear, x), linear(x))  # one rank: linear alone


def test_tp_comm_suspend_takes_auto_or_off():
    from server.config import EngineConfig

    assert EngineConfig(tp_comm_suspend="off").tp_comm_suspend == "off"
    with pytest.raises(ValueError, match="tp_comm_suspend must be auto or off"):
        EngineConfig(tp_comm_suspend="on")
