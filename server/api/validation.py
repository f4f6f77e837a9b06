"""One message for a validation failure (pydantic's, or FastAPI's for query parameters): the first
problem, named by its field, with the rest counted. Used by body parsing and by the error handlers."""
from __future__ import annotations

from typing import Any, Sequence

# Pydantic names the member of a union that failed inside `loc` ("str", "list[str]"): noise for the
# client, except that the members together say which types the field takes.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part.startswith("function-"))


def _loc(loc: Sequence[Any]) -> tuple[str, str, list[str]]:
    """(dotted field path, the path up to the first union member, union members named in loc)."""
    out, tags, field = "", [], None
    for part in loc:
        if _is_type_tag(part):
            tags.append(part)
            field = out if field is None else field
        elif isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out, out if field is None else field, tags


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _without_body(loc: tuple) -> tuple:
    return loc[1:] if loc[:1] == ("body",) else loc


def describe_validation_error(errors: Sequence[Any], fastapi: bool = False) -> tuple[str, str | None]:
    """(message, param) for the first problem, with the rest counted: one clear thing to fix at a time.
    fastapi: the locs start with where the value came from; "body" is dropped (bodies are named as in
    the OpenAI API), "query" and "path" are kept, as vLLM's validation names them (`query.mode`)."""
    if fastapi:
        errors = [{**e, "loc": _without_body(tuple(e.get("loc", ())))} for e in errors]
    if not errors:
        return "the request is invalid", None
    first = errors[0]
    param, field, _ = _loc(first.get("loc", ()))
    # Errors under one union field are one problem: a value that fits none of the union's members.
    members = list(dict.fromkeys(m for e in errors for (_, f, tags) in [_loc(e.get("loc", ()))]
                                 if f == field for m in tags[:1]))
    if len(members) > 1:
        param = field
    got = first.get("input")
    if first.get("type") == "missing":
        text = f"{param} is required" if param else "a required field is missing"
    elif len(members) > 1:
        text = f"{param}: expected {' or '.join(members)} (got {_shown(got)})"
    else:
        text = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid value")
        if not isinstance(got, (dict, list)):
            text += f" (got {_shown(got)})"
    others = len({_loc(e.get("loc", ()))[1] for e in errors} - {field})
    if others:
        text += f"; and {others} more field(s) to fix"
    return text, param or None
