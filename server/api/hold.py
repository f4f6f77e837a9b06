"""Requests that arrive while the engine cannot serve (paused, asleep, draining, weights invalid) wait
here, on the event loop, until it can, as current vLLM does; bounded in number and in time.

With `while_asleep="reject"` nothing waits: such requests get 503 + Retry-After at once (for
deployments behind a load balancer that would rather retry elsewhere).
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from server.wire.errors import EngineUnavailableError
from server.wire.sleep_state import SleepState

WHILE_ASLEEP = ("hold", "reject")


@dataclass(frozen=True)
class HoldPolicy:
    while_asleep: str = "hold"       # hold | reject
    max_held: int = 1024             # more requests than this waiting: 503 at once
    max_wait_s: float = 600.0        # a request held longer than this: 503 (the OpenAI client's own timeout)


class HeldRequests:
    """The gate in front of the engine. Every wait re-reads the published SleepState; the engine client
    calls `state_changed` when a frame brings a new one (or the engine died), which wakes every waiter."""

    def __init__(self, policy: HoldPolicy, state: Callable[[], SleepState],
                 dead: Callable[[], BaseException | None] = lambda: None):
        self.policy = policy
        self._state = state
        self._dead = dead  # a dead engine ends every wait at once (503), it never wakes; so does close()
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed: str | None = None  # why nothing is held any more (the server stops)
        self.by_reason: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.by_reason.values())

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def state_changed(self, _state: SleepState) -> None:
        """Any thread: wake the waiters so they look at the new state."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._signal)

    def _signal(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def close(self, message: str) -> None:
        """On the event loop: every held request, and every later one that would wait, gets 503 `message`
        (a server whose grace period ended: nothing would wake it any more)."""
        self._closed = message
        self._signal()

    def _raise_if_ended(self) -> None:
        dead = self._dead()
        if dead is not None:
            raise dead
        if self._closed is not None:
            raise EngineUnavailableError(self._closed, code="shutting_down")

    def refuse_now(self) -> None:
        """503 at once (no waiting, no round trip) in reject mode while the engine cannot serve, and in
        any mode when nothing but new weights would end the refusal (Refusal.holds)."""
        refused = self._state().refusal
        if refused is not None and (self.policy.while_asleep == "reject" or not refused.holds):
            raise EngineUnavailableError(refused.message, code=refused.code)

    async def wait_until_servable(self, deadline: float | None = None) -> float | None:
        """Return the deadline once the engine can serve (at once when it can). Raises 503 past the
        limits, or at once in reject mode. A cancelled wait (the client left) just ends."""
        self._raise_if_ended()
        refused = self._state().refusal
        if refused is None:
            return deadline
        if self.policy.while_asleep == "reject" or not refused.holds:
            raise EngineUnavailableError(refused.message, code=refused.code)
        if self.count >= self.policy.max_held:
            raise EngineUnavailableError(
                f"{self.count} requests already wait for the server ({refused.message}); the limit is "
                f"{self.policy.max_held} (--max-held-requests); retry later", code=refused.code)
        if deadline is None:
            deadline = time.monotonic() + self.policy.max_wait_s
        self.attach(asyncio.get_running_loop())
        reason = refused.code
        self.by_reason[reason] += 1
        try:
            while refused is not None:
                if reason != refused.code:  # e.g. weights_invalid -> paused after an update while paused
                    self.by_reason[reason] -= 1
                    if not self.by_reason[reason]:
                        del self.by_reason[reason]
                    reason = refused.code
                    self.by_reason[reason] += 1
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineUnavailableError(
                        f"held {self.policy.max_wait_s:g} s (--held-request-timeout) and the server still cannot "
                        f"serve: {refused.message}", code=refused.code)
                if self._changed is None:
                    self._changed = asyncio.Event()
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
                self._raise_if_ended()
                refused = self._state().refusal
                if refused is not None and not refused.holds:  # e.g. a level-2 sleep woken without new weights
                    raise EngineUnavailableError(refused.message, code=refused.code)
        finally:
            self.by_reason[reason] -= 1
            if not self.by_reason[reason]:
                del self.by_reason[reason]
        return deadline
