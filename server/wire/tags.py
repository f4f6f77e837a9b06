"""The names of the pool's tags, defined once, and the one function that reads a list of them.

Users name `weights` and `kv_cache` (vLLM's tag set). `cuda_graph` is internal: it sleeps with the
first tag that sleeps and wakes with whatever wake lets the engine run, so no flow can leave it asleep.
"""
from __future__ import annotations

from typing import Iterable

from server.wire.params import InvalidRequestError

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
CUDA_GRAPH = "cuda_graph"

USER_TAGS: tuple[str, ...] = (WEIGHTS, KV_CACHE)
INTERNAL_TAGS: tuple[str, ...] = (CUDA_GRAPH,)
ALL_TAGS: tuple[str, ...] = USER_TAGS + INTERNAL_TAGS


def parse_tags(tags: str | Iterable[str] | None, param: str = "tags") -> tuple[str, ...] | None:
    """Tags as callers write them: None or empty (all), one string, a list, comma-separated items
    (`?tags=a,b`) or repeats (`?tags=a&tags=b`). Returns them deduplicated in order, or None for all.
    Unknown and internal tags are a 400 naming the parameter."""
    raw = [tags] if isinstance(tags, str) else list(tags or [])
    names = [t.strip() for item in raw for t in str(item).split(",") if t.strip()]
    for name in names:
        if name in INTERNAL_TAGS:
            raise InvalidRequestError(
                f"{name!r} is internal: it sleeps with the first tag that sleeps and wakes with whatever wake "
                f"lets the engine run; name {' or '.join(USER_TAGS)}", param=param)
        if name not in USER_TAGS:
            raise InvalidRequestError(f"unknown tag {name!r}; tags are {', '.join(USER_TAGS)}", param=param)
    return tuple(dict.fromkeys(names)) or None
