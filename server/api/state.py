"""One word for the engine's state, read from its snapshot: for /health, 503 codes and /metrics."""
from __future__ import annotations

ENGINE_STATES = ("awake", "paused", "draining", "sleeping", "weights_invalid")


def engine_state_name(state: dict) -> str:
    # Order matters: it is the order in which the engine refuses work (see unavailable_reason).
    if state.get("draining"):
        return "draining"
    if state.get("sleeping_tags"):
        return "sleeping"
    if not state.get("weights_valid", True):
        return "weights_invalid"
    if state.get("paused"):
        return "paused"
    return "awake"
