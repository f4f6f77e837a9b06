"""The OpenAPI document, made truthful from one table instead of per-route annotations.

Routes read their bodies by hand (body.py) so every mistake answers 400 in OpenAI's shape; FastAPI
therefore saw no body at all and declared only its own 422, which this server never sends. Clients
and fuzzers generated from that document were misled. Here each operation gets its real request
body (the pydantic model body.py validates against), every status it can answer with OpenAI's error
object, and a streamed 200 where `stream: true` gives one. A route added without a row here is
still documented by FastAPI, just without a body; tests/http/test_reliability_input.py checks the rows.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from server.api.collective_rpc import CollectiveRpcRequest
from server.api.schemas import ChatCompletionRequest, CompletionRequest, UpdateWeightsRequest
from server.api.tokenize import DetokenizeRequest, TokenizeRequest
from server.api.weight_transfer import (FinishRequest, InitRequest, SglInitGroup, SglMemory, SglUpdateDisk,
                                        SglUpdateDistributed, SglUpdateTensor)

ERROR = {
    "type": "object", "required": ["error"], "title": "Error",
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}

WHY = {
    400: "invalid request (bad JSON, a field out of range, a prompt over the context)",
    401: "missing or wrong key (Authorization: Bearer <key>), when the server has one",
    403: "dev routes: a Host or Origin that is not this server's (cross-site use refused)",
    404: "the model is not the served one",
    409: "the request clashes with the sleep state (already asleep, nothing to wake, ...)",
    413: "the request body is over 32 MiB",
    415: "dev routes: a body that is not Content-Type application/json",
    503: "the engine is asleep, paused, draining, without valid weights, or dead (Retry-After says when to retry)",
    504: "collective_rpc: the method did not finish within `timeout` (it goes on)",
}

# The prompt is one text, a batch of one text, or token ids; pydantic sees Any.
PROMPT = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
]}

GENERATION = (400, 401, 404, 413, 503)
DEV_POST = (400, 401, 403, 409, 413, 415, 503)

# (path, method) -> (request body model, body required, error statuses, streams when stream=true)
OPERATIONS: dict[tuple[str, str], tuple[type[BaseModel] | None, bool, tuple[int, ...], bool]] = {
    ("/v1/completions", "post"): (CompletionRequest, True, GENERATION, True),
    ("/v1/chat/completions", "post"): (ChatCompletionRequest, True, GENERATION, True),
    ("/tokenize", "post"): (TokenizeRequest, True, (400, 401, 404, 413), False),
    ("/detokenize", "post"): (DetokenizeRequest, True, (400, 401, 404, 413), False),
    ("/v1/models", "get"): (None, False, (401,), False),
    ("/v1/models/{model_id}", "get"): (None, False, (401, 404), False),
    ("/version", "get"): (None, False, (), False),
    ("/load", "get"): (None, False, (), False),
    ("/health", "get"): (None, False, (503,), False),
    ("/metrics", "get"): (None, False, (), False),
    ("/sleep", "post"): (None, False, DEV_POST, False),
    ("/wake_up", "post"): (None, False, DEV_POST, False),
    ("/pause", "post"): (None, False, DEV_POST, False),
    ("/resume", "post"): (None, False, DEV_POST, False),
    ("/reset_prefix_cache", "post"): (None, False, DEV_POST, False),
    ("/start_profile", "post"): (None, False, (400, 401, 503), False),
    ("/stop_profile", "post"): (None, False, (400, 401, 503), False),
    ("/update_weights", "post"): (UpdateWeightsRequest, False, DEV_POST, False),
    ("/collective_rpc", "post"): (CollectiveRpcRequest, True, (*DEV_POST, 504), False),
    ("/init_weight_transfer_engine", "post"): (InitRequest, False, DEV_POST, False),
    ("/start_weight_update", "post"): (None, False, DEV_POST, False),
    ("/finish_weight_update", "post"): (FinishRequest, False, DEV_POST, False),
    ("/init_weights_update_group", "post"): (SglInitGroup, True, DEV_POST, False),
    ("/update_weights_from_distributed", "post"): (SglUpdateDistributed, True, DEV_POST, False),
    ("/update_weights_from_tensor", "post"): (SglUpdateTensor, True, DEV_POST, False),
    ("/update_weights_from_disk", "post"): (SglUpdateDisk, True, DEV_POST, False),
    ("/release_memory_occupation", "post"): (SglMemory, False, DEV_POST, False),
    ("/resume_memory_occupation", "post"): (SglMemory, False, DEV_POST, False),
    ("/get_weight_version", "get"): (None, False, (401, 403), False),
    ("/is_sleeping", "get"): (None, False, (401, 403), False),
    ("/is_paused", "get"): (None, False, (401, 403), False),
    ("/server_info", "get"): (None, False, (400, 401, 403), False),  # 400: config_format neither text nor json
    ("/get_world_size", "get"): (None, False, (401, 403), False),
    ("/memory", "get"): (None, False, (401, 403, 503), False),
}


def _schema_ref(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    if model is CompletionRequest:
        schema["properties"]["prompt"] = PROMPT
        schema.setdefault("required", []).append("prompt")
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = ERROR
    for path, methods in doc.get("paths", {}).items():
        for method, op in methods.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)  # FastAPI's; this server answers 400 in OpenAI's shape
            row = OPERATIONS.get((path, method))
            if row is None:
                continue
            model, required, errors, streams = row
            if model is not None:
                op["requestBody"] = {"required": required, "content": {
                    "application/json": {"schema": _schema_ref(model, components)}}}
            if path == "/metrics":  # Prometheus' text format, not JSON
                responses["200"] = {"description": "Prometheus metrics", "content": {
                    "text/plain": {"schema": {"type": "string"}}}}
            if streams:
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {})["text/event-stream"] = {
                    "schema": {"type": "string", "description": "with stream: true, Server-Sent Events "
                                                                "ending in data: [DONE]"}}
            for status in errors:
                responses[str(status)] = {"description": WHY[status], "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return doc


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
