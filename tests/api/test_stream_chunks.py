"""Streamed chunks built as text (ChunkFrame and the routes' common-chunk path) are byte for byte what
the general path (a dict through the JSON encoder, the envelope around it) writes: every text that
JSON escapes, token ids, n > 1, several prompts, usage on and off, first and last chunks."""
from __future__ import annotations

import json

import pytest

from server.api.chat import ChatChunks
from server.api.completions import CheckedPrompt, CompletionChunks
from server.api.schemas import ChatCompletionRequest, CompletionRequest
from server.wire.outputs import CompletionOutput, RequestOutput

TEXTS = ["", "plain", ' "quoted" \\ back', "tab\tnew\nline\r\x00\x1f\x7f", "caf\u00e9 \u4e2d\u6587 \U0001f600",
         "\u2028\u2029", "</script>", "\ufffd"]  # the last: what a split character decodes to


def _outputs(n: int, step: int, steps: int) -> list[CompletionOutput]:
    outs = []
    for i in range(n):
        text = TEXTS[(step + i) % len(TEXTS)]
        ids = [] if step % 5 == 4 else [step * 7 + i, 3]
        finish = ("length" if i % 2 else "stop") if step == steps - 1 else None
        outs.append(CompletionOutput(i, "whole", [1, 2], None, None, finish, "\n" if finish == "stop" else None,
                                     text, ids))
    return outs


def _run(fmt, prompts: int, n: int, steps: int, plain: bool) -> list[bytes]:
    fmt.plain = plain
    bodies = []
    for step in range(steps):
        for p in range(prompts):
            out = RequestOutput(f"r-{p}", None, [5, 6, 7], _outputs(n, step, steps), step == steps - 1)
            bodies.append(fmt.chunks((p, out)))
    return bodies


def _check(fast: list[bytes], general: list[bytes]) -> None:
    assert fast == general
    events = [e for body in fast for e in body.split(b"\n\n") if e]
    assert events and all(e.startswith(b"data: ") for e in events)
    for e in events:
        json.loads(e[len(b"data: "):])


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("token_ids", [False, True])
@pytest.mark.parametrize("n,prompts", [(1, 1), (3, 2)])
def test_completion_chunks_as_text_match_the_encoder(usage, token_ids, n, prompts):
    body = {"model": "m", "prompt": ["a"] * prompts, "n": n, "stream": True, "return_token_ids": token_ids,
            **({"stream_options": {"include_usage": True}} if usage else {})}
    checked = [CheckedPrompt("a", [5, 6, 7], "", "")] * prompts

    def make() -> CompletionChunks:
        return CompletionChunks("cmpl-\u00e9\"x", 1700000000, "my \"model\" \u4e2d", CompletionRequest(**body), checked)

    _check(_run(make(), prompts, n, 12, True), _run(make(), prompts, n, 12, False))


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("token_ids", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_chat_chunks_as_text_match_the_encoder(usage, token_ids, n):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": n, "stream": True,
            "return_token_ids": token_ids, **({"stream_options": {"include_usage": True}} if usage else {})}

    def make() -> ChatChunks:
        return ChatChunks("chatcmpl-1", 1700000000, "m\\n", ChatCompletionRequest(**body))

    _check(_run(make(), 1, n, 12, True), _run(make(), 1, n, 12, False))
