"""The engine-process channel's own contracts, without a server: outputs rebuilt in the API process
from the deltas the engine sends equal the engine's own outputs, field by field; engine errors cross
with their status-deciding attributes; the sleep state crosses whole."""
from __future__ import annotations

import pickle
from dataclasses import asdict

import pytest

from server.engine.deltas import encode_delta
from server.wire.messages import SHORT_DELTA, WireError, pack
from server.api.engine_client import OutputStream
from server.wire.errors import EngineUnavailableError, InvalidRequestError
from server.wire.params import RequestOutputKind, SamplingParams
from server.wire.sleep_state import SleepState
from server.weight_transfer.receiver import TransferFailedError


def _wire(obj):
    return pickle.loads(pack(obj)[8:])


def _in_thread(fn, *args):
    """Run fn on a worker thread, as the engine process does (on the loaded 2-core CI host torch's CPU
    thread team is several times slower from the main thread), re-raising its failure here."""
    import threading
    failure: list = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as e:
            failure.append(e)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if failure:
        raise failure[0]


def test_outputs_rebuilt_from_deltas_equal_the_engines(llm):
    _in_thread(_rebuild_every_output, llm.engine)


def _run_cases(core, cases: dict, wire: bool) -> list[list]:
    """Every step's outputs, with the engine in process (whole outputs, log-probs read as Logprob dicts) or as
    the engine process runs it (wire_outputs: deltas only, log-probs as tuples); the prefix cache emptied first, so
    both runs compute the same."""
    core.reset_prefix_cache()
    outs: list = []
    if wire:
        core.wire_outputs(lambda req: outs.append(encode_delta(req)))
    for rid, (prompt, params) in cases.items():
        core.add_request(rid, prompt=prompt, params=params, on_output=outs.append)
    steps: list[list] = []
    try:
        while core.has_unfinished:
            core.step()
            if len(steps) == 5:
                core.abort_request("aborted")
            steps.append(list(outs))
            outs.clear()
    finally:
        core.wire_outputs(None)
    return steps


def _rebuild_every_output(core):
    cases = {
        "plain": ("The capital of France is", SamplingParams(temperature=0, max_tokens=12)),
        "n2-stop-logprobs": ("Once upon a time", SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=16,
                                                                stop=[" the", "."], logprobs=2, prompt_logprobs=1)),
        "aborted": ("List three primary colors:", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)),
        # as an RL rollout asks: its last delta carries every token's log-prob tuple and the whole text at once
        "final-rollout": ("Once upon a time", SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=40, logprobs=0,
                                                             ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)),
    }
    reference = _run_cases(core, cases, wire=False)
    sent = _run_cases(core, cases, wire=True)
    assert len(sent) == len(reference)
    assert any(isinstance(sd[3][0], tuple) for step in sent for d in step if len(d) > SHORT_DELTA for sd in d[1]
               if sd[3])  # log-probs crossed as WireLogprobs tuples
    # a plain stream's middle steps crossed in the short form, the others never
    short = {d[0] for step in sent for d in step if len(d) == SHORT_DELTA}
    assert short == {"plain", "aborted"}, short
    streams = {rid: OutputStream(prompt, None, params.n) for rid, (prompt, params) in cases.items()}
    lagging = OutputStream(cases["n2-stop-logprobs"][0], None, 2)  # a route that takes only every 3rd output
    lagged: list = []
    checked = 0
    for steps, (deltas, outs) in enumerate(zip(sent, reference), start=1):
        assert [d[0] for d in deltas] == [o.request_id for o in outs]
        for d, out in zip(deltas, outs):
            delta = _wire(d)
            streams[out.request_id].apply(delta)
            rebuilt = streams[out.request_id].take()
            assert rebuilt.finished == out.finished and rebuilt.prompt_token_ids == out.prompt_token_ids
            assert rebuilt.num_cached_tokens == out.num_cached_tokens
            assert rebuilt.prompt_logprobs == out.prompt_logprobs or out.prompt_logprobs is None
            assert (rebuilt.metrics is not None) == out.finished
            for mine, theirs in zip(rebuilt.outputs, out.outputs, strict=True):
                assert asdict(mine) == asdict(theirs), (out.request_id, mine, theirs)
            checked += 1
            if out.request_id == "n2-stop-logprobs":
                lagging.apply(delta)
                lagged.append(out)
                if steps % 3 == 0 or out.finished:
                    merged = lagging.take()
                    for i, o in enumerate(merged.outputs):  # the deltas of several steps, the whole of the last
                        assert o.delta_text == "".join(x.outputs[i].delta_text for x in lagged)
                        assert o.delta_token_ids == [t for x in lagged for t in x.outputs[i].delta_token_ids]
                        assert o.delta_logprobs == [e for x in lagged for e in x.outputs[i].delta_logprobs]
                        assert (o.text, o.token_ids, o.finish_reason) == (out.outputs[i].text, out.outputs[i].token_ids,
                                                                          out.outputs[i].finish_reason)
                    lagged.clear()
    assert checked > 20
    final = {rid: s.seqs for rid, s in streams.items()}
    assert all(seq.finish_reason == "abort" for seq in final["aborted"])
    assert all(seq.finish_reason in ("stop", "length") for seq in final["n2-stop-logprobs"])
    assert all(seq.finish_reason == "length" and len(seq.logprobs) == len(seq.token_ids) == 40 and seq.text
               for seq in final["final-rollout"])


