"""One word for the engine's state, read from its snapshot: for /health, 503 codes and /metrics."""
from __future__ import annotations

from server.engine.sleep_plan import refusal

ENGINE_STATES = ("awake", "paused", "draining", "sleeping", "weights_invalid")


def engine_state_name(state: dict) -> str:
    refused = refusal(state)
    return refused[0] if refused else "awake"
