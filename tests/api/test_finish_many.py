"""A non-streamed request's prompts (generation.finish_many): each prompt's final output is handled as it
arrives, before later prompts have started. The engine here runs one prompt at a time and starts the next
only once the previous one's final output was handled: waiting for every prompt's first output first (as
start_many does for a stream) never finishes. Errors abort the rest and are raised."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from server.api import generation
from server.wire.outputs import RequestOutput
from server.wire.params import SamplingParams


class OneAtATime:
    """An engine stand-in with one slot: prompt i starts once i final outputs were handled."""

    def __init__(self, fail: int | None = None):
        self.handled = 0
        self.changed = asyncio.Condition()
        self.aborted: list[str] = []
        self.fail = fail

    async def note_handled(self) -> None:
        async with self.changed:
            self.handled += 1
            self.changed.notify_all()

    async def generate(self, request_id, prompt, prompt_token_ids, params, tracker):
        i = int(request_id.rsplit("-", 1)[1])
        done = False
        try:
            async with self.changed:
                await self.changed.wait_for(lambda: self.handled >= i)
            if i == self.fail:
                raise ValueError(f"prompt {i} refused")
            for finished in (False, True):
                yield RequestOutput(request_id, None, prompt_token_ids, [], finished)
            done = True
        finally:
            if not done:  # closed or cancelled before its end: the engine request is aborted
                self.aborted.append(request_id)


def fake_request(engine) -> SimpleNamespace:
    tracker = SimpleNamespace(observe=lambda out: None, finish=lambda out: None)
    metrics = SimpleNamespace(track=lambda now, params: tracker)

    async def receive():  # a client that stays
        await asyncio.Event().wait()

    return SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(engine=engine, metrics=metrics)), receive=receive)


def test_each_final_output_is_handled_before_later_prompts_start():
    async def run():
        engine = OneAtATime()
        order: list[int] = []

        def on_final(i, out):
            order.append(i)
            asyncio.get_running_loop().create_task(engine.note_handled())

        prompts = [(None, [i]) for i in range(5)]
        finals = await asyncio.wait_for(
            generation.finish_many(fake_request(engine), "cmpl-x", prompts, SamplingParams(), on_final), 10)
        return order, finals, engine

    order, finals, engine = asyncio.run(run())
    assert order == [0, 1, 2, 3, 4]
    assert [f.prompt_token_ids for f in finals] == [[i] for i in range(5)] and all(f.finished for f in finals)
    assert not engine.aborted


def test_a_failing_prompt_aborts_the_others_and_is_raised():
    async def run():
        engine = OneAtATime(fail=2)

        def on_final(i, out):
            asyncio.get_running_loop().create_task(engine.note_handled())

        with pytest.raises(ValueError, match="prompt 2 refused"):
            await asyncio.wait_for(generation.finish_many(fake_request(engine), "cmpl-y", [(None, [i]) for i in range(5)],
                                                          SamplingParams(), on_final), 10)
        return engine

    engine = asyncio.run(run())
    assert sorted(engine.aborted) == ["cmpl-y-2", "cmpl-y-3", "cmpl-y-4"]
