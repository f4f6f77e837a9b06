"""Errors the engine raises to its callers; the API layer maps each to an HTTP status."""
from __future__ import annotations

from server.wire.params import InvalidRequestError

__all__ = ["InvalidRequestError", "EngineUnavailableError", "ConflictError", "EngineDeadError", "WorkerLostError",
           "WeightLoadError", "NonFiniteWeightsError"]


class EngineUnavailableError(RuntimeError):
    """The engine is asleep, paused, draining or holds no valid weights, or too many requests wait for
    it; retry later (HTTP 503 with Retry-After). `code` is the refusal's machine-readable reason."""

    def __init__(self, message: str, retry_after: int = 5, code: str | None = None):
        super().__init__(message)
        self.retry_after = retry_after
        self.code = code


class ConflictError(RuntimeError):
    """The operation clashes with the engine's current state (HTTP 409)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; the server must be restarted."""


class WorkerLostError(EngineDeadError):
    """A tensor-parallel worker process died: no rank can run without the others (HTTP 503; the server
    exits with code 3)."""


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the served model; raised before any weight is touched (HTTP 400)."""


class NonFiniteWeightsError(WeightLoadError):
    """An update wrote tensors holding NaN or Inf (HTTP 400, code nonfinite_weights); the weights are then
    invalid (503 weights_invalid) until a good update (server/model/finite.py checks them)."""

    def __init__(self, message: str, names: tuple[str, ...] = ()):
        super().__init__(message)
        self.names = names  # kept through pickling (BaseException.__reduce__ carries __dict__)
