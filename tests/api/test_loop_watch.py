"""The API's event-loop watch logs a loop blocked past LATE_S, with how long it was blocked."""
from __future__ import annotations

import asyncio
import logging
import time

from server.api import loop_watch


def test_a_blocked_loop_is_logged(caplog):
    async def run(block_s: float) -> None:
        watch = asyncio.ensure_future(loop_watch.watch_loop("API process test"))
        await asyncio.sleep(0.25)  # free: the timer fires on time
        time.sleep(block_s)        # the loop blocked (as a long encode on it would)
        await asyncio.sleep(0.25)
        watch.cancel()

    with caplog.at_level(logging.WARNING, logger="sleepserve.api"):
        asyncio.run(run(loop_watch.LATE_S + 0.4))
    blocked = [r.getMessage() for r in caplog.records if "blocked" in r.getMessage()]
    assert blocked and all("API process test" in m for m in blocked), blocked
    seconds = max(float(m.split("blocked for ")[1].split(" s")[0]) for m in blocked)
    assert seconds >= loop_watch.LATE_S + 0.4 - loop_watch.PERIOD_S, blocked
