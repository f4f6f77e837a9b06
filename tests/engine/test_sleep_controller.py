"""SleepController's rules on a real CPU pool that also holds an internal `cuda_graph` tag (no graphs
exist on CPU, so the tag is filled by hand): the level-2 RLHF flow with staged wakes must end fully
awake, the graph tag sleeps with the first tag and wakes with whatever wake lets the engine run."""
from __future__ import annotations

import pytest
import torch

from allocator import create_pool
from server.wire.errors import ConflictError, InvalidRequestError
from server.engine.sleep_controller import SleepController
from server.wire.tags import CUDA_GRAPH, KV_CACHE, WEIGHTS, parse_tags

MiB = 1 << 20


class FakeEngine:
    """What the controller drives: a pool, plus counters for the request-side effects."""

    def __init__(self, pool):
        self.pool = pool
        self.unfinished = 0
        self.aborted = self.preempted = self.resets = self.drains = 0

    @property
    def has_unfinished(self) -> bool:
        return self.unfinished > 0

    def drain(self) -> None:
        self.drains += 1

    def abort_all(self) -> int:
        n, self.unfinished = self.unfinished, 0
        self.aborted += n
        return n

    def preempt_all(self) -> None:
        self.preempted += 1

    def reset_prefix_cache(self) -> None:
        self.resets += 1


@pytest.fixture
def engine(tmp_path):
    pool = create_pool(torch.device("cpu"), backup_dir=str(tmp_path))
    eng = FakeEngine(pool)
    eng.tensors = {tag: pool.empty((MiB,), torch.uint8, tag) for tag in (WEIGHTS, KV_CACHE, CUDA_GRAPH)}
    eng.graph_bytes = torch.arange(MiB, dtype=torch.int64).to(torch.uint8)
    eng.tensors[CUDA_GRAPH].copy_(eng.graph_bytes)
    yield eng
    pool.close()


def test_level2_staged_wakes_end_fully_awake(engine):
    ctl = SleepController(engine)
    report = ctl.sleep(2)
    assert report.changed and set(report.discarded) == {WEIGHTS, KV_CACHE} and report.offloaded == ()
    assert ctl.state.tag_states[CUDA_GRAPH] == "offloaded"  # the graph tag slept with the others
    assert ctl.state.sleeping_tags == [KV_CACHE, WEIGHTS]  # users see only their tags
    assert ctl.wake_up(WEIGHTS).woke == (WEIGHTS,)
    assert ctl.state.tag_states[CUDA_GRAPH] == "offloaded"  # kv_cache still asleep: the engine cannot run yet
    names = {"w"}
    ctl.check_weight_update()
    ctl.weights_loaded(names, names, "step-1", set_version=True)
    assert ctl.state.weights_valid and ctl.state.weight_version == "step-1"
    assert ctl.wake_up([KV_CACHE]).woke == (KV_CACHE,)
    state = ctl.state
    assert not state.asleep and state.can_run and state.refusal is None and state.level is None
    assert torch.equal(engine.tensors[CUDA_GRAPH], engine.graph_bytes)  # restored bit-exact


def test_graph_sleeps_with_the_first_tag_and_wakes_with_the_last(engine):
    ctl = SleepController(engine)
    assert ctl.sleep(1, [KV_CACHE]).changed
    assert ctl.state.tag_states[CUDA_GRAPH] == "offloaded" and ctl.state.tag_states[WEIGHTS] == "awake"
    assert ctl.sleep(1, "weights").changed  # the graph is already asleep; only weights move
    assert ctl.wake_up("kv_cache").changed
    assert ctl.state.tag_states[CUDA_GRAPH] == "offloaded"  # weights still asleep
    assert ctl.wake_up(None).woke == (WEIGHTS,)
    assert not ctl.state.asleep and ctl.state.can_run


def test_repeats_are_idempotent_and_clashes_conflict(engine):
    ctl = SleepController(engine)
    assert not ctl.wake_up().changed and not ctl.resume().changed
    ctl.sleep(2)
    before = ctl.state
    for level, tags in ((2, None), (2, KV_CACHE), (1, KV_CACHE)):
        report = ctl.sleep(level, tags)
        assert not report.changed and report.bytes_discarded == 0, (level, tags)
    assert ctl.state == before
    with pytest.raises(ConflictError, match="weights is discarded, level 1 would have it offloaded"):
        ctl.sleep(1)
    assert ctl.wake_up(WEIGHTS).changed and not ctl.wake_up(WEIGHTS).changed  # a repeat: nothing to do


def test_pending_sleep_drains_then_refuses_a_second(engine):
    ctl = SleepController(engine)
    engine.unfinished = 2
    assert ctl.begin_sleep(1, mode="wait") is None
    assert ctl.state.draining and ctl.state.refusal.code == "draining" and not ctl.ready
    with pytest.raises(ConflictError, match="already in progress"):
        ctl.begin_sleep(0)
    with pytest.raises(ConflictError, match="wake after it completes"):
        ctl.wake_up()
    engine.unfinished = 0  # the requests in flight finished
    assert ctl.ready
    report = ctl.finish_sleep()
    assert report.changed and report.aborted == 0 and not ctl.state.draining and ctl.state.level == 1
    assert engine.drains == 1  # the step in flight (async scheduling) ended before the memory went


def test_a_failure_after_the_pool_slept_still_answers_the_caller(engine, monkeypatch):
    """The server's sleep call waits on on_done: an error anywhere in finish_sleep (here assembling the
    report, after the pool slept) must reach it, not leave the HTTP request hanging."""
    ctl = SleepController(engine)
    heard: list = []
    assert ctl.begin_sleep(1, on_done=lambda report, error: heard.append((report, error))) is None

    def broken(*a, **k):
        raise TypeError("report assembly failed")
    monkeypatch.setattr(ctl, "_timings", broken)
    with pytest.raises(TypeError, match="report assembly failed"):
        ctl.finish_sleep()
    assert len(heard) == 1 and heard[0][0] is None and isinstance(heard[0][1], TypeError)
    assert ctl.state.level == 1 and not ctl.pending  # the state published says what the pool did


def test_report_carries_the_engine_clock_for_the_channel_timings(engine):
    ctl = SleepController(engine)
    for report in (ctl.sleep(1), ctl.wake_up()):
        at = report.timings["at"]
        assert at["called_s"] <= at["done_s"] and at["done_s"] - at["called_s"] >= report.timings["total_ms"] / 1e3


def test_keep_preempts_only_when_memory_goes(engine):
    ctl = SleepController(engine)
    engine.unfinished = 1
    ctl.sleep(0, mode="keep", clear_cache=True)
    assert engine.preempted == 0 and engine.resets == 1 and engine.unfinished == 1
    ctl.check_weight_update()  # paused: weights may change under the kept request
    ctl.resume()
    with pytest.raises(ConflictError, match="requests are running"):
        ctl.check_weight_update()
    ctl.sleep(1, mode="keep")
    assert engine.preempted == 1 and engine.unfinished == 1


def test_tags_are_read_one_way():
    assert parse_tags(None) is None and parse_tags([]) is None and parse_tags(["", " "]) is None
    assert parse_tags("weights") == (WEIGHTS,)
    assert parse_tags(["kv_cache,weights", "kv_cache"]) == (KV_CACHE, WEIGHTS)
    with pytest.raises(InvalidRequestError, match="unknown tag 'gpu'"):
        parse_tags("gpu")
    with pytest.raises(InvalidRequestError, match="internal"):
        parse_tags([CUDA_GRAPH])
