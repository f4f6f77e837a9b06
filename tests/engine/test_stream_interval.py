"""--stream-interval N (EngineConfig.stream_interval, SGLang's flag): a streaming request's outputs every N
engine steps, its first tokens and its end at once, so a stream has N times fewer chunks for the API process
and the client to handle. The tokens and text are those of every-step streaming, only grouped."""
from __future__ import annotations

import json

import httpx
import pytest

from server import LLM, SamplingParams
from tests.conftest import PROMPTS
from testkit.http_server import ServerProcess


def outputs_by_request(llm: LLM, reqs: list[tuple[str, SamplingParams]]) -> dict[str, list]:
    """Every output the engine hands out (streaming: CUMULATIVE), per request, until all finished."""
    eng = llm.engine
    for i, (prompt, params) in enumerate(reqs):
        eng.add_request(f"r{i}", prompt, params=params)
    got: dict[str, list] = {f"r{i}": [] for i in range(len(reqs))}
    while eng.has_unfinished:
        for out in eng.step():
            got[out.request_id].append(out)
    eng.drain()
    return got


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def interval_llm(request, default_model_folder):
    llm = LLM(model=str(default_model_folder), device="cpu", stream_interval=4, async_scheduling=request.param)
    yield llm
    llm.close()


def test_outputs_every_n_steps_with_the_same_tokens(interval_llm, llm):
    reqs = [(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)),
            (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2)),
            (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))]
    grouped = outputs_by_request(interval_llm, reqs)
    every = outputs_by_request(llm, reqs)
    # The first token at once, then four a chunk, the rest with the end.
    assert [len(o.outputs[0].delta_token_ids) for o in grouped["r0"]] == [1, 4, 4, 4, 4]
    assert [len(o.outputs[0].delta_token_ids) for o in every["r0"]] == [1] * 17
    assert [[len(c.delta_token_ids) for c in o.outputs] for o in grouped["r1"]] == [[1, 1], [4, 4], [1, 1]]
    assert [len(o.outputs[0].delta_token_ids) for o in grouped["r2"]] == [1]
    for rid in every:
        a, b = grouped[rid][-1], every[rid][-1]
        assert a.finished and b.finished
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
        for c in range(len(a.outputs)):  # the deltas add up to the whole
            assert "".join(o.outputs[c].delta_text for o in grouped[rid]) == a.outputs[c].text


def test_a_streamed_completion_through_the_server(default_model_folder):
    server = ServerProcess([str(default_model_folder), "--device", "cpu", "--stream-interval", "5",
                            "--log-level", "warning"]).start()
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        sizes, text = [], ""
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[len("data: "):])["choices"][0]
                    sizes.append(len(choice.get("token_ids") or []))
                    text += choice["text"]
        # The engine sends 1 (the first token at once), 5, 5, 1. A busy API process may merge two of them
        # before its stream reads (1, 5, 6): every chunk but the first and the last is still a multiple of 5,
        # which per-token outputs would be only by chance.
        sizes = [s for s in sizes if s]
        assert sizes[0] == 1 and sum(sizes) == 12 and 2 <= len(sizes) <= 4, sizes
        assert all(s % 5 == 0 for s in sizes[1:-1]) and sizes[-1] % 5 == 1, sizes
        assert text == whole["text"]
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["pause", "sleep"])
def test_a_pause_or_sleep_hands_out_what_the_interval_held(interval_llm, how):
    """Tokens sampled before a pause or sleep (mode keep) reach the stream before it, not after the resume:
    an RL trainer pauses, pushes weights and resumes, and must not get old weights' tokens in one chunk with
    the new ones'."""
    eng, got = interval_llm.engine, []
    eng.add_request("held", PROMPTS[0], params=SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                    on_output=got.append)
    for _ in range(4):
        eng.step()
    if how == "pause":
        interval_llm.pause(mode="keep")
    else:
        interval_llm.sleep(level=1, mode="keep")
    sampled = len(eng.requests["held"].seqs[0].output_token_ids)  # the pause recorded the step in flight
    assert sampled >= 3
    assert sum(len(o.outputs[0].delta_token_ids) for o in got) == sampled
    interval_llm.resume() if how == "pause" else interval_llm.wake_up()
    while eng.has_unfinished:
        eng.step()
    eng.drain()
    assert got[-1].finished and len(got[-1].outputs[0].token_ids) == 30
    assert sum(len(o.outputs[0].delta_token_ids) for o in got) == 30


def test_an_interval_below_one_is_refused():
    from server.config import EngineConfig

    for bad in (0, -3):
        with pytest.raises(ValueError, match="stream_interval must be at least 1"):
            EngineConfig(stream_interval=bad)