def test_streamed_text_made_by_the_api_equals_the_engines(llm):
    _in_thread(_rebuild_api_text, llm.engine)


def _rebuild_api_text(core):
    """text_by_api (SamplingParams): for a streamed request without stop strings the engine sends token ids
    only and the API's OutputStream detokenizes them. Every rebuilt output, text and delta_text chunk by chunk
    included, equals what the engine in process gives the same request without the flag."""
    from dataclasses import replace

    from server.api.engine_client import make_texts, text_tokenizer

    tokenizer = copy_of(core.tokenizer)  # the API process's own, as Tokens.stream_tokenizer
    # a chat turn that the model ends (<|im_end|>, EOS, ignored) and goes on with <|im_start|>: special tokens
    # mid-output, shown or skipped
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    cases = {
        "plain": ("The capital of France is", SamplingParams(temperature=0, max_tokens=12)),
        "n2-logprobs": ("Once upon a time", SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=16, logprobs=2,
                                                           prompt_logprobs=1)),
        "stop": ("Once upon a time", SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=16, stop=[" the", "."])),
        "aborted": ("List three primary colors:", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)),
        "specials-skipped": (chat, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
        "specials-shown": (chat, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                skip_special_tokens=False)),
        "bytes": ("\u4f60\u597d\uff0c\u4e16\u754c", SamplingParams(temperature=1.0, seed=11, max_tokens=24)),
        "final": ("Once upon a time", SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8,
                                                     output_kind=RequestOutputKind.FINAL_ONLY)),
    }
    by_api = {rid: text_tokenizer(tokenizer, params) is not None for rid, (_, params) in cases.items()}
    assert [rid for rid, yes in by_api.items() if not yes] == ["stop", "final"]  # stop strings; nothing streamed
    flagged = {rid: (prompt, replace(params, text_by_api=by_api[rid])) for rid, (prompt, params) in cases.items()}
    reference = _run_cases(core, cases, wire=False)
    sent = _run_cases(core, flagged, wire=True)
    assert len(sent) == len(reference)
    streams = {rid: OutputStream(prompt, None, params.n, text_tokenizer(tokenizer, params), params.skip_special_tokens)
               for rid, (prompt, params) in cases.items()}
    # a route that takes only every 4th output: its text is made at its take, several steps' ids at once
    lagging = OutputStream(cases["n2-logprobs"][0], None, 2, tokenizer)
    lagged: list = []
    engine_text = {rid: "" for rid in cases}  # what the engine itself sent as text before the ends
    frames = []  # each step's deltas, cut where a request comes again (the abort's after the step's own)
    for deltas, outs in zip(sent, reference):
        assert [d[0] for d in deltas] == [o.request_id for o in outs]
        frames.append(([], []))
        for d, out in zip(deltas, outs):
            if d[0] in {x[0] for x in frames[-1][0]}:
                frames.append(([], []))
            frames[-1][0].append(d)
            frames[-1][1].append(out)
    for steps, (deltas, outs) in enumerate(frames, start=1):
        shown = {}
        for d in map(_wire, deltas):  # as EngineClient._on_frame: apply the frame's deltas, make their texts
            if len(d) == SHORT_DELTA:
                engine_text[d[0]] += d[2]
            else:
                engine_text[d[0]] += "".join(sd[2] for sd in d[1] if sd[7] is None)
            shown[d[0]] = [acc.text for acc in streams[d[0]].seqs]
            streams[d[0]].apply(d)
            if d[0] == "n2-logprobs":
                lagging.apply(d)
        make_texts([streams[d[0]] for d in deltas])
        for out in outs:
            rebuilt = streams[out.request_id].take()
            for before, mine, theirs in zip(shown[out.request_id], rebuilt.outputs, out.outputs, strict=True):
                assert asdict(mine) == asdict(theirs), (out.request_id, mine, theirs)
                assert mine.text.startswith(before)  # rest_of never had to cut what was streamed
            if out.request_id == "n2-logprobs":
                lagged.append(out)
                if steps % 4 == 0 or out.finished:
                    merged = lagging.take()
                    for i, o in enumerate(merged.outputs):
                        assert o.delta_text == "".join(x.outputs[i].delta_text for x in lagged)
                        assert (o.text, o.token_ids) == (out.outputs[i].text, out.outputs[i].token_ids)
                    lagged.clear()
    # the engine made no text for the API's requests before their ends, and did for the others
    assert {rid for rid, text in engine_text.items() if text} == {"stop"}, engine_text
    final = {rid: s.seqs for rid, s in streams.items()}
    assert all(seq.finish_reason == "abort" and seq.text for seq in final["aborted"])
    assert all(seq.logprobs and len(seq.logprobs) == len(seq.token_ids) for seq in final["n2-logprobs"])
    shown, skipped = final["specials-shown"][0], final["specials-skipped"][0]
    assert shown.token_ids == skipped.token_ids and {1, 2} <= set(shown.token_ids)
    assert "<|im_end|>\n<|im_start|>" in shown.text and "<|im_" not in skipped.text
    assert any(len(t.encode()) > 1 for t in final["bytes"][0].text)  # multi-byte characters went through


