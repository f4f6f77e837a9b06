"""Errors the engine raises to its callers; the API layer maps each to an HTTP status."""
from __future__ import annotations

from server.engine.params import InvalidRequestError

__all__ = ["InvalidRequestError", "EngineUnavailableError", "ConflictError", "EngineDeadError"]


class EngineUnavailableError(RuntimeError):
    """The engine is asleep, paused, draining or holds no valid weights; retry later (HTTP 503)."""

    def __init__(self, message: str, retry_after: int = 5):
        super().__init__(message)
        self.retry_after = retry_after


class ConflictError(RuntimeError):
    """The operation clashes with the engine's current state (HTTP 409)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; the server must be restarted."""
