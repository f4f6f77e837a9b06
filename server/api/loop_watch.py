"""A watch on the API process's event loop: a timer that should fire every PERIOD_S, logged when it fires late
by more than LATE_S (the loop was blocked: a long encode, a collection, a blocking call on the loop), so that a
stall seen from outside (a client, the engine's slow-send warning) can be placed in this process or not."""
from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("sleepserve.api")

PERIOD_S = 0.1
LATE_S = 0.5


async def watch_loop(name: str) -> None:
    """Runs until cancelled (the app's lifespan starts it and cancels it)."""
    while True:
        due = time.monotonic() + PERIOD_S
        await asyncio.sleep(PERIOD_S)
        late = time.monotonic() - due
        if late > LATE_S:
            log.warning("%s: the event loop was blocked for %.2f s", name, late)