def copy_of(tokenizer):
    from server.api.tokens import stream_copy
    return stream_copy(tokenizer)


def test_the_end_of_a_text_the_api_streamed():
    from server.api.engine_client import rest_of
    assert rest_of("Hello world", "Hello w") == "orld"
    assert rest_of("Hello world", "") == "Hello world"
    # not a prefix (a tokenizer that is not prefix_stable never gets here): what follows the common part
    assert rest_of("Hello world", "Hello x") == "world"


def test_engine_errors_keep_their_attributes_across_the_channel():
    e = _wire(WireError.of(InvalidRequestError("bad", "max_tokens", "context_length_exceeded"))).rebuild()
    assert type(e) is InvalidRequestError and (str(e), e.param, e.code) == ("bad", "max_tokens",
                                                                            "context_length_exceeded")
    e = _wire(WireError.of(EngineUnavailableError("asleep", retry_after=7, code="sleeping"))).rebuild()
    assert type(e) is EngineUnavailableError and (e.retry_after, e.code) == (7, "sleeping")
    # An __init__ with more arguments than it passes on is rebuilt without calling it.
    e = _wire(WireError.of(TransferFailedError("broke", {"a.weight"}))).rebuild()
    assert type(e) is TransferFailedError and e.loaded == {"a.weight"} and str(e) == "broke"

    class Local(Exception):  # not importable by name on the other side: a RuntimeError with the message
        pass
    e = _wire(WireError.of(Local("odd"))).rebuild()
    assert type(e) is RuntimeError and "odd" in str(e)


def test_the_published_sleep_state_crosses_whole():
    from types import MappingProxyType
    state = SleepState(level=1, tag_states=MappingProxyType({"weights": "offloaded", "kv_cache": "discarded"}),
                       weights_valid=True, weight_version="v3")
    again = _wire(state)
    assert again == state and again.as_dict() == state.as_dict() and again.refusal == state.refusal
    assert isinstance(again.tag_states, MappingProxyType)


@pytest.mark.parametrize("long_turn", [False, True])
def test_calls_of_one_event_loop_turn_cross_as_one_message_in_order(long_turn, monkeypatch):
    """The API's calls made in one event-loop turn (a burst of requests, a batched prompt list) reach the
    engine as one message, so the engine admits them together; FIFO order holds (an add, then its abort),
    and the engine's reader takes a Call or a list of them alike. A turn that runs long (OUTBOX_HOLD_S; made
    to here) sends what it has so far at once: two messages of two calls, the same order."""
    import asyncio
    import socket
    from types import SimpleNamespace

    from server.config import EngineConfig
    from server.api import engine_client as client_module
    from server.wire.messages import Call, SyncChannel
    from server.api.engine_client import EngineClient

    monkeypatch.setattr(client_module, "OUTBOX_HOLD_S", -1.0 if long_turn else 3600.0)

    ours, theirs = socket.socketpair()
    engine_end = SyncChannel(theirs)
    ready = SimpleNamespace(info=None, status=SimpleNamespace(state=SleepState(), stats=None))

    async def main() -> list:
        client = EngineClient(EngineConfig(), None, ours, ready)  # type: ignore[arg-type]
        await client.attach()
        async def abort() -> None:
            client.notify("abort", "r1")

        # Four requests' tasks, as four connections' routes would run them in one turn.
        calls = [asyncio.ensure_future(client.call("add", f"r{i}", None, [1, 2], None)) for i in range(3)]
        calls.append(asyncio.ensure_future(abort()))
        got = [await asyncio.to_thread(engine_end.recv)]
        if long_turn:
            got[0] = got[0] + await asyncio.to_thread(engine_end.recv)
        client.notify("abort", "r2")  # a later turn: a message of its own, a lone Call
        got.append(await asyncio.to_thread(engine_end.recv))
        assert client.frames_sent == (3 if long_turn else 2)
        for c in calls:
            c.cancel()
        client._closing = True
        client._writer.close()
        return got

    burst, single = asyncio.run(main())
    theirs.close()
    assert type(burst) is list and [(c.name, c.args[0]) for c in burst] == [
        ("add", "r0"), ("add", "r1"), ("add", "r2"), ("abort", "r1")]
    assert [c.call_id for c in burst] == [0, 1, 2, None]
    assert isinstance(single, Call) and (single.name, single.args) == ("abort", ("r2",))
