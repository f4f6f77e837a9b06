"""Request bodies, read by hand so every way a body can be wrong answers 400 with what to fix.

FastAPI's automatic body parsing would answer 422 in its own shape, and its answers to bytes that
are not UTF-8 or JSON are vague; here each failure names the problem and the field.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from server.api.errors import APIError
from server.api.validation import describe_validation_error

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger("sleepserve.api")

MAX_BODY_BYTES = 32 << 20  # a prompt far beyond any context still fits; a runaway upload does not
MAX_DEPTH = 64  # JSON nesting: OpenAI's bodies need 6 levels; 1,000 levels made the parsers recurse out
THREAD_PARSE_BYTES = 1 << 20  # a bigger body is parsed on a worker thread (32 MiB takes ~0.3 s)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def check_text(data: Any, escapes: bool = True) -> None:
    """Refuse what json.loads lets through but nothing downstream can use: nesting past MAX_DEPTH
    and lone UTF-16 surrogates ("\\ud800"), which no tokenizer, file name or UTF-8 encoder takes.
    Iterative, so the check itself cannot recurse out. escapes=False: the JSON text had no \\u
    escape, the only way a surrogate gets past a UTF-8 decode, so strings need no look (a trainer's
    update of 291 names and shapes: 0.6 -> 0.1 ms on the CI host)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise APIError(400, f"the request body is nested deeper than {MAX_DEPTH} levels; flatten it")
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(400, f"{where or 'the body'} holds a lone UTF-16 surrogate "
                                    f"({node[e.start]!a} at character {e.start}); send valid Unicode",
                               where or None) from None
        elif isinstance(node, dict):
            for key, value in node.items():
                if escapes and (not isinstance(key, str) or not _encodable(key)):
                    raise APIError(400, f"a key in {where or 'the body'} holds a lone UTF-16 surrogate; "
                                        "send valid Unicode", where or None)
                if escapes or depth >= MAX_DEPTH or isinstance(value, (dict, list)):
                    stack.append((value, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(node, list):
            if escapes or depth >= MAX_DEPTH:
                stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(node))
            else:
                stack.extend((v, where, depth + 1) for v in node if isinstance(v, (dict, list)))


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def decode_json(body: bytes, allow_empty: bool = False) -> dict[str, Any]:
    if not body.strip():
        if allow_empty:
            return {}
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start}); "
                            "send JSON encoded as UTF-8") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                            "send a JSON object") from None
    except RecursionError:
        raise APIError(400, f"the request body is nested deeper than {MAX_DEPTH} levels; flatten it") from None
    except ValueError as e:  # NaN / Infinity
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got a JSON {type(data).__name__}; "
                            'send {"field": value, ...}')
    check_text(data, escapes="\\u" in text)
    return data


async def read_json(request: Request, allow_empty: bool = False) -> dict[str, Any]:
    return await _read(request, None, allow_empty)


async def parse_body(request: Request, model: type[M], allow_empty: bool = False) -> M:
    body: M = await _read(request, model, allow_empty)
    if body.model_extra:
        log.debug("%s %s: ignoring unknown fields %s", request.method, request.url.path, sorted(body.model_extra))
    return body


async def _read(request: Request, model: type[BaseModel] | None, allow_empty: bool) -> Any:
    """The body as a dict (model None) or validated as `model`."""
    # The BodyLimit middleware (middleware.py) already refused a body over MAX_BODY_BYTES as it streamed in.
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes; send a smaller body")
    if len(raw) > THREAD_PARSE_BYTES:  # parsing 32 MiB takes ~0.3 s: keep the event loop free meanwhile
        return await asyncio.to_thread(_decode_and_validate, raw, model, allow_empty)
    return _decode_and_validate(raw, model, allow_empty)


def _decode_and_validate(raw: bytes, model: type[BaseModel] | None, allow_empty: bool) -> Any:
    data = decode_json(raw, allow_empty)
    if model is None:
        return data
    try:
        return model.model_validate(data)
    except RecursionError:
        raise APIError(400, f"the request body is nested deeper than {MAX_DEPTH} levels; flatten it") from None
    except ValidationError as e:
        message, param = describe_validation_error(e.errors(include_url=False))
        raise APIError(400, message, param) from None
