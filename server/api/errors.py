"""Every failure leaves the server as an OpenAI-shaped error: {"error": {message, type, param, code}}.

Engine errors map to statuses here and only here, so routes just raise and never pick a status.
Nothing a client sends may surface as a 500: anything unexpected is logged with its traceback and
answered with a message that points at the log (middleware.ContainErrors).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.wire.sleep_state import SleepState
from server.wire.errors import (ConflictError, EngineDeadError, EngineUnavailableError, InvalidRequestError,
                                NonFiniteWeightsError, WeightLoadError)

# The `type` field, by status, following OpenAI's vocabulary.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          500: "server_error", 503: "service_unavailable_error", 504: "timeout_error"}


class APIError(Exception):
    """An error the HTTP layer itself decides on (bad body, wrong key, unknown model)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error" if status < 500
                                                             else "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def unavailable_code(exc: EngineUnavailableError, state: SleepState | None) -> str:
    """A machine-readable reason for a 503: the refusal's own code, else the engine's state now."""
    if exc.code:
        return exc.code
    name = state.name if state is not None else "awake"
    return "unavailable" if name == "awake" else name


def as_api_error(exc: BaseException, state: SleepState | None = None) -> APIError | None:
    """The APIError an engine exception stands for; None for an unexpected exception (a bug)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), exc.param, exc.code)
    if isinstance(exc, NonFiniteWeightsError):
        return APIError(400, str(exc), None, "nonfinite_weights")
    if isinstance(exc, WeightLoadError):
        return APIError(400, str(exc), "path", "weight_load_error")
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), None, unavailable_code(exc, state),
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, ConflictError):
        return APIError(409, str(exc), None, "conflict")
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"{exc}; restart the server", None, "engine_dead")
    return None


def install_error_handlers(app: FastAPI) -> None:
    def state() -> SleepState | None:
        engine = getattr(app.state, "engine", None)
        return engine.state if engine is not None else None

    async def on_known(request: Request, exc: Exception) -> JSONResponse:
        err = as_api_error(exc, state())
        assert err is not None
        return error_response(err.status, err.message, err.param, err.code, err.headers)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own validation covers query parameters (the dev routes); bodies are parsed in body.py.
        from server.api.validation import describe_validation_error

        message, param = describe_validation_error(exc.errors(), fastapi=True)
        return error_response(400, message, param)

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            if request.url.path in DEV_PATHS:
                message += "; the dev-mode routes need --dev-mode (or SLEEPSERVE_DEV_MODE=1)"
            elif request.url.path in PROFILE_PATHS:
                message += "; the profiling routes need VLLM_TORCH_PROFILER_DIR set to a folder for the traces"
            return error_response(404, message, None, "not_found")
        if exc.status_code == 405:
            return error_response(405, f"{request.method} is not allowed on {request.url.path}", None,
                                  "method_not_allowed", headers=dict(exc.headers or {}))
        return error_response(exc.status_code, str(exc.detail), None, None, headers=dict(exc.headers or {}))

    for cls in (APIError, InvalidRequestError, WeightLoadError, EngineUnavailableError, ConflictError,
                EngineDeadError):
        app.add_exception_handler(cls, on_known)
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    # Anything else is a bug: middleware.ContainErrors answers it (a 500 that closes nothing else).


# Paths that exist only where VLLM_TORCH_PROFILER_DIR is set (api/profiling.py): a 404 says so.
PROFILE_PATHS = frozenset({"/start_profile", "/stop_profile"})
# Paths that exist only in dev mode: a 404 on them says how to turn them on.
DEV_PATHS = frozenset({"/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache", "/pause", "/resume",
                       "/is_paused", "/memory", "/collective_rpc", "/update_weights", "/server_info", "/get_world_size",
                       "/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
                       "/init_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_tensor",
                       "/update_weights_from_disk", "/release_memory_occupation", "/resume_memory_occupation",
                       "/get_weight_version"})
