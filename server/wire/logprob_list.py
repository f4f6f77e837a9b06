"""A sequence's sampled log-probs as the engine keeps them: one plain tuple per token, read as TokenLogprobs
dicts only when someone reads them.

Why tuples: an RL rollout asks for log-probs on every token of thousands of sequences (256 prompts x 8
x 512 tokens is a million entries). As a dict holding a Logprob per token that is two objects the
collector tracks per token, and its full collections walked all of them: py-spy put 30% of the 1B
rollout's engine thread on the line that built them (H200, 2026-12-01). A tuple of numbers and a string
is untracked by the first collection it survives, and pickles as it is (the engine process sends these
tuples to the API over the channel).

    WireLogprobs = (token id, logprob, rank, text) of the sampled token, then the same four for each of
                   the top-k it was asked for.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from server.wire.outputs import Logprob, TokenLogprobs

WireLogprobs = tuple


def token_logprobs(wire: WireLogprobs) -> TokenLogprobs:
    """The TokenLogprobs dict of one WireLogprobs tuple: the top-k first, then the sampled token (which keeps
    its own rank when it is among them)."""
    if len(wire) == 4:
        return {wire[0]: Logprob(wire[1], wire[2], wire[3])}
    entry = {wire[j]: Logprob(wire[j + 1], wire[j + 2], wire[j + 3]) for j in range(4, len(wire), 4)}
    entry[wire[0]] = Logprob(wire[1], wire[2], wire[3])
    return entry


class LogprobList(Sequence):
    """CompletionOutput.logprobs: reads as a list of TokenLogprobs dicts (vLLM's shape), built per access
    from `wire`, the WireLogprobs tuples (which the API's formatting reads directly)."""

    __slots__ = ("wire",)

    def __init__(self, wire: list[WireLogprobs]):
        self.wire = wire

    def __len__(self) -> int:
        return len(self.wire)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return LogprobList(self.wire[i])
        return token_logprobs(self.wire[i])

    def __iter__(self) -> Iterator[TokenLogprobs]:
        return map(token_logprobs, self.wire)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LogprobList):
            return self.wire == other.wire
        return isinstance(other, (list, tuple)) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"LogprobList({list(self)!r})"
