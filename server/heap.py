"""Keep the Python collector's full collections short in the server's processes.

After start-up a process holds hundreds of thousands of long-lived objects (torch, the model's modules,
the tokenizer, FastAPI): a full collection walks all of them (~180 ms on the 2-core CI host for the
embedded model's engine) and stops every Python thread meanwhile, so one that lands inside a sleep, a
wake or a step makes it that much slower for no reason of its own. gc.freeze() moves every object alive
at the end of start-up into a permanent generation the collector never walks again; objects made later
(requests, their outputs) are collected as before. vLLM freezes its engine's heap the same way.
"""
from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("sleepserve.server")


_frozen = 0  # objects this process froze (gc.get_freeze_count() walks them all: counted once here)


def frozen_objects() -> int:
    """The objects freeze_startup_heap() froze in this process (0 before it ran)."""
    return _frozen


def freeze_startup_heap(what: str) -> int:
    """Collect once (no garbage is frozen), then freeze what is left. Returns the objects frozen."""
    global _frozen
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = _frozen = gc.get_freeze_count()
    log.debug("%s: %d start-up objects frozen out of the collector's walks in %.0f ms", what, frozen,
              (time.perf_counter() - t0) * 1e3)
    return frozen
