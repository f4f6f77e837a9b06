"""The engine's sleep state machine in process (LLM API, CPU backend): levels, tags, conflicts."""
from __future__ import annotations

import pytest

from server import SamplingParams
from server.wire.errors import ConflictError, EngineUnavailableError, InvalidRequestError
from tests.conftest import PROMPTS


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_levels_restore_the_same_outputs_and_refuse_meanwhile(llm):
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], greedy())]
    llm.sleep(level=1)
    assert llm.is_sleeping()
    with pytest.raises(EngineUnavailableError, match="sleeping"):
        llm.engine.add_request("x", "hello", params=greedy())
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], greedy())] == before
    llm.sleep(level=2)
    llm.wake_up()
    with pytest.raises(EngineUnavailableError, match="update_weights"):
        llm.generate(PROMPTS[0], greedy())
    llm.update_weights()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], greedy())] == before


def test_repeats_change_nothing_and_clashes_are_conflicts(llm):
    ctl = llm.engine.sleep_control
    first = llm.sleep(level=1)
    assert first.changed and first.bytes_offloaded > 100e6
    try:
        before = ctl.state
        again = llm.sleep(level=1)
        assert not again.changed and again.bytes_offloaded == 0 and ctl.state == before
        assert not llm.sleep(level=1, tags=["kv_cache"]).changed  # already discarded, as level 1 wants
        with pytest.raises(ConflictError, match="weights is offloaded, level 2 would have it discarded"):
            llm.sleep(level=2)  # would discard weights that are offloaded: refuse, do not pretend
        assert llm.pause().changed and not llm.pause().changed
        assert ctl.state.level == 1 and ctl.state.paused  # a pause on top keeps the level
        assert llm.wake_up(tags=["weights", "kv_cache"]).woke == ("weights", "kv_cache")
        assert ctl.state.paused and not ctl.state.asleep  # waking named tags keeps the pause
    finally:
        llm.wake_up()
    assert not llm.is_sleeping() and ctl.state.level is None
    assert not llm.wake_up().changed and not llm.resume().changed


def test_partial_wake_and_bad_arguments(llm):
    with pytest.raises(InvalidRequestError, match="level"):
        llm.sleep(level=3)
    with pytest.raises(InvalidRequestError, match="unknown tag"):
        llm.sleep(level=1, tags=["activations"])
    with pytest.raises(InvalidRequestError, match="mode"):
        llm.sleep(level=1, mode="later")
    llm.sleep(level=1, tags=["kv_cache"])
    assert llm.engine.pool.tag_state("weights") == "awake"
    assert llm.engine.pool.tag_state("kv_cache") == "discarded"
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()


def test_keep_mode_resumes_requests_by_recomputing(llm):
    core = llm.engine
    expected = llm.generate(PROMPTS[1], greedy(24))[0].outputs[0].token_ids
    core.add_request("kept", PROMPTS[1], params=greedy(24))
    for _ in range(6):
        core.step()
    llm.sleep(level=1, mode="keep")
    assert core.has_unfinished and core.stats().kv_blocks_used == 0
    llm.wake_up()
    done = None
    while core.has_unfinished:
        for out in core.step():
            done = out
    assert done.request_id == "kept" and done.outputs[0].token_ids == expected


def test_update_weights_checks_before_touching(llm, tmp_path):
    import torch

    p = next(llm.engine.model.parameters())
    snapshot = p.detach().clone()
    with pytest.raises(Exception, match="shape"):
        llm.update_weights(named_tensors=[("model.norm.weight", torch.zeros(3))])
    with pytest.raises(Exception, match="does not exist"):
        llm.update_weights(path=str(tmp_path / "missing"))
    assert torch.equal(p, snapshot)
